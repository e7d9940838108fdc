"""The session window of a prompt: which haystack sessions a prompt shows, how, in what order, and
at what token cost. One builder for every prompt that shows a history.

Why one: the ranker is trained on the prompts prepare-rl writes and served the prompts the rank stage
builds; if the two pick, condense, list or cost sessions differently, the served model sees inputs it
was never trained on (a silent train/serve skew). So ``rank`` (serving), ``prepare-rl`` (training
rows) and ``chat`` (the working LLM's context) all build their history with :class:`PromptBuilder`.

The token-cost model (the rank stage's, MEMSIFTER.md §4), counted with the model's tokenizer:

1. *Fixed part*: the whole prompt with an empty history, through the tokenizer's chat template
   (template text, question, every other slot, the answer prefill if any). The history budget is
   ``limit`` minus that (or a given ``history_budget``, the limit then being the fixed part plus it).
2. *A session's cost*: its text as shown (whole, or condensed to ``session_tokens``) plus its header
   and footer, counted with a worst-case local id (``<session{N}>`` for a haystack of N sessions,
   whatever id it ends up with) and its date. Counts stop past ``limit`` (``cap``): a huge session
   is tokenized only until it is known not to fit.
3. Sessions are taken in the given order (``required`` ones first, whatever they cost) while their
   costs fit the history budget; with ``stop_at_first_overflow`` the scan stops at the first that
   does not fit.
4. The final prompt is counted exactly; while it exceeds ``limit``, the last session taken that is not
   required is dropped.
5. The chosen sessions are listed by ``history_order`` (:func:`memsifter.retrieval.context.shown_order`): local
   id i is the i-th listed session.

The settings of a ranker's window are one model, :class:`WindowSettings`: the rank stage's config, prepare-rl's
and the memory service's ranker settings are all of it, so a ranker is trained and served with the same
fields, descriptions and defaults (``context_limit``: 131,072 tokens, MEMSIFTER.md §4).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from pydantic import BaseModel, Field

from .context import HistoryOrder, fill_budget, shown_order
from .prompting import fill
from .render import condense_session, render_history_texts, render_session

# Why a haystack session is not in the window (``Window.left_out``).
OVER_BUDGET = "larger than the history budget"
NO_ROOM = "did not fit after the sessions taken before it"
NOT_REACHED = "not tried: the scan stopped at the first session that did not fit"
NOT_A_CANDIDATE = "not in the order given"
TRIMMED = "dropped: the exact prompt count was over the limit"

# The exact count of a prompt whose estimate is over this many times the limit (only required sessions
# can make it so) is not taken: tokenizing a 50 MB session whole costs gigabytes, and the row is
# known to be over the limit anyway; the estimate (a lower bound) is reported instead.
EXACT_COUNT_FACTOR = 4


def prompt_messages(template: str, question: str, texts: Sequence[str], dates: Sequence[str | None] | None,
                    slots: Mapping[str, str] | None = None, answer_prefix: str = "") -> list[dict]:
    """The chat messages of a prompt that shows ``texts`` (sessions as shown, with their dates) with local
    ids 0..n-1 in the order given: ``template`` filled (``{history}``, ``{current}`` = ``question`` and
    ``slots``), then ``answer_prefix`` as an assistant prefill. Every prompt that shows a history is made
    here: the window's (:meth:`PromptBuilder.messages`) and the reward's working-LLM prompt over the
    sessions a ranking chose (:func:`memsifter.training.rewards.answer_messages`)."""
    hist = render_history_texts(list(texts), list(dates) if dates is not None else None)
    msgs = [{"role": "user", "content": fill(template, history=hist, current=question, **(slots or {}))}]
    if answer_prefix:
        msgs.append({"role": "assistant", "content": answer_prefix})
    return msgs


def answer_slots(question_date: str | None) -> dict[str, str]:
    """The working LLM's prompt slots besides the history and the question (``prompts/chat.txt``): the
    question's date. The chat stage and the reward fill them alike."""
    return {"date": question_date or "unknown"}


# A ranker prompt's size at most, in the ranker's tokens (MEMSIFTER.md §4: the original's 128k window).
CONTEXT_LIMIT = 131072


class WindowSettings(BaseModel):
    """The session window of a ranker's prompt: what the rank stage serves, prepare-rl trains on and the
    memory service's ranker serves (each config is this model plus its own fields). :meth:`builder` makes
    the :class:`PromptBuilder` of these settings."""

    context_limit: int = Field(CONTEXT_LIMIT, gt=0, description="prompt tokens at most, counted with the ranker's "
                               "tokenizer through its chat template (template, question, history, answer prefill); "
                               "with max_tokens it must fit the model's context")
    session_tokens: int | None = Field(None, gt=0, description="show each session in at most this many tokens: "
                                       "a longer one keeps the turns sharing the most words with the question, in "
                                       "order (so a small-context ranker sees more sessions); default: whole")
    history_order: HistoryOrder = Field("chronological", description="how the shown sessions are listed (their "
                                        "local ids follow this list): chronological (the original, MEMSIFTER.md "
                                        "§2), first_stage (most similar first: a re-ranker that sees the first "
                                        "stage's order) or shuffled (a permutation per question drawn from "
                                        "shuffle_seed and its id: the listing carries no first-stage signal); "
                                        "train (prepare-rl) and serve (rank, the service) with the same")
    shuffle_seed: int = Field(0, description="history_order shuffled: the seed of each question's listing (with "
                              "the question id: the same seed gives prepare-rl's and rank's listing alike)")
    stop_at_first_overflow: bool = Field(True, description="the window stops at the first session that does not "
                                         "fit (the original); false: keep trying smaller ones")

    def builder(self, counter: Any, template: str, *, answer_prefix: str = "", history_budget: int | None = None,
                include_dates: bool = True) -> "PromptBuilder":
        """The window of these settings: ``context_limit`` prompt tokens, or ``history_budget`` history
        tokens when given (prepare-rl without a context limit)."""
        budget = {"history_budget": history_budget} if history_budget is not None else {"limit": self.context_limit}
        return PromptBuilder(counter, template, session_tokens=self.session_tokens, history_order=self.history_order,
                             shuffle_seed=self.shuffle_seed, stop_at_first_overflow=self.stop_at_first_overflow,
                             include_dates=include_dates, answer_prefix=answer_prefix, **budget)


@dataclass
class Window:
    """A prompt's session window. Local id i is ``shown[i]`` (a haystack index) = ``session_ids[i]``."""

    messages: list[dict]
    shown: list[int]                # haystack indices, in the order listed
    session_ids: list[str]          # the original id of each local id
    texts: list[str]                # each listed session's text as shown
    dates: list[str | None]         # each listed session's date as shown
    prompt_tokens: int              # the whole prompt (chat template), exact unless ``exact`` is false
    exact: bool                     # false: a lower bound (required sessions far over the limit)
    empty_tokens: int               # the prompt with an empty history
    limit: int                      # prompt tokens at most (only required sessions may exceed it)
    history_budget: int             # limit - empty_tokens
    history_tokens: int             # the listed sessions' costs (step 2)
    order: list[int]                # the candidates' haystack indices, in the order given
    taken: list[int]                # haystack indices in the order taken (required first)
    costs: list[int]                # per haystack index: its cost (step 2; over ``cap``: a lower bound)
    cap: int                        # where token counts stopped
    left_out: dict[str, str] = field(default_factory=dict)  # session id -> why it is not shown

    def cost_known(self, i: int) -> bool:
        """Whether haystack index ``i``'s cost is exact (counts stop past the limit)."""
        return self.costs[i] <= self.cap


class PromptBuilder:
    """Builds prompts that show a question's haystack sessions within a token budget (see the module).

    ``counter``: a :class:`memsifter.retrieval.context.TokenCounter` (or anything with ``count_many(texts, cap=)``
    and ``chat_prompt_tokens(messages)``). ``template``: a prompt with a ``{history}`` slot (and the
    other slots :meth:`build` fills). Exactly one of ``limit`` (prompt tokens at most) and
    ``history_budget`` (history tokens at most) is given. ``answer_prefix``: an assistant prefill
    appended to the messages (and costed). ``shuffle_seed``: the seed of ``history_order: shuffled``,
    combined with the question's id.
    """

    def __init__(self, counter: Any, template: str, *, limit: int | None = None, history_budget: int | None = None,
                 session_tokens: int | None = None, history_order: str = "chronological", shuffle_seed: int = 0,
                 stop_at_first_overflow: bool = True, include_dates: bool = True, answer_prefix: str = ""):
        if (limit is None) == (history_budget is None):
            raise ValueError("PromptBuilder: give exactly one of limit and history_budget")
        self.counter, self.template = counter, template
        self.limit, self.history_budget = limit, history_budget
        self.session_tokens, self.history_order, self.shuffle_seed = session_tokens, history_order, shuffle_seed
        self.stop_at_first_overflow, self.include_dates = stop_at_first_overflow, include_dates
        self.answer_prefix = answer_prefix

    # ------------------------------------------------------------------ parts
    def _cap(self) -> int:
        # a session costing more than the history budget is shown only if required, so counting past
        # the limit (or the history budget) never changes a choice
        return self.limit if self.limit is not None else self.history_budget

    def count(self, texts: list[str]) -> list[int]:
        """Token counts, stopping past the limit (a count above it is only a lower bound)."""
        return self.counter.count_many(texts, cap=self._cap())

    def session_text(self, turns: Sequence[dict], question: str) -> str:
        """A session as the window shows it: whole, or condensed towards the question (``session_tokens``)."""
        if self.session_tokens:
            return condense_session(turns, question, self.session_tokens, self.count)
        return render_session(turns)

    def messages(self, question: str, texts: Sequence[str], dates: Sequence[str | None],
                 slots: Mapping[str, str] | None = None) -> list[dict]:
        """The prompt showing ``texts`` with local ids 0..n-1 in the order given (:func:`prompt_messages`)."""
        return prompt_messages(self.template, question, texts, dates, slots, self.answer_prefix)

    def listing(self, chosen: Sequence[int], order: Sequence[int], key: str) -> list[int]:
        """The chosen haystack indices in the order the prompt lists them (``history_order``)."""
        return shown_order(chosen, order, self.history_order, f"{self.shuffle_seed}:{key}")

    # ------------------------------------------------------------------ the window
    def build(self, question: str, haystack: Sequence[str], sessions: Mapping[str, Any],
              dates: Sequence[str | None], order: Sequence[str], *, key: str = "",
              required: Sequence[str] = (), slots: Mapping[str, str] | None = None) -> Window:
        """The window of one question.

        ``haystack``: its session ids (oldest first); ``sessions``: id -> an object with ``turns``;
        ``dates``: per haystack session (None: unknown); ``order``: the candidates, most relevant
        first (ids outside the haystack are ignored; haystack sessions not in it are never shown,
        unless required: a chat baseline shows none or only the gold ones);
        ``key``: the question's id (the ``shuffled`` listing's seed); ``required``: ids shown whatever
        they cost; ``slots``: the template's other slots (besides ``history`` and ``current``)."""
        pos = {s: i for i, s in enumerate(haystack)}
        order_idx = list(dict.fromkeys(pos[s] for s in order if s in pos))
        dates = [d if self.include_dates else None for d in dates]
        texts = [self.session_text(sessions[s].turns, question) for s in haystack]
        counts = self.count(texts)
        worst = len(haystack)  # the largest local id any session could get, plus one
        overhead = self.counter.count_many([(f"<session{worst}> <date>{d}</date>\n" if d else f"<session{worst}>\n")
                                            + "</session>\n" for d in dates])
        costs = [c + o for c, o in zip(counts, overhead)]

        def render(chosen: list[int]) -> tuple[list[int], list[dict]]:
            idx = self.listing(chosen, order_idx, key)
            return idx, self.messages(question, [texts[i] for i in idx], [dates[i] for i in idx], slots)

        empty = self.counter.chat_prompt_tokens(render([])[1])
        budget = self.history_budget if self.history_budget is not None else self.limit - empty
        limit = self.limit if self.limit is not None else empty + budget
        req = [pos[s] for s in dict.fromkeys(required) if s in pos]
        taken = fill_budget(order_idx, costs, budget, stop_at_first_overflow=self.stop_at_first_overflow,
                            required=req)
        first_taken = list(taken)
        estimate = empty + sum(costs[i] for i in taken)
        exact = estimate <= EXACT_COUNT_FACTOR * max(limit, 1)
        idx, msgs = render(taken)
        n_tok = self.counter.chat_prompt_tokens(msgs) if exact else estimate
        while exact and len(taken) > len(req) and n_tok > limit:  # the estimate was short
            taken = taken[:-1]
            idx, msgs = render(taken)
            n_tok = self.counter.chat_prompt_tokens(msgs)
        return Window(messages=msgs, shown=idx, session_ids=[haystack[i] for i in idx],
                      texts=[texts[i] for i in idx], dates=[dates[i] for i in idx], prompt_tokens=n_tok,
                      exact=exact, empty_tokens=empty, limit=limit, history_budget=budget,
                      history_tokens=sum(costs[i] for i in idx), order=order_idx, taken=taken, costs=costs,
                      cap=self._cap(),
                      left_out=self._left_out(haystack, order_idx, costs, budget, first_taken, taken))

    def _left_out(self, haystack: Sequence[str], order_idx: list[int], costs: list[int], budget: int,
                  first_taken: list[int], taken: list[int]) -> dict[str, str]:
        """Why each haystack session that is not shown was left out (in the order given)."""
        kept, first, stopped = set(taken), set(first_taken), False
        out: dict[str, str] = {}
        for i in order_idx:
            if i in kept:
                continue
            if i in first:
                out[haystack[i]] = TRIMMED
            elif costs[i] > budget:
                out[haystack[i]] = OVER_BUDGET
                stopped = stopped or self.stop_at_first_overflow
            elif stopped:
                out[haystack[i]] = NOT_REACHED
            else:
                out[haystack[i]] = NO_ROOM
                stopped = self.stop_at_first_overflow
        candidates = set(order_idx) | kept
        out.update({s: NOT_A_CANDIDATE for i, s in enumerate(haystack) if i not in candidates})
        return out
