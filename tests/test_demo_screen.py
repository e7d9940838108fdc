"""What a new user reads (issue 41 item 4): the demo's tables fit 120 columns, its "paper's models" command
runs when pasted, ``--agents``' scope and cost is one statement, the ranker adapter that returns its input order
is shown only when asked for, ``memsifter run evaluate`` prints the demo's tables (its JSON behind ``--json``),
and ``answer_f1_and_cost.png`` shows every method with readable ticks.

Real parts: the evaluate stage on a local store over published embed, rank, chat and agents outputs (rows
written here: no model runs; the demo itself, end to end, is tests/test_demo.py), the real CLI in a subprocess,
bash, matplotlib's renderer."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest

from memsifter import demo
from memsifter.retrieval import screen
from memsifter.data.model import Dataset, Question, Session
from memsifter.retrieval import rankings
from memsifter.stage import get_stage
from memsifter.store import storage

HAY = [f"s{i}" for i in range(8)]
FIRST = ["s3", "s1", "s0", "s2", "s7", "s6", "s5", "s4"]
SHOWN = FIRST[:4]
BASE = "rank:smollm2-135m-instruct+structured"
TRAINED = f"rank:{demo.TRAINED}"
MEMSIFTER = str(Path(sys.executable).with_name("memsifter"))


def _publish(uri: str, stage: str, config: dict, write, stats: dict | None = None) -> dict:
    pub = storage.Publication(uri, stage, config, "x", "test")
    write(pub)
    pub.publish(stats or {})
    return storage.read_manifest(uri)


def _row(qid: str, ranked: list[str], method: str) -> dict:
    return {"question_id": qid, "ranked_session_ids": ranked, "scores": None, "method": method, "status": "ok",
            "reason": None, "raw_response": None}


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    """One demo-like run on a local store: 6 LoCoMo-style questions, three first-stage methods (embed), the
    untrained ranker (reverses what it was shown) and the trained adapter (returns its input) on 4 of them,
    chat's six contexts and both agents on 4, and the two evaluate instances the demo runs."""
    root = str(tmp_path_factory.mktemp("screen"))
    j = lambda name: storage.join(root, name)  # noqa: E731
    sessions = {s: Session(s, [{"role": "user", "content": f"I went to town {s}"}], "2024-01-01") for s in HAY}
    qs = [Question(f"q{i}", "locomo", f"where did I go {i}?", f"town {g}", HAY, [g], question_type="single-hop")
          for i, g in enumerate(["s0", "s3", "s1", "s2", "s7", "s6"])]
    _publish(j("import"), "import", {}, Dataset(sessions, qs).write)
    orders = {"dense": FIRST[::-1], "bm25": FIRST[1:] + FIRST[:1], "zsum": FIRST}
    embed = _publish(j("embed"), "embed", {"input": j("import"), "output": j("embed")}, lambda p: [
        rankings.write_rankings(p, [_row(q.question_id, o, f"embed:{m}") for q in qs], f"rankings_{m}.parquet")
        for m, o in orders.items()], {"primary": "zsum", "questions": len(qs)})

    def rank(uri: str, label: str, order: list[str]) -> dict:
        def write(p):
            rankings.write_rankings(p, [_row(f"q{i}", order, label) for i in range(4)])
            p.write_table("prompts.parquet", pa.table({"question_id": [f"q{i}" for i in range(4)],
                                                       "shown_session_ids": [SHOWN] * 4}))
        return _publish(uri, "rank", {"embeddings": storage.join(j("embed"), "rankings_zsum.parquet"),
                                      "model": label}, write, {"questions": 4})
    ranked = rank(j("rank"), BASE, SHOWN[::-1] + FIRST[4:])
    rank(j(demo.TRAINED_STAGE), TRAINED, FIRST)
    contexts = {"no memory": ("none", None), "embed:dense": ("rankings", "embed"), "embed:zsum": ("rankings", "embed"),
                BASE: ("rankings", "rank"), TRAINED: ("rankings", demo.TRAINED_STAGE),
                "oracle (gold sessions)": ("oracle", None)}
    base = {"dataset": "locomo", "question_type": "single-hop", "judge": None}
    chat_rows = [{**base, "question_id": f"q{i}", "method": m, "answer": "town", "status": "ok",
                  "ranking_status": "ok" if kind == "rankings" else None, "exact_match": 0.0,
                  "f1": 0.5 if m in ("embed:zsum", TRAINED) else 0.25 * (i % 2), "prompt_tokens": 1400}
                 for i in range(4) for m, (kind, _) in contexts.items()]
    _publish(j("chat"), "chat", {"endpoint": {"model": demo.MODEL}, "tokenizer": demo.MODEL},
             lambda p: p.write_table("answers.parquet", pa.Table.from_pylist(chat_rows)),
             {"methods": {m: {"kind": k, **({"source": j(s)} if s else {})} for m, (k, s) in contexts.items()}})
    agent_rows = [{**base, "question_id": f"q{i}", "method": m, "answer": "town", "status": "ok", "exact_match": 0.0,
                   "f1": 0.5, "llm_calls": 3, "searches": 1, "chunks": 2, "prompt_tokens": 2000 + 100 * i,
                   "seconds": 9.0, "format_ok": True} for i in range(4) for m in demo.AGENT_METHODS]
    agents = _publish(j(demo.AGENTS), "agents", {"endpoint": {"model": demo.MODEL}},
                      lambda p: p.write_table("answers.parquet", pa.Table.from_pylist(agent_rows)),
                      {"methods": {m: {"format_ok": 1.0, "answered": 4} for m in demo.AGENT_METHODS}})
    ev_cfg = {"input": j("import"), "rankings": [j("embed"), j("rank"), j(demo.TRAINED_STAGE)]}
    ev = get_stage("evaluate").run({**ev_cfg, "output": j("evaluate"), "answers": [j("chat")]})
    ev_agents = get_stage("evaluate").run({**ev_cfg, "output": j(demo.AGENTS_EVAL),
                                           "answers": [j("chat"), j(demo.AGENTS)]})
    results = {"locomo": {"embed": embed, "rank": ranked, "evaluate": ev, demo.AGENTS_EVAL: ev_agents,
                          demo.AGENTS: agents}}
    return {"root": root, "results": results, "config": {**ev_cfg, "answers": [j("chat"), j(demo.AGENTS)]}}


def _rows(lines: list[str]) -> list[str]:
    """The rows of the tables on a screen as ``label values``, each label whole again: a row's line starts with
    its label two spaces in, the label's words ending at the first cell that is a count or ``-`` (n); the
    label's wrapped rest follows on continuation lines, further in, whose other cells are blank."""
    rows: list[list[list[str]]] = []
    in_row = False
    for ln in lines:
        words = ln.split()
        if ln.startswith("  ") and not ln.startswith("   ") and words:
            cut = next((i for i, w in enumerate(words) if i and re.fullmatch(r"\d+|-", w)), len(words))
            rows.append([words[:cut], words[cut:]])
            in_row = True
        elif in_row and ln.startswith("   ") and words:
            rows[-1][0] += words
        else:
            in_row = False
    return [" ".join(label + rest) for label, rest in rows]


# --------------------------------------------------------------------------- 120 columns
def test_every_line_of_the_demos_tables_fits_120_columns_and_keeps_every_row(run):
    res = run["results"]
    screens = {part: screen.screen(res, part) for part in ("first", "evaluate", "agents")}
    for part, lines in screens.items():
        wide = [ln for ln in lines if len(ln) > demo.TABLE_WIDTH]
        assert not wide, (part, [len(ln) for ln in wide], wide[:2])
    # nothing lost to the wrapping: every method with its n and interval, the labels that say what it is
    first = _rows(screens["first"])
    for m in ("embed:dense", "embed:bm25", "embed:zsum (default)"):
        assert any(re.match(rf"{re.escape(m)} +6 +\d\.\d{{3}} \[", r) for r in first), (m, first)
    ev = _rows(screens["evaluate"])
    trained = [r for r in ev if r.split()[0] == TRAINED]   # beside the first stage, and in the answers
    assert len(trained) >= 2 and all("returns its input order" in r for r in trained), trained
    assert any(re.search(r" 4 0\.500 \[0\.50, 0\.50\]", r) for r in trained), trained   # its F1, n, interval
    assert any(r.split()[0] == BASE and "4/4 (100%)" in r for r in ev), ev
    assert any(r.split()[:2] == ["oracle", "(gold"] for r in ev), ev
    ag = _rows(screens["agents"])
    assert {r.split()[0] for r in ag} >= {"agent:search", "agent:memory", "no", "embed:zsum"}, ag
    # the label column never breaks a method's name
    for part, lines in screens.items():
        for label in ((BASE, TRAINED) if part == "evaluate" else ()) + (("embed:zsum",) if part == "first" else ()):
            assert any(label in ln for ln in lines), (part, label)
    # the same functions without a width keep one line per row (reports, other callers)
    assert all(len(ln.split()) > 3 for ln in screen.first_stage_table(res) if ln.startswith("locomo"))


# --------------------------------------------------------------------------- the paper's models command
def test_the_paper_models_command_runs_when_pasted(tmp_path):
    """The printed command, pasted into bash, is one command line (no comment after a line continuation)
    whose arguments memsifter's pipeline parser accepts."""
    text = demo.REAL_FLAGS.format(config=demo.config_path())
    assert all(len(ln) <= demo.TABLE_WIDTH for ln in text.splitlines()), text
    cmd = "\n".join(ln for ln in text.splitlines() if ln.startswith("  "))
    assert cmd.lstrip().startswith("memsifter pipeline run ")
    syntax = subprocess.run(["bash", "-n", "-c", cmd], capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr
    # pasted with `memsifter` standing in as a function that prints its arguments, one a line
    shell = subprocess.run(["bash", "-c", 'memsifter() { printf "%s\\n" "$@"; }\n' + cmd], capture_output=True,
                           text=True)
    assert shell.returncode == 0 and shell.stderr == "", shell.stderr
    argv = shell.stdout.splitlines()
    sets = [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]
    assert "stages.chat.endpoint.model=gpt-4o-mini" in sets and "stages.rank-trained.engine=vllm" in sets, argv
    assert len(argv) == 6 + 2 * len(sets), argv   # pipeline run --config C --run R, then only --set pairs
    # the same arguments plan the pipeline (`show` instead of `run`: nothing runs)
    show = subprocess.run([MEMSIFTER, "pipeline", "show", "--brief", *argv[2:]], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert show.returncode == 0, show.stderr[-2000:]
    assert "rank " in show.stdout and "chat " in show.stdout


# --------------------------------------------------------------------------- --agents: one statement
def _flat(text: str) -> str:
    return " ".join(text.replace("`", "").split())


def test_agents_cost_and_scope_is_one_statement_in_help_banner_and_readme(tmp_path):
    help_ = subprocess.run([MEMSIFTER, "demo", "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert help_.returncode == 0
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    for where, text in (("--help", help_.stdout), ("banner", demo.BANNER), ("README.md", readme)):
        flat = _flat(text)
        assert _flat(demo.AGENTS_SCOPE) in flat, where
        assert _flat(demo.AGENTS_COST) in flat, where
    # and no other figure for it anywhere on the screen
    for text in (help_.stdout, demo.BANNER):
        assert not re.search(r"\b(35|31) s\b", _flat(text)), text


# --------------------------------------------------------------------------- the trained ranker adapter
def test_the_identity_ranker_adapter_is_shown_only_when_asked_for(tmp_path):
    """The shipped ranker adapter returns its input order: the default demo leaves it out (no section, no
    context, no server), ``--trained-ranker`` brings it back with its card's warning."""
    help_ = subprocess.run([MEMSIFTER, "demo", "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    flat = _flat(help_.stdout)
    assert "--trained-ranker" in flat and "returns its input order" in flat
    ask = demo.parse_args(["--trained-ranker"])
    assert ask.trained_ranker and not demo.parse_args([]).trained_ranker
    spec = demo.real_spec(str(tmp_path), "locomo", dict(demo.REAL)["locomo"], 5, 3, trained=False)
    assert demo.TRAINED_STAGE not in spec["stages"]
    assert demo.TRAINED_STAGE not in json.dumps(spec["stages"]["chat"])
    assert "NOT trained as a ranker" in demo.BANNER and "--trained-ranker" in demo.BANNER


# --------------------------------------------------------------------------- memsifter run evaluate
def test_run_evaluate_prints_the_demos_tables_and_its_json_behind_a_flag(run, tmp_path):
    cfg = tmp_path / "evaluate.json"
    out = str(tmp_path / "evaluate")
    cfg.write_text(json.dumps({**run["config"], "output": out}))
    env = {**os.environ, "RAY_ADDRESS": ""}
    proc = subprocess.run([MEMSIFTER, "run", "evaluate", "--config", str(cfg)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0] == f"evaluate: published: {out}"
    assert "{" not in proc.stdout and len(lines) < 90, proc.stdout
    assert all(len(ln) <= demo.TABLE_WIDTH for ln in lines if not ln.startswith(("report ", "plots "))), \
        [ln for ln in lines if len(ln) > demo.TABLE_WIDTH]
    text = "\n".join(lines)
    for intro in ("First-stage retrieval", "Rankers, beside the first stage", "Answers of the working LLM",
                  "Memory agents beside"):
        assert intro in text, intro
    rows = _rows(lines)
    assert any(r.split()[:2] == ["embed:zsum", "(default)"] for r in rows), rows   # the embed output's default
    assert any(r.split()[0] == "agent:search" and "4/4" in r for r in rows), rows
    assert f"report {out}/report.md" in text and "answer_f1_and_cost.png" in text
    # --json: the stats, as before
    js = subprocess.run([MEMSIFTER, "run", "evaluate", "--config", str(cfg), "--json"], cwd=tmp_path, env=env,
                        capture_output=True, text=True, timeout=300)
    assert js.returncode == 0, js.stderr[-3000:]
    first, _, rest = js.stdout.partition("\n")
    assert first == f"evaluate: already published (skipped): {out}"
    assert json.loads(rest) == storage.read_manifest(out)["stats"]


# --------------------------------------------------------------------------- answer_f1_and_cost.png
def _cost_report(n: int = 10) -> dict:
    """Ten methods as a demo with --agents and the trained ranker has them: several read the same tokens and
    score the same F1 (the identity ranker and its input; two methods at 0), across 140 to 18,000 tokens."""
    spec = [("no memory", 140, 0.04), ("embed:dense", 1400, 0.05), ("embed:zsum", 1450, 0.06),
            (BASE, 1450, 0.06), (TRAINED, 1450, 0.06), ("oracle (gold sessions)", 1500, 0.055),
            ("agent:search", 2100, 0.0), ("agent:memory", 17000, 0.0), ("agent:search (agents-trained)", 2300, 0.17),
            ("agent:memory (agents-trained)", 17600, 0.0)][:n]
    methods = {label: {"n": 10, "f1": f1, "exact_match": 0.0,
                       "ci": {"f1": {"n": 10, "ci_low": max(0.0, f1 - 0.02), "ci_high": f1 + 0.02}},
                       "cost": {"prompt_tokens": {"mean": float(tok), "n": 10}}} for label, tok, f1 in spec}
    return {"side_by_side": {"questions": 10, "same": True, "methods": methods}}


@pytest.mark.parametrize("span", ["140 to 17,600 tokens", "1,400 to 30,000 tokens"])
def test_cost_figure_shows_every_method_and_readable_ticks(span):
    """Over two decades and over one and a half (where matplotlib's own log ticks label 2x10^3, 3x10^3, ...
    side by side and collide)."""
    from memsifter.stages.evaluate import f1_and_cost_figure

    report = _cost_report()
    if span.startswith("1,400"):
        for m in report["side_by_side"]["methods"].values():
            m["cost"]["prompt_tokens"]["mean"] = max(1400.0, 1.7 * m["cost"]["prompt_tokens"]["mean"])
    fig = f1_and_cost_figure(report)
    fig.canvas.draw()
    ax = fig.axes[0]
    # every method's point, where it is drawn on the page (offsets included): no two on one spot
    pts = [line.get_transform().transform(line.get_xydata())[0] for line in ax.lines
           if line.get_marker() not in (None, "None", "", "_") and len(line.get_xydata()) == 1]
    assert len(pts) == 10, len(pts)
    close = [(i, k) for i in range(10) for k in range(i) if abs(pts[i][0] - pts[k][0]) < 7
             and abs(pts[i][1] - pts[k][1]) < 7]
    assert not close, close
    # the legend names all ten
    assert len(ax.get_legend().get_texts()) == 10
    # tick labels: none overlaps another, and they read as numbers (no 10^3-style mathtext, no minor labels)
    renderer = fig.canvas.get_renderer()
    labels = [t for t in ax.get_xticklabels(minor=False) + ax.get_xticklabels(minor=True)
              if t.get_text() and t.get_visible() and ax.get_xlim()[0] <= t.get_position()[0] <= ax.get_xlim()[1]]
    boxes = sorted((t.get_window_extent(renderer) for t in labels), key=lambda b: b.x0)
    assert len(boxes) >= 3
    assert all(a.x1 + 2 <= b.x0 for a, b in zip(boxes, boxes[1:])), [t.get_text() for t in labels]
    assert all(re.fullmatch(r"\d+(\.\d+)?k?", t.get_text()) for t in labels), [t.get_text() for t in labels]


def test_answer_rows_keep_one_order_whatever_order_the_stats_come_in():
    """A re-run reads the answers' stats back from the manifests, in another key order than the run that
    computed them: the screen's rows must come out in the same order (the references in their fixed order,
    then by group and name; the agents in the order they ran)."""
    import itertools

    labels = ["random sessions", "no memory", "constant answer", "embed:zsum", "embed:dense", "embed:bm25",
              "rank:b", "rank:a", "oracle (gold sessions)"]
    orders = {tuple(sorted(p, key=screen._context_order)) for p in itertools.permutations(labels[:4])}
    assert orders == {("no memory", "constant answer", "random sessions", "embed:zsum")}
    assert sorted(reversed(labels), key=screen._context_order) == sorted(labels, key=screen._context_order)
    agents = ["agent:search", "agent:memory", "agent:search (agents-trained)", "agent:memory (agents-trained)"]
    assert sorted(agents, key=screen._context_order) == agents
