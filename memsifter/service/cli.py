"""``memsifter serve``: memory retrieval online (Search-R1's ``/retrieve``, a memory API) on Ray Serve.

With no arguments it serves the demo's sample data: LongMemEval_S questions shipped with memsifter
(:mod:`memsifter.samples`, the same file ``memsifter demo`` uses), imported and embedded with
all-MiniLM-L6-v2 into ``--workdir`` first (finished stages are skipped on the next start), on
127.0.0.1:8000, and prints a ``curl`` that works. ``--index`` serves an embed stage's output instead
(local or s3://); ``--config`` / ``--set`` give any field of the config
(:class:`memsifter.service.config.ServeConfig`); ``--no-ray`` runs the same app under uvicorn in this
process (no Serve proxy: a laptop, a test); ``--print-serve-config`` prints the Serve application
(a RayService's ``serveConfigV2``) for these settings and exits.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
import threading
import time
from typing import Any

from ..store import storage
from ..errors import ConfigError

DEMO_QUESTIONS = 5
DEFAULT_WORKDIR = "./memsifter-serve"


def prepare_demo(workdir: str, questions: int, echo: Any = print) -> tuple[str, str]:
    """The sample's import and embed outputs under ``workdir`` (each stage skipped when published)."""
    from .. import samples
    from ..stage import get_stage

    data, embed = storage.join(workdir, "data"), storage.join(workdir, "embed")
    t0 = time.time()
    get_stage("import").run({"output": data, "format": "longmemeval", "source": samples.path(samples.LONGMEMEVAL),
                             "limit": questions})
    m = get_stage("embed").run({"output": embed, "input": data, "model": "all-MiniLM-L6-v2"})
    echo(f"[serve] sample index ready in {time.time() - t0:.0f}s ({'reused' if m.get('skipped') else 'built'}): "
         f"{embed}")
    return embed, data


def build_config(args: argparse.Namespace) -> dict:
    from ..stage import load_config_file, parse_value, set_path

    data: dict = load_config_file(args.config) if args.config else {}
    for name in ("index", "dataset", "state", "host", "port"):
        v = getattr(args, name)
        if v is not None:
            data[name] = v
    for item in args.set or []:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE")
        k, v = item.split("=", 1)
        set_path(data, k.strip(), parse_value(v, f"--set {k.strip()}"))
    return data


def example_curl(cfg: Any, corpus_id: str | None, question: str | None, keys: Any = None) -> str:
    """A curl of ``/retrieve`` that works as printed: with keys, the header names the variable of a key that
    may read ``corpus_id`` (the first one configured if none names it)."""
    url = f"http://{'127.0.0.1' if cfg.host in ('0.0.0.0', '::') else cfg.host}:{cfg.port}"
    body = json.dumps({"queries": [question or "What did I say about my trip?"], "topk": 3, "return_scores": True})
    path = f"/u/{corpus_id}/retrieve" if corpus_id else "/retrieve"
    key_var = None
    if keys is not None and keys.enabled:
        names = keys.readers(corpus_id) if corpus_id else []
        key_var = (names or keys.env_names)[0]
    key = f' -H "Authorization: Bearer ${key_var}"' if key_var else ""
    return f"curl -s {url}{path} -H 'Content-Type: application/json'{key} -d {shlex.quote(body)}"


def serve_config_yaml(cfg: Any) -> str:
    import yaml

    app = {"name": "memsifter", "route_prefix": "/", "import_path": "memsifter.service.app:build_app",
           "args": cfg.model_dump(mode="json", exclude_defaults=True)}
    return yaml.safe_dump({"http_options": {"host": "0.0.0.0", "port": 8000}, "applications": [app]},
                          sort_keys=False)


def _wait_ready(url: str, timeout: float, keys: Any = None) -> dict:
    """Waits for ``/readyz`` (the index, the encoder and the unit vectors loaded); returns ``/healthz``'s
    detail (asked with a configured key when there are keys)."""
    import urllib.request

    deadline = time.time() + timeout
    last: Any = None
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(url + "/readyz", timeout=5):
                pass
            headers = {}
            if keys is not None and keys.enabled:
                headers["Authorization"] = "Bearer " + os.environ[keys.env_names[0]]
            with urllib.request.urlopen(urllib.request.Request(url + "/healthz", headers=headers), timeout=5) as r:
                return json.loads(r.read())
        except Exception as e:  # noqa: BLE001 - not up yet (503 while loading)
            last = e
            time.sleep(1)
    raise ConfigError(f"serve: {url}/readyz not ready in {timeout:.0f}s ({type(last).__name__})")


def run_local(cfg: Any, ready: Any = None) -> None:
    """The app under uvicorn in this process (``--no-ray``)."""
    import uvicorn

    from .core import MicroBatcher, RetrievalService
    from .http import make_app
    from .logs import install_redaction

    ranker = None
    if cfg.ranker is not None:
        from .ranker import RankerCore

        core = RankerCore(cfg.ranker)
        batcher = MicroBatcher(core.rank_many, cfg.ranker.max_batch_size, cfg.ranker.batch_wait_timeout_s)
        ranker = batcher.submit
    service = RetrievalService(cfg, ranker=ranker)
    install_redaction(service.secrets)
    if ready:
        ready(service)
    uvicorn.run(make_app(service), host=cfg.host, port=cfg.port, log_level="warning", access_log=False)


def run_serve(cfg: Any, blocking: bool = True) -> str:
    """The app on Ray Serve (``RAY_ADDRESS``'s cluster, else a local Ray); returns its URL."""
    from ray import serve

    from ..models.raypool import ensure_ray
    from .app import APP_NAME, deployments

    # Ctrl-C reaches the whole process group: Ray's own processes (raylet, GCS, workers) ignore it, as they
    # inherit this disposition, so that they are stopped in order by main()'s shutdown, not killed under
    # a live driver (whose core worker would then dump its C++ stack).
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        ensure_ray()
    finally:
        signal.signal(signal.SIGINT, previous)
    serve.start(http_options={"host": cfg.host, "port": cfg.port})
    serve.run(deployments(cfg), name=APP_NAME, route_prefix="/", blocking=False)
    return f"http://{'127.0.0.1' if cfg.host in ('0.0.0.0', '::') else cfg.host}:{cfg.port}"


def main(argv: list[str] | None = None) -> int:
    from ..cli import plain, setup_logging
    from .auth import Keys
    from .config import load_config

    p = argparse.ArgumentParser(prog="memsifter serve", description=plain(__doc__))
    p.add_argument("--index", help="embed stage output to serve (local or s3://); default: the demo sample")
    p.add_argument("--dataset", help="the dataset it embedded (default: the embed config's input)")
    p.add_argument("--state", help="where user memories are kept (local or s3://); default with the sample: "
                   "<workdir>/state")
    p.add_argument("--host", help="default 127.0.0.1")
    p.add_argument("--port", type=int, help="default 8000")
    p.add_argument("--config", help="YAML/JSON file of the service config (local or s3://)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="set a config field (dotted keys, YAML "
                   "values), e.g. --set auth.keys.MEMSIFTER_KEY_A.read='[\"*\"]'")
    p.add_argument("--workdir", default=DEFAULT_WORKDIR, help="where the sample is imported and embedded")
    p.add_argument("--questions", type=int, default=DEMO_QUESTIONS, help="sample questions (corpora) to serve")
    p.add_argument("--no-ray", action="store_true", help="uvicorn in this process instead of Ray Serve")
    p.add_argument("--print-serve-config", action="store_true", help="print the Serve application YAML and exit")
    p.add_argument("-v", "--verbose", action="count", default=0)
    p.add_argument("-q", "--quiet", action="store_true")
    args = p.parse_args(argv)
    setup_logging(-1 if args.quiet else args.verbose)
    for k, v in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                 "RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}.items():
        os.environ.setdefault(k, v)
    data = build_config(args)
    sample = not data.get("index")
    if sample:
        if args.questions < 1:
            raise ConfigError("--questions must be at least 1")
        data.setdefault("state", storage.join(args.workdir, "state"))
        auth = data.setdefault("auth", {})
        if isinstance(auth, dict) and not auth.get("keys") and not auth.get("keys_file"):   # with keys, anonymous only when configured
            auth.setdefault("anonymous", {"read": ["*"], "write": ["*"]})
    # the whole config, and every key variable, checked before any work starts (one line, exit 2)
    early = load_config({**data, "index": data.get("index") or "-"}, "memsifter serve")
    keys = None if args.print_serve_config else Keys(early.auth)   # the keys are the cluster's, not this shell's
    if sample:
        if args.print_serve_config:
            data["index"] = storage.join(args.workdir, "embed")
        else:
            data["index"], data["dataset"] = prepare_demo(args.workdir, args.questions)
    for k in ("index", "dataset", "state"):   # the replicas run elsewhere: absolute paths
        v = data.get(k)
        if v and not storage.is_s3(v):
            data[k] = os.path.abspath(v)
    cfg = load_config(data, "memsifter serve")
    if args.print_serve_config:
        print(serve_config_yaml(cfg), end="")
        return 0
    first = None
    try:
        from ..data.model import read_dataset

        ds = read_dataset(cfg.dataset) if cfg.dataset else None
        first = ds.questions[0] if ds and ds.questions else None
    except Exception:  # noqa: BLE001 - the example only
        first = None
    curl = example_curl(cfg, first.question_id if first else cfg.default_corpus, first.question if first else None,
                        keys)

    def announce(_: Any = None) -> None:
        print(f"[serve] listening on http://{cfg.host}:{cfg.port} (docs: /docs, metrics: /metrics). Try:\n  {curl}",
              flush=True)

    if args.no_ray:   # the Try line once it answers as fast as it will
        url = f"http://{'127.0.0.1' if cfg.host in ('0.0.0.0', '::') else cfg.host}:{cfg.port}"
        threading.Thread(target=lambda: (_wait_ready(url, 900, keys), announce()), daemon=True).start()
        run_local(cfg)
        return 0
    url = run_serve(cfg)
    health = _wait_ready(url, 900, keys)
    print(f"[serve] {health.get('corpora')} corpora, {health.get('sessions')} sessions, method {health.get('method')}")
    announce()
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(3600):
        pass
    print("[serve] stopping", flush=True)
    shutdown_serve()
    return 0


def shutdown_serve() -> None:
    """Serve's application and proxy, then this driver's Ray (and the local Ray it started)."""
    import ray
    from ray import serve

    try:
        serve.shutdown()
    finally:
        ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
