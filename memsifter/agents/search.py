"""``agent:search``: a Search-R1-style agent that searches a user's memory, as plain text with stop strings.

Protocol (SmolLM2 has no tool calls, so everything is text in chat messages):

1. one user message: what the agent does, the question (and its date), how to search and answer;
2. the model replies; it may think in ``<think>…</think>``, then either writes ``<search>query</search>``
   (generation stops at ``</search>``) or ``<answer>…</answer>`` (stops at ``</answer>``);
3. after a search the environment adds a user message ``<information>…</information>`` holding the top
   ``topk`` hits (each session trimmed to ``hit_tokens``: the lines sharing the most words with the query,
   in their order; a session shown before is named, not repeated) and how many searches are left; the
   next request has ``continues=True`` (previous messages + the assistant's reply + this observation);
4. a reply with neither action gets a one-line correction as its observation (it uses up a turn);
5. after ``max_turns`` searches (or corrections) one last request (``kind="answer"``, stop ``</answer>``)
   asks for the answer.

Parser (:func:`parse_reply`): tags ``think``, ``search``, ``answer`` well formed (:func:`scan_tags`: closed,
not nested), ``<information>`` never written by the model, no empty query or answer; the answer is the
last ``<answer>``. ``Result.format_ok`` is False when any reply was malformed or no answer came.

Constructor (:class:`SearchAgent`), defaults sized for SmolLM2-135M-Instruct's 8,192-token window
(tokens as ``count_tokens`` counts them; the default :func:`approx_tokens` over-counts SmolLM2's by ~20%):

* ``topk=3`` hits per search, ``hit_tokens=600`` per hit, ``max_turns=3`` searches,
* ``max_tokens=256`` per reply, ``answer_tokens=64`` for the last forced-answer reply,
* ``question_tokens=256`` (a longer question is cut), ``context_tokens=8192`` (the constructor refuses
  budgets whose worst case does not fit: prompt + every observation + every reply),
* ``count_tokens: Callable[[str], int]`` (default :func:`approx_tokens`; :func:`hf_counter` for a
  Hugging Face tokenizer's exact counts).

``oracle(task, answer, evidence, queries=None)``: what a correct agent writes, for SFT warm-start traces: one
search whose query is the question's keywords (:func:`keywords`: stopwords out, order kept), then
``<answer>{answer}</answer>``. Given several ``queries`` (:func:`query_variants`), it searches again with the
next one while its hits show no line of ``evidence`` (up to ``max_turns`` searches): traces that search again
when the first search missed.

:func:`http_search` ``(base_url, corpus_id, api_key_env=None, timeout=30.0, topk_max=None) -> Search``: the
memory service's Search-R1 endpoint ``POST {base_url}/retrieve`` with ``{"queries": [q], "topk": k,
"return_scores": true, "corpus_id": corpus_id}`` over real HTTP; the key (``Authorization: Bearer``) is
read from the environment variable named, never logged; errors are one line (:class:`SearchError`).
"""

from __future__ import annotations

import os
import re
from typing import Callable, Generator, Sequence

from ..retrieval.render import _STOP, content_words
from ..security.redact import bare_url, redact, remember, url_auth
from .base import (Hit, Request, Result, Search, Task, TokenCounter, approx_tokens, clip, close_stop,
                   scan_tags, trim_to_tokens)

STOP_SEARCH, STOP_ANSWER = "</search>", "</answer>"
TAGS = ("think", "search", "answer")
ENV_TAGS = ("information",)

PROMPT = """You can look through the record of this user's earlier conversations with you before answering.

Question{date}: {question}

How to work:
- To look something up, write a short query between <search> and </search>. The conversations that match best will come back between <information> and </information>.
- You may search up to {turns} times. You may write your reasoning between <think> and </think> first.
- Once you know enough, write only the answer, in a few words, between <answer> and </answer>. For example: <answer>in March</answer>"""

OBSERVATION_MORE = "{info}\n\nSearches left: {left}. Search again with <search>…</search>, or give the answer between <answer> and </answer>."
OBSERVATION_LAST = "{info}\n\nNo searches are left. Write the answer now, in a few words, between <answer> and </answer>."
CORRECTION = ("Your reply had no <search>…</search> and no <answer>…</answer>{why}. Use one of them.")

# words that carry no search value beyond render's stopword list
_EXTRA_STOP = frozenset("many much long ago tell remind remember mentioned mention did does know recall "
                        "ever said say told like also there then than into".split())
_WORD = re.compile(r"[A-Za-z0-9][A-Za-z0-9'\-]*")


def keywords(question: str) -> str:
    """The question's content words in their order, once each: stopwords and 1-2 letter words out
    (numbers kept). The oracle's query."""
    seen: set[str] = set()
    out: list[str] = []
    for w in _WORD.findall(question):
        lw = w.lower().strip("'-")
        if lw.endswith("'s"):
            lw = lw[:-2]
        if not lw or lw in _STOP or lw in _EXTRA_STOP or (len(lw) < 3 and not lw.isdigit()) or lw in seen:
            continue
        seen.add(lw)
        out.append(w.strip("'-").removesuffix("'s"))
    return " ".join(out) or question.strip()


def query_variants(question: str) -> list[str]:
    """Queries a searcher could write for ``question``, distinct, in this order: its keywords (:func:`keywords`), the
    question itself (without its question mark), the second half of the keywords, the first half. The oracle's
    queries when prepare-agents writes several traces per question (``search_traces``) or searches again
    (``search_retry``)."""
    kw = keywords(question).split()
    out: list[str] = []
    for v in (" ".join(kw), " ".join(question.strip().rstrip("?").split()), " ".join(kw[len(kw) // 2:]),
              " ".join(kw[:(len(kw) + 1) // 2])):
        if v.strip() and v not in out:
            out.append(v)
    return out


class ParsedReply:
    """One reply read: ``action`` "search", "answer" or None; ``content`` the query or answer; ``problems``."""

    __slots__ = ("action", "content", "problems")

    def __init__(self, action: str | None, content: str | None, problems: list[str]):
        self.action, self.content, self.problems = action, content, problems

    @property
    def ok(self) -> bool:
        return self.action is not None and not self.problems


def parse_reply(text: str) -> ParsedReply:
    """Read one reply (already closed with :func:`close_stop`). An answer wins over a search in the same
    reply (the last answer); else the last search. Nested, stray or unclosed tags: no action. Other problems
    (two searches, an ``<information>`` written by the model) make the reply malformed but its action is
    still taken, so a small slip does not end the episode."""
    tags = scan_tags(text, TAGS, ENV_TAGS)
    problems = list(tags.problems)
    if any("environment" not in p for p in problems):   # nested, stray or unclosed tags: nothing to act on
        return ParsedReply(None, None, problems)
    answer, query = tags.last("answer"), tags.last("search")
    if answer is not None:
        if not answer:
            problems.append("empty <answer>")
            return ParsedReply(None, None, problems)
        return ParsedReply("answer", answer, problems)
    if query is not None:
        if not query:
            problems.append("empty <search>")
            return ParsedReply(None, None, problems)
        if tags.count("search") > 1:
            problems.append("more than one <search> in a reply")
        return ParsedReply("search", query, problems)
    return ParsedReply(None, None, problems or ["no <search> and no <answer>"])


def condense_hit(text: str, query: str, budget: int, count: TokenCounter) -> str:
    """``text`` when it fits ``budget``; else its lines sharing the most content words with ``query``
    (at least the best one, cut if needed), while they fit, in their original order."""
    if count(text) <= budget:
        return text
    lines = text.splitlines(keepends=True)
    q = content_words(query)
    score = [len(q & content_words(ln)) for ln in lines]
    order = sorted(range(len(lines)), key=lambda i: (-score[i], i))
    keep, used = [], 0
    for i in order:
        c = count(lines[i])
        if used + c > budget:
            if not keep:
                keep.append(i)
                lines[i] = trim_to_tokens(lines[i], budget, count)
                break
            continue
        keep.append(i)
        used += c
    keep.sort()
    out, prev = [], -1
    for i in keep:
        if prev >= 0 and i > prev + 1:
            out.append("…\n")
        out.append(lines[i])
        prev = i
    return "".join(out)


class SearchAgent:
    method = "agent:search"

    def __init__(self, topk: int = 3, hit_tokens: int = 600, max_turns: int = 3, max_tokens: int = 256,
                 answer_tokens: int = 64, question_tokens: int = 256, context_tokens: int = 8192,
                 count_tokens: TokenCounter | None = None):
        if min(topk, hit_tokens, max_turns, max_tokens, answer_tokens, question_tokens) < 1:
            raise ValueError("agent:search: topk, hit_tokens, max_turns, max_tokens, answer_tokens and "
                             "question_tokens must be at least 1")
        self.topk, self.hit_tokens, self.max_turns = topk, hit_tokens, max_turns
        self.max_tokens, self.answer_tokens, self.question_tokens = max_tokens, answer_tokens, question_tokens
        self.context_tokens = context_tokens
        self.count = count_tokens or approx_tokens
        worst = self.worst_case_tokens()
        if worst > context_tokens:
            raise ValueError(f"agent:search: the worst case needs {worst} tokens (prompt, {max_turns} turns of "
                             f"{topk} hits x {hit_tokens} tokens and {max_tokens}-token replies), more than "
                             f"context_tokens={context_tokens}: lower topk, hit_tokens, max_turns or max_tokens")

    # per message: chat-template markers and role (SmolLM2: ~5 tokens), with room to spare
    _MSG = 16
    # per hit: its header line and the "…" marks between kept lines
    _HIT = 40

    def worst_case_tokens(self) -> int:
        prompt = self.count(PROMPT) + self.question_tokens + 16 + self._MSG
        obs = self.topk * (self.hit_tokens + self._HIT) + self.count(OBSERVATION_MORE) + 16 + self._MSG
        return prompt + self.max_turns * (obs + self.max_tokens + self._MSG) + self.answer_tokens + self._MSG

    # ------------------------------------------------------------------ prompt and observations
    def first_message(self, task: Task) -> str:
        q = trim_to_tokens(task.question.strip(), self.question_tokens, self.count)
        date = f" (asked on {task.question_date})" if task.question_date else ""
        return PROMPT.format(date=date, question=q, turns=self.max_turns)

    def information(self, hits: Sequence[Hit], query: str, shown: set[str]) -> str:
        if not hits:
            return "<information>\nNothing matched this query.\n</information>"
        parts = []
        for n, h in enumerate(hits, 1):
            head = f"[{n}] conversation of {h.date}" if h.date else f"[{n}] conversation"
            if h.session_id and h.session_id in shown:
                parts.append(f"{head}: shown above already.")
                continue
            shown.add(h.session_id)
            body = condense_hit(h.text.strip("\n"), query, self.hit_tokens, self.count).strip("\n")
            parts.append(f"{head}:\n{body}")
        return "<information>\n" + "\n\n".join(parts) + "\n</information>"

    # ------------------------------------------------------------------ the episode
    def episode(self, task: Task) -> Generator[Request, str, Result]:
        if task.search is None:
            raise ValueError(f"agent:search: question {task.question_id} has no search scope (Task.search)")
        messages = [{"role": "user", "content": self.first_message(task)}]
        res = Result(answer=None, format_ok=True)
        shown: set[str] = set()
        turn = 0           # actions used (searches and corrections)
        continues = False
        forced = False
        while True:
            stop = [STOP_ANSWER] if forced else [STOP_SEARCH, STOP_ANSWER]
            req = Request(messages=list(messages), stop=stop,
                          max_tokens=self.answer_tokens if forced else self.max_tokens,
                          continues=continues, kind="answer" if forced else "search",
                          meta={"turn": turn, "question_id": task.question_id, "question": task.question})
            raw = yield req
            text = close_stop(raw or "", stop)
            p = parse_reply(text)
            step = {"kind": req.kind, "reply": clip(text), "action": p.action, "est_prompt_tokens":
                    sum(self.count(m["content"]) + self._MSG for m in messages)}
            if p.problems:
                step["problems"] = p.problems
                res.format_ok = False
            res.steps.append(step)
            if forced and p.action == "search":   # a search when only an answer may come: nothing to answer
                p = ParsedReply(None, None, p.problems + ["a search after the last turn"])
                res.format_ok = False
            if p.action == "answer":
                res.answer = p.content
                break
            if forced:
                break
            turn += 1
            if p.action == "search":
                res.searches += 1
                hits = list(task.search(p.content, self.topk))[: self.topk]
                step["query"] = p.content
                step["hits"] = [h.session_id for h in hits]
                info = self.information(hits, p.content, shown)
            else:
                why = "; " + "; ".join(p.problems) if p.problems else ""
                info = CORRECTION.format(why=clip(why, 200))
            left = self.max_turns - turn
            obs = (OBSERVATION_MORE.format(info=info, left=left) if left > 0
                   else OBSERVATION_LAST.format(info=info))
            forced = left <= 0
            messages = messages + [{"role": "assistant", "content": text}, {"role": "user", "content": obs}]
            continues = True
        if res.answer is None:
            res.format_ok = False
        return res

    # ------------------------------------------------------------------ warm start
    def oracle(self, task: Task, answer: str, evidence: Sequence[str] = (),
               queries: Sequence[str] | None = None) -> Callable[[Request], str]:
        """A policy writing what a correct agent writes: a search with ``queries[0]`` (default: the question's
        keywords), then ``<answer>{answer}</answer>``. With more than one query it searches again with the next
        while the last observation shows no line of ``evidence`` (the evidence turns as rendered), at most
        ``max_turns`` searches in all; with no evidence lines it cannot tell, and answers after the first."""
        qs = list(queries) if queries else [keywords(task.question)]

        def policy(req: Request) -> str:
            if req.kind == "search":
                n = int(req.meta.get("turn", 0))   # searches so far (the oracle's replies are never malformed)
                seen = req.continues and (not evidence or any(e in req.messages[-1]["content"] for e in evidence))
                if n == 0 or (not seen and n < len(qs)):
                    return f"<search>{qs[n]}</search>"
            return f"<answer>{answer}</answer>"

        return policy


# --------------------------------------------------------------------------- the memory service as search
class SearchError(RuntimeError):
    """The memory service could not answer a search (one line: URL, status, the service's detail)."""


def _title(contents: str) -> tuple[str | None, str]:
    """A document's first line is ``{date} | session {id}`` or ``session {id}``: (date, the rest)."""
    title, _, body = contents.partition("\n")
    date = title.split(" | session ", 1)[0] if " | session " in title else None
    return date, body


def http_search(base_url: str, corpus_id: str, api_key_env: str | None = None, timeout: float = 30.0,
                topk_max: int | None = None) -> Search:
    """A :data:`Search` over the memory service: ``POST {base_url}/retrieve`` (Search-R1's request with
    ``corpus_id``: the question's haystack as published, or a user's memory); ``api_key_env`` names the
    environment variable holding the key (sent as ``Authorization: Bearer``); a ``user:password`` the URL
    was given with (:func:`memsifter.security.redact.bare_url`) is sent as Basic auth instead. ``topk_max``
    caps what is asked. The returned callable is thread-safe; ``.close()`` ends its connection pool."""
    import httpx

    url = bare_url(base_url).rstrip("/") + "/retrieve"
    auth = url_auth(base_url)
    key = None
    if api_key_env:
        key = os.environ.get(api_key_env)
        if not key:
            raise SearchError(f"search: environment variable {api_key_env} (the memory service's key) is not set")
    remember(key)
    headers = {"Authorization": f"Bearer {key}"} if key and not auth else {}
    secrets = [key] if key else []
    shown_url = redact(url, secrets)
    client = httpx.Client(timeout=timeout, headers=headers, auth=auth)

    def search(query: str, k: int) -> list[Hit]:
        k = min(k, topk_max) if topk_max else k
        body = {"queries": [query], "topk": k, "return_scores": True, "corpus_id": corpus_id}
        try:
            r = client.post(url, json=body)
        except httpx.HTTPError as e:
            raise SearchError(redact(f"search {shown_url} (corpus {corpus_id}): {type(e).__name__}: "
                                     f"{str(e)[:200]}", secrets).replace("\n", " ")) from None
        if r.status_code != 200:
            try:
                detail = str(r.json().get("detail", ""))
            except ValueError:
                detail = r.text
            raise SearchError(redact(f"search {shown_url} (corpus {corpus_id}): HTTP {r.status_code}: "
                                     f"{detail[:300]}", secrets).replace("\n", " "))
        try:
            docs = r.json()["result"][0]
            hits = []
            for d in docs:
                doc = d["document"] if isinstance(d, dict) and "document" in d else d
                date, text = _title(doc["contents"])
                hits.append(Hit(session_id=str(doc.get("id", "")), text=text,
                                score=float(d.get("score", 0.0)) if isinstance(d, dict) else 0.0, date=date))
        except (ValueError, KeyError, IndexError, TypeError) as e:
            raise SearchError(f"search {shown_url} (corpus {corpus_id}): unexpected response "
                              f"({type(e).__name__}: {str(e)[:100]})") from None
        return hits

    search.close = client.close  # type: ignore[attr-defined]
    return search


# --------------------------------------------------------------------------- the service's URL and key (stages' configs)
def check_search_url(url: str) -> None:
    from ..errors import ConfigError
    from ..models.llm import http_url_ok
    from ..security.redact import redact, strip_userinfo

    if not http_url_ok(url):
        shown = strip_userinfo(url)[0] if "://" in url else url
        raise ConfigError(f"search_url = {redact(shown)!r}: expected the memory service's http:// or https:// base "
                          "URL, e.g. http://127.0.0.1:8000")


def search_key(env: str | None) -> str | None:
    """The memory service's key from the variable ``env`` names (None: anonymous access); a variable named
    but unset is one line."""
    from ..errors import ConfigError

    if not env:
        return None
    key = os.environ.get(env)
    if not key:
        raise ConfigError(f"search_api_key_env: the variable {env} is not set (the memory service's API key); set "
                          "it (in Kubernetes: from a Secret) or set search_api_key_env: null for anonymous access")
    return key
