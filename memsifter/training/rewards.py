"""Rewards for training the ranker with verl (MEMSIFTER.md §6): a verl custom reward function.

Wiring (``memsifter.stages.train`` writes these overrides)::

    reward.reward_manager.name=dapo
    reward.custom_reward_function.path=pkg://memsifter.training.rewards
    reward.custom_reward_function.name=compute_score
    +reward.custom_reward_function.reward_kwargs.mode=task       # and the other settings below

verl 0.9.1 computes rewards in its reward loop (``verl.experimental.reward_loop``): each
``RewardLoopWorker`` runs every sample of a batch as an asyncio task, and the registered ``dapo``
manager awaits a coroutine reward function directly (``DAPORewardManager.run_single``)::

    await compute_score(data_source=..., solution_str=..., ground_truth=..., extra_info=...,
                        **reward_kwargs)

so :func:`compute_score` is ``async``: all tier calls of all samples a worker holds run concurrently,
bounded by one semaphore per worker process. ``ground_truth`` is ``"{local gold ids};{N}"`` and
``extra_info`` carries what the task reward needs (question, answer, the rendered sessions in prompt
order, their dates); both are written by ``prepare-rl``. The manager applies DAPO's overlong penalty
on top of ``score`` and forwards every returned key to the metrics (``acc`` is the dynamic-sampling
filter metric).

Modes
-----
``dcg``: DCG@K of the ranking against the gold sessions, divided by |gold| (K = min(10, N)).

``improvement`` (issue 44): NDCG@K of the ranking minus NDCG@K of the listing the ranker was shown, so a ranker
that copies the order it is shown earns 0 whatever that order, one that moves gold up earns more, down less; a
ranking that does not parse scores -1. Meant with the ranker's agent loop (:mod:`memsifter.training.ranker_loop`),
which shows every rollout of a training row its own shuffled listing and hands that listing to this function
(``extra_info[LISTING]``, through verl's ``naive`` reward manager): the n rollouts of a prompt then start from
different orders, and only reordering pays.

``task`` ("marginal utility x rank sensitivity"): tiers t = 0, then 1, 2, 3, 5, 8 (Fibonacci <= K),
then K. The working LLM answers the question with the top-t ranked sessions (t = 0: no memory),
s_t = token F1 of its answer, and R = sum_i C(t_i) * (s_{t_i} - s_{t_{i-1}}) over the tiers after 0,
with C(k) = 1 / log2(k + 1) (the tier-1 term is included; the original dropped it).

In both modes a response whose ranking does not parse (``memsifter.retrieval.rankings.parse_ranking`` with
K ids required; with ``format: partial`` any non-empty ranking of shown ids counts, scored on the ids
it gives; text after the last ``</think>``, so a response that starts inside the pre-filled
think block is fine) scores 0. A working-LLM call is retried (``memsifter.models.llm.ChatClient``); a call
that still fails scores 0 for its tier and is counted in ``llm_failed``; nothing raises into the
trainer (an unexpected error gives score 0 and ``reward_error = 1``).

Settings (keyword arguments, i.e. ``reward_kwargs``; environment variables as fallback):
``mode`` (MEMSIFTER_REWARD_MODE, default ``dcg``), ``base_url`` (MEMSIFTER_REWARD_BASE_URL, then
MEMSIFTER_LLM_BASE_URL / OPENAI_BASE_URL), ``model`` (MEMSIFTER_REWARD_MODEL), ``api_key_env``
(MEMSIFTER_REWARD_API_KEY_ENV, default OPENAI_API_KEY: the *name* of the variable holding the key),
``temperature`` (0.3), ``max_tokens`` (512), ``concurrency`` (64), ``max_retries`` (4),
``timeout_s`` (120), ``top_k`` (10), ``cache_uri`` (MEMSIFTER_REWARD_CACHE: JSONL response cache
under a local path or s3:// prefix, so a restarted run re-sends nothing it already asked),
``answer_prompt`` (MEMSIFTER_REWARD_ANSWER_PROMPT: a replacement for ``prompts/chat.txt``, the chat
stage's template, slots ``{history}``, ``{current}``, ``{date}``), ``format`` (MEMSIFTER_REWARD_FORMAT:
``exact``, MemSifter's K-ids rule, or ``partial``).

Memory agents (issue 33)
------------------------
Rows with ``data_source == "memsifter_agent"`` (prepare-agents; ``ground_truth`` the gold answer) are
agent episodes run by :mod:`memsifter.agents.verl_loop`: the reward is the outcome of the episode,
``score = (1 - f - g) * m + f * format_ok + g * evidence_hit`` with ``m`` the token F1 (``agent_metric: f1``, the default) or the
exact match (``em``) of the episode's answer against the gold answer (``memsifter.retrieval.metrics``;
0 without an answer), ``format_ok`` 1 when every reply of the episode was well formed and an answer came,
and ``f = agent_format_score`` (default 0.1): a correct, well-formed episode scores 1.0, a well-formed
wrong one 0.1, a correct answer after a malformed step 0.9, no answer 0. ``g = agent_evidence_score``
(default 0, off; MEMSIFTER_REWARD_AGENT_EVIDENCE_SCORE) pays for evidence: ``evidence_hit`` is 1 when a
session the episode was shown (its search hits, its chunks: the loop's ``agent_seen``) is one of the row's
``gold_session_ids``. With f = 0.1 and g = 0 a GRPO run of the search agent learned to stop searching
(benchmarks/gpu/results/2026-11-27-h100-agents-grpo7): the evidence term makes a search that finds the
gold session pay even when the small model's answer does not. The answer and ``format_ok`` are
the episode's own (the agent's parser, handed over by the loop in the last output's ``extra_fields``,
which verl's ``naive`` reward manager merges into ``extra_info``: ``agent_answer``, ``agent_format_ok``);
without them (another reward manager, a plain evaluation) the final reply of ``solution_str`` (after the
last ``assistant`` turn marker of a whole search trajectory) is parsed with the agents' answer parser
(:func:`memsifter.agents.memory.parse_answer`). Settings: ``agent_metric``
(MEMSIFTER_REWARD_AGENT_METRIC), ``agent_format_score`` (MEMSIFTER_REWARD_AGENT_FORMAT_SCORE), reward
kwargs the train stage writes from its ``agent:`` block. Metrics: ``acc`` (= score), ``answer_f1``,
``answer_em``, ``format_ok``, ``has_answer``, ``evidence_hit``, ``searches``, ``chunks``, ``recalls``, ``llm_calls``,
``over_budget``, ``reward_error``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import os
import threading
from typing import Any, Sequence

from ..models.llm import ChatClient, ResponseCache, request_key, run_sync
from ..retrieval.metrics import dcg_over_gold, exact_match, ndcg, token_f1
from ..retrieval.prompting import extract_answer, load_chat_prompt  # as the chat and rank stages use them
from ..retrieval.rankings import parse_ranking
from ..retrieval.window import answer_slots, prompt_messages
from .reward_settings import FORMATS, MODES, TOP_K, RewardSettings  # noqa: F401 - the settings, re-exported

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- pure parts
def tiers_for(k: int) -> list[int]:
    """0, the Fibonacci numbers <= k (1, 2, 3, 5, 8, ...), then k; sorted, without duplicates."""
    out = {0}
    a, b = 1, 2
    while a <= k:
        out.add(a)
        a, b = b, a + b
    if k > 0:
        out.add(k)
    return sorted(out)


def rank_weight(k: int) -> float:
    """C(k) = 1 / log2(k + 1)."""
    return 1.0 / math.log2(k + 1)


def combine_tiers(tiers: Sequence[int], scores: Sequence[float]) -> float:
    """R = sum over tiers after the first of C(t_i) * (s_{t_i} - s_{t_{i-1}})."""
    if len(tiers) != len(scores):
        raise ValueError(f"{len(tiers)} tiers, {len(scores)} scores")
    return sum(rank_weight(tiers[i]) * (scores[i] - scores[i - 1]) for i in range(1, len(tiers)))


def parse_ground_truth(ground_truth: str) -> tuple[list[int], int]:
    """``"{comma-separated local gold ids};{number of sessions}"`` -> (gold ids, N)."""
    gold_part, sep, n_part = str(ground_truth).rpartition(";")
    if not sep:
        raise ValueError(f"ground truth {ground_truth!r}: expected 'ids;N'")
    n = int(n_part)
    gold = [int(x) for x in gold_part.split(",") if x.strip()]
    return gold, n


def dcg_reward(local_ids: Sequence[int], gold: Sequence[int], k: int) -> float:
    """DCG@k of the ranking against gold, divided by |gold| (the cheap first-stage reward)."""
    return dcg_over_gold([str(i) for i in local_ids], [str(g) for g in gold], k)


def answer_messages(question: str, question_date: str | None, session_texts: Sequence[str],
                    dates: Sequence[str | None] | None, template: str | None = None) -> list[dict]:
    """The working-LLM prompt for one tier, built by the chat stage's prompt builder
    (:func:`memsifter.retrieval.window.prompt_messages` with its slots): its template (``prompts/chat.txt``)
    with the chosen sessions in chronological order, the date, the question."""
    tpl = template if template is not None else chat_template(None)
    return prompt_messages(tpl, question, session_texts, dates, answer_slots(question_date))


@functools.lru_cache(maxsize=8)
def chat_template(uri: str | None) -> str:
    """The working-LLM prompt: ``uri`` (a replacement file, local or s3://) or ``prompts/chat.txt``."""
    return load_chat_prompt(uri)


# --------------------------------------------------------------------------- the working LLM
_CACHES: dict[str, ResponseCache] = {}
_CACHES_LOCK = threading.Lock()


def _cache_for(settings: RewardSettings) -> ResponseCache:
    with _CACHES_LOCK:
        key = settings.cache_uri or ""
        if key not in _CACHES:
            _CACHES[key] = ResponseCache(settings.cache_uri)
        return _CACHES[key]


class _Scorer:
    """Per event loop: one ChatClient, one OpenAI client, one semaphore, in-flight de-duplication.

    The n rollouts of a prompt often ask the same tier question (tier 0 always): identical requests
    in flight share one call, finished ones come from the cache.
    """

    def __init__(self, settings: RewardSettings, loop: asyncio.AbstractEventLoop):
        self.settings = settings
        self.loop = loop
        self.chat = ChatClient(settings.endpoint(), _cache_for(settings), backoff_s=0.5)
        self.params = self.chat.endpoint.params()
        self.sem = asyncio.Semaphore(settings.concurrency)
        self._client: Any = None
        self._inflight: dict[str, asyncio.Future] = {}

    def client(self) -> Any:
        if self._client is None:
            self._client = self.chat._client()
        return self._client

    async def ask(self, messages: list[dict]) -> tuple[str | None, bool]:
        """(reply text or None, ok)."""
        key = request_key(self.chat.endpoint.model, messages, self.params)
        hit = self.chat.cache.get(key)
        if hit is not None:
            self.chat.stats["cached"] += 1
            return hit, True
        fut = self._inflight.get(key)
        if fut is not None:
            return await asyncio.shield(fut)
        fut = self.loop.create_future()
        self._inflight[key] = fut
        try:
            c = await self.chat._one(self.client(), self.sem, messages, self.params)
            res = (c.text, c.ok)
            if not c.ok:
                log.warning("working LLM call failed after %d attempts: %s", c.attempts, c.error)
        except asyncio.CancelledError:
            fut.cancel()
            raise
        except Exception as e:  # noqa: BLE001 - never raise into the trainer
            log.warning("working LLM call failed: %s", e)
            res = (None, False)
        finally:
            self._inflight.pop(key, None)
        fut.set_result(res)
        return res


_SCORERS: dict[tuple[int, str], _Scorer] = {}


def _scorer(settings: RewardSettings) -> _Scorer:
    loop = asyncio.get_running_loop()
    k = (id(loop), settings.key())
    s = _SCORERS.get(k)
    if s is None or s.loop is not loop:
        for old in [key for key, v in _SCORERS.items() if v.loop.is_closed()]:
            _SCORERS.pop(old, None)
        s = _SCORERS[k] = _Scorer(settings, loop)
    return s


def _session_fields(extra_info: dict) -> tuple[list[str], list[str | None] | None]:
    texts = list(extra_info.get("sessions") or [])
    dates = extra_info.get("dates")
    dates = list(dates) if dates is not None else None
    if dates is not None and not any(dates):
        dates = None
    return texts, dates


def tier_prompts(local_ids: Sequence[int], tiers: Sequence[int], extra_info: dict,
                 template: str | None = None) -> list[list[dict]]:
    """The working LLM's prompt for each tier: the top-t sessions of the ranking, shown
    chronologically: by haystack position (``haystack_index``: rows of ``history_order: first_stage``
    list sessions most similar first, ``shuffled`` ones in a seeded permutation), else by local id
    (chronological rows)."""
    texts, dates = _session_fields(extra_info)
    where = list(extra_info.get("haystack_index") or []) or list(range(len(texts)))
    out = []
    for t in tiers:
        chosen = sorted(local_ids[:t], key=lambda i: where[i])
        out.append(answer_messages(str(extra_info.get("question") or ""), extra_info.get("question_date"),
                                   [texts[i] for i in chosen],
                                   [dates[i] for i in chosen] if dates is not None else None, template))
    return out


async def task_reward(local_ids: Sequence[int], k: int, extra_info: dict,
                      settings: RewardSettings) -> dict:
    """Tier scores and the combined reward for one parsed ranking (``local_ids`` cut to k)."""
    texts, _ = _session_fields(extra_info)
    if len(texts) < max(local_ids, default=-1) + 1:
        raise ValueError(f"extra_info has {len(texts)} sessions; ranking refers to id {max(local_ids)}")
    gold_answer = str(extra_info.get("answer") or "")
    ts = tiers_for(k)
    batch = tier_prompts(local_ids, ts, extra_info, chat_template(settings.answer_prompt))
    scorer = _scorer(settings)
    replies = await asyncio.gather(*(scorer.ask(m) for m in batch))
    scores = [token_f1(extract_answer(text), gold_answer) if ok else 0.0 for text, ok in replies]
    failed = sum(1 for _, ok in replies if not ok)
    return {"score": combine_tiers(ts, scores), "tiers": ts, "tier_scores": scores, "llm_failed": failed,
            "llm_calls": len(batch)}


# --------------------------------------------------------------------------- memory agents (issue 33)
AGENT_SOURCE = "memsifter_agent"  # = memsifter.agents.verl_names.DATA_SOURCE
AGENT_METRICS = ("f1", "em")
AGENT_FORMAT_SCORE = 0.1
AGENT_EVIDENCE_SCORE = 0.0
AGENT_COUNTS = ("searches", "chunks", "recalls", "llm_calls")


def agent_settings(**kwargs: Any) -> tuple[str, float, float]:
    """(answer metric, format score, evidence score) from the reward kwargs, else the environment, else
    f1 / 0.1 / 0."""
    metric = kwargs.get("agent_metric") or os.environ.get("MEMSIFTER_REWARD_AGENT_METRIC") or "f1"
    fs = kwargs.get("agent_format_score")
    if fs is None:
        fs = os.environ.get("MEMSIFTER_REWARD_AGENT_FORMAT_SCORE") or AGENT_FORMAT_SCORE
    es = kwargs.get("agent_evidence_score")
    if es is None:
        es = os.environ.get("MEMSIFTER_REWARD_AGENT_EVIDENCE_SCORE") or AGENT_EVIDENCE_SCORE
    metric, fs, es = str(metric).lower(), float(fs), float(es)
    if metric not in AGENT_METRICS:
        raise ValueError(f"agent_metric {metric!r}: expected one of {AGENT_METRICS}")
    if not 0.0 <= fs <= 1.0:
        raise ValueError(f"agent_format_score {fs}: expected a number from 0 to 1")
    if not 0.0 <= es <= 1.0 - fs:
        raise ValueError(f"agent_evidence_score {es}: expected a number from 0 to 1 - agent_format_score ({1 - fs:g})")
    return metric, fs, es


def _ids(v: Any) -> set[str]:
    """A list of session ids as verl hands it over (a list, a numpy array or nothing)."""
    if v is None or isinstance(v, (str, bytes)):
        return set()
    return {str(x) for x in (v.tolist() if hasattr(v, "tolist") else v)}


def evidence_hit(info: dict) -> float:
    """1.0 when the episode was shown a gold session (``agent_seen``, the sessions of its search hits and chunks,
    from the verl loop; ``gold_session_ids``, prepare-agents' row), else 0.0."""
    return float(bool(_ids(info.get("agent_seen")) & _ids(info.get("gold_session_ids"))))


def final_reply(text: str) -> str:
    """The last reply of a decoded response: a search trajectory holds the environment's turns too (chat
    markers decoded without their special tokens leave a line ``assistant`` before each reply)."""
    i = text.rfind("\nassistant\n")
    return text[i + len("\nassistant\n"):] if i >= 0 else text


def parse_agent_answer(solution_str: str) -> tuple[str | None, bool]:
    """(answer, well formed) of an episode's final reply, by the agents' own answer parser."""
    from ..agents.memory import parse_answer

    answer, problems = parse_answer(final_reply(solution_str or ""))
    return answer, answer is not None and not problems


def _golds(ground_truth: Any) -> list[str]:
    if isinstance(ground_truth, (list, tuple)) or hasattr(ground_truth, "tolist"):
        items = list(ground_truth.tolist() if hasattr(ground_truth, "tolist") else ground_truth)
        return [str(g) for g in items] or [""]
    return [str(ground_truth)]


def agent_reward(solution_str: str, ground_truth: Any, extra_info: dict | None = None, **kwargs: Any) -> dict:
    """The outcome reward of one agent episode (see the module doc); never raises."""
    info = dict(extra_info or {})
    try:
        metric, fs, es = agent_settings(**kwargs)
        if "agent_format_ok" in info:  # the episode's own parse, from the verl loop
            answer = info.get("agent_answer")
            answer = None if answer is None or (isinstance(answer, float) and math.isnan(answer)) else str(answer)
            well_formed = bool(info.get("agent_format_ok")) and answer is not None
        else:
            answer, well_formed = parse_agent_answer(solution_str)
        golds = _golds(ground_truth)
        f1 = max(token_f1(answer, g) for g in golds) if answer is not None else 0.0
        em = max(exact_match(answer, g) for g in golds) if answer is not None else 0.0
        m = f1 if metric == "f1" else em
        hit = evidence_hit(info)
        score = (1.0 - fs - es) * m + fs * float(well_formed) + es * hit
        out = {"score": score, "acc": score, "answer_f1": f1, "answer_em": em, "format_ok": float(well_formed),
               "has_answer": float(answer is not None), "evidence_hit": hit, "reward_error": 0.0}
    except Exception as e:  # noqa: BLE001 - a reward must never crash the trainer
        log.warning("agent reward failed: %s: %s", type(e).__name__, e)
        out = {"score": 0.0, "acc": 0.0, "answer_f1": 0.0, "answer_em": 0.0, "format_ok": 0.0, "has_answer": 0.0,
               "evidence_hit": 0.0, "reward_error": 1.0}
    for k in AGENT_COUNTS:
        v = info.get(f"agent_{k}")
        out[k] = float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else 0.0
    out["over_budget"] = float(bool(info.get("agent_over_budget")))
    return out


# --------------------------------------------------------------------------- the listing a rollout was shown
LISTING = "ranker_listing"   # extra_info key: the row's local ids in the order the rollout's prompt listed them
INVALID_IMPROVEMENT = -1.0   # improvement mode: a ranking that does not parse (below every ranking that does)


def rollout_listing(extra_info: dict, n: int) -> tuple[list[int], bool]:
    """(listing, from the rollout): the row's local ids in the order the rollout's prompt listed them, so that
    rollout id j is row id ``listing[j]`` (:mod:`memsifter.training.ranker_loop` shows each rollout its own
    listing and hands it over in ``extra_info[LISTING]``); without one, the row's own listing (ids unchanged).
    A listing that is not a permutation of the row's ``n`` ids is a ValueError."""
    given = extra_info.get(LISTING)
    if given is None:
        return list(range(n)), False
    listing = [int(x) for x in (given.tolist() if hasattr(given, "tolist") else given)]
    if sorted(listing) != list(range(n)):
        raise ValueError(f"{LISTING} {listing[:12]}: not a permutation of the row's {n} session ids")
    return listing, True


# --------------------------------------------------------------------------- verl entry points
def _result(settings: RewardSettings, score: float, *, format_ok: bool, dcg: float, n_ranked: int,
            task: dict | None = None, error: bool = False, ndcg10: float = 0.0, shown_ndcg: float = 0.0,
            order_changed: bool = False, from_rollout: bool = False) -> dict:
    out = {"score": float(score), "acc": float(score), "format_ok": float(format_ok), "dcg": float(dcg),
           "ndcg10": float(ndcg10), "n_ranked": float(n_ranked), "reward_error": float(error),
           "shown_ndcg": float(shown_ndcg), "order_changed": float(order_changed),
           "listing_from_rollout": float(from_rollout)}
    if settings.mode == "task":
        sc = (task or {}).get("tier_scores") or [0.0]
        out.update({"s_no_memory": float(sc[0]) if task else 0.0, "s_top_k": float(sc[-1]) if task else 0.0,
                    "llm_calls": float((task or {}).get("llm_calls", 0)),
                    "llm_failed": float((task or {}).get("llm_failed", 0))})
    return out


async def compute_score(data_source: str, solution_str: str, ground_truth: str,
                        extra_info: dict | None = None, **kwargs: Any) -> dict:
    """verl custom reward function (async; awaited by verl 0.9.1's reward-loop DAPO manager).

    Returns a dict with ``score`` (the reward) and metrics with the same keys for every sample of a
    run (verl stacks them): ``acc`` (= score, the DAPO group filter metric), ``format_ok``, ``dcg``,
    ``ndcg10`` (NDCG@10 of the ranking over the shown sessions, 0 when invalid),
    ``n_ranked``, ``reward_error``, ``shown_ndcg`` (NDCG@K of the listing shown), ``order_changed`` (1 when the
    ranking is not the listing's first ids in order), ``listing_from_rollout`` (1 when the rollout's own listing
    came in ``extra_info[LISTING]``); in task mode also ``s_no_memory``, ``s_top_k``, ``llm_calls``,
    ``llm_failed``. Agent rows (``data_source == "memsifter_agent"``): :func:`agent_reward`.

    The ranking's ids are the ids of the prompt the rollout was shown: with a rollout listing they are read
    through it (:func:`rollout_listing`) into the row's ids, which the gold ids and the sessions use.
    ``improvement`` mode: NDCG@K of the ranking minus NDCG@K of that listing (K = min(top_k, N)); a ranking
    that does not parse scores :data:`INVALID_IMPROVEMENT`.
    """
    if data_source == AGENT_SOURCE:
        return agent_reward(solution_str, ground_truth, extra_info, **kwargs)
    settings = RewardSettings.resolve(**kwargs)
    try:
        info = dict(extra_info or {})
        gold, n = parse_ground_truth(ground_truth)
        k = min(settings.top_k, n)
        listing, from_rollout = rollout_listing(info, n)
        gold_s = [str(g) for g in gold]
        shown = ndcg([str(i) for i in listing], gold_s, k)
        # exact: MemSifter's rule, K = min(10, N) valid ids or nothing; partial: any ranking with at
        # least one valid id is scored on the ids it gives (the missing ones count as irrelevant)
        parsed = parse_ranking(solution_str, n, k=k if settings.format == "exact" else None)
        if not parsed.ok or k <= 0:
            bad = INVALID_IMPROVEMENT if settings.mode == "improvement" else 0.0
            return _result(settings, bad, format_ok=False, dcg=0.0, n_ranked=len(parsed.ids), shown_ndcg=shown,
                           from_rollout=from_rollout)
        ids = [listing[i] for i in parsed.ids[:k]]  # the row's ids
        common = {"n_ranked": len(ids), "shown_ndcg": shown, "order_changed": ids != listing[:len(ids)],
                  "from_rollout": from_rollout}
        dcg = dcg_reward(ids, gold, k)
        nd = ndcg([str(i) for i in ids], gold_s, TOP_K)  # the validation curve's NDCG@10
        if settings.mode == "dcg":
            return _result(settings, dcg, format_ok=True, dcg=dcg, ndcg10=nd, **common)
        if settings.mode == "improvement":
            gain = ndcg([str(i) for i in ids], gold_s, k) - shown
            return _result(settings, gain, format_ok=True, dcg=dcg, ndcg10=nd, **common)
        task = await task_reward(ids, k, info, settings)
        return _result(settings, task["score"], format_ok=True, dcg=dcg, task=task, ndcg10=nd, **common)
    except Exception as e:  # noqa: BLE001 - a reward must never crash the trainer
        log.warning("reward failed for %s: %s: %s", data_source, type(e).__name__, e)
        return _result(settings, 0.0, format_ok=False, dcg=0.0, n_ranked=0, error=True)


async def _close_scorers() -> None:
    """Close the HTTP clients of this loop's scorers (before a short-lived loop ends)."""
    loop = asyncio.get_running_loop()
    for key in [k for k, v in _SCORERS.items() if v.loop is loop]:
        s = _SCORERS.pop(key)
        if s._client is not None:
            with contextlib.suppress(Exception):
                await s._client.close()


_run_sync = run_sync


def compute_score_sync(data_source: str, solution_str: str, ground_truth: str,
                       extra_info: dict | None = None, **kwargs: Any) -> dict:
    """Synchronous form for managers that call the reward function without awaiting it."""
    async def run() -> dict:
        try:
            return await compute_score(data_source, solution_str, ground_truth, extra_info, **kwargs)
        finally:
            await _close_scorers()
    return _run_sync(run)


def score_batch(samples: Sequence[dict], **kwargs: Any) -> list[dict]:
    """Score many ``{data_source, solution_str, ground_truth, extra_info}`` samples concurrently."""
    async def run() -> list[dict]:
        try:
            out = await asyncio.gather(*(compute_score(**s, **kwargs) for s in samples))
        finally:
            await _close_scorers()
            for c in _CACHES.values():
                c.flush()
        return list(out)
    return _run_sync(run)
