"""`memsifter demo --agents`: the memory agents beside the chat contexts on the demo's first LoCoMo questions.

Fast tests of the spec the flag adds (an ``agents`` section and a second evaluate instance that scores chat and
the agents side by side, the plain evaluate left as it was), of the agents table (rendered from the stats the
real evaluate stage writes) and of the flags it refuses; then the demo itself, end to end, with both agents.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest

from memsifter import demo
from memsifter.retrieval import screen
from memsifter.errors import ConfigError
from memsifter.pipeline import plan
from memsifter.stage import config_hash, get_stage, validate_config
from memsifter.store import storage
from test_demo import _ci_demo
from test_demo_screen import _rows

LOCOMO = dict(demo.REAL)["locomo"]


def steps(spec: dict) -> dict:
    return {s.name: s for s in plan(spec)}


# --------------------------------------------------------------------------- the spec
def test_agents_sections_only_with_the_flag_and_the_plain_evaluate_unchanged(tmp_path):
    plain = demo.real_spec(str(tmp_path), "locomo", LOCOMO, 5, 3)
    with_agents = demo.real_spec(str(tmp_path), "locomo", LOCOMO, 5, 3, agents=2)
    assert demo.AGENTS not in plain["stages"] and demo.AGENTS_EVAL not in plain["stages"]
    st = with_agents["stages"]
    ag = st[demo.AGENTS]
    assert ag["methods"] == ["agent:search", "agent:memory"] and ag["max_questions"] == 2
    # the same working LLM as chat's, served by the demo's vLLM server (its URL filled in when the stage runs)
    assert ag["endpoint"]["model"] == st["chat"]["endpoint"]["model"] == demo.MODEL
    assert ag["endpoint"]["base_url"] is None and ag.get("search_url") is None
    assert ag["tokenizer"] == st["chat"]["tokenizer"]

    p, q = steps(plain), steps(with_agents)
    run = storage.join(str(tmp_path), "locomo")
    assert q[demo.AGENTS].config["input"] == storage.join(run, "import")
    assert q[demo.AGENTS].config["embeddings"] == storage.join(run, "embed")
    assert q[demo.AGENTS_EVAL].stage == "evaluate"
    assert q[demo.AGENTS_EVAL].config["answers"] == [storage.join(run, "chat"), storage.join(run, demo.AGENTS)]
    assert q[demo.AGENTS_EVAL].config["output"] == storage.join(run, demo.AGENTS_EVAL)
    # the plain evaluate scores chat alone, with the config a demo without --agents publishes: a second run with
    # --agents reuses everything already published and runs only the agents and their evaluate
    assert q["evaluate"].config["answers"] == [storage.join(run, "chat")]
    for name in ("import", "embed", "rank", demo.TRAINED_STAGE, "chat", "evaluate"):
        assert config_hash(validate_config(p[name].stage, p[name].config)) == \
            config_hash(validate_config(q[name].stage, q[name].config)), name
    # the agents' evaluate runs after both answer stages
    order = [s.name for s in plan(with_agents)]
    assert order.index(demo.AGENTS_EVAL) > max(order.index("chat"), order.index(demo.AGENTS))
    assert demo.AGENTS_TRAINED not in st   # only when the trained adapter is installed and served


def test_trained_agents_section_answers_the_same_questions_with_the_shipped_adapter(tmp_path):
    """With the trained adapter (shipped in memsifter), a second agents section runs both agents with it on the
    same questions, budgets and memory service, and the agents' evaluate scores it beside the untrained ones."""
    from memsifter.models import registry as models

    assert models.shipped_adapter(demo.TRAINED_AGENTS), "the trained agents adapter ships with memsifter"
    spec = demo.real_spec(str(tmp_path), "locomo", LOCOMO, 5, 3, agents=2, trained_agents=True)
    st = spec["stages"]
    ag, tr = st[demo.AGENTS], st[demo.AGENTS_TRAINED]
    assert tr["endpoint"]["model"] == demo.TRAINED_AGENTS != ag["endpoint"]["model"]
    for k in ("methods", "max_questions", "agent_options", "tokenizer"):
        assert tr[k] == ag[k], k
    q = steps(spec)
    run = storage.join(str(tmp_path), "locomo")
    assert q[demo.AGENTS_TRAINED].stage == "agents"
    assert q[demo.AGENTS_TRAINED].config["output"] == storage.join(run, demo.AGENTS_TRAINED)
    assert q[demo.AGENTS_EVAL].config["answers"] == [storage.join(run, x) for x in ("chat", demo.AGENTS,
                                                                                     demo.AGENTS_TRAINED)]
    order = [s.name for s in plan(spec)]
    assert order.index(demo.AGENTS_EVAL) > order.index(demo.AGENTS_TRAINED)
    assert "trained adapter" in screen.agent_label(f"agent:search ({demo.AGENTS_TRAINED})")
    assert "untrained" in screen.agent_label("agent:search (agents)")


def test_agents_section_needs_only_its_urls_at_run_time(tmp_path):
    """The section validates as the pipeline checks it before anything runs; the stage refuses agent:search
    without the memory service's URL, which the demo fills in just before the stage runs (the `before` hook), and
    neither URL is part of the config hash (a new free port on every run does not re-run the agents)."""
    step = steps(demo.real_spec(str(tmp_path), "locomo", LOCOMO, 5, 3, agents=2))[demo.AGENTS]
    cfg = validate_config("agents", step.config)
    with pytest.raises(ConfigError, match="base_url"):
        cfg.preflight()
    filled = {**step.config, "endpoint": {**step.config["endpoint"], "base_url": "http://127.0.0.1:9/v1"}}
    with pytest.raises(ConfigError, match="search_url"):
        validate_config("agents", filled).preflight()
    ready = validate_config("agents", {**filled, "search_url": "http://127.0.0.1:9"})
    ready.preflight()
    assert config_hash(ready) == config_hash(cfg)


def test_memory_agent_budget_is_the_one_shown():
    """The memory agent's budgets (lowered for the CPU) build a real agent and are what the screen states."""
    from memsifter.stages.agents import make_agent

    for m in demo.AGENT_METHODS:
        make_agent(m, demo.AGENT_OPTIONS.get(m, {}))
    opts = demo.AGENT_OPTIONS["agent:memory"]
    label = screen.agent_label("agent:memory", demo.AGENT_OPTIONS)
    assert f"top {opts['max_chunks']} sessions" in label and f"{opts['memory_tokens']}-token notes" in label
    assert "untrained" in screen.agent_label("agent:search") and "memory service" in screen.agent_label("agent:search")


# --------------------------------------------------------------------------- the table
@pytest.fixture
def evaluated(tmp_path):
    return _evaluated(tmp_path)


def _evaluated(tmp_path, trained: bool = False):
    """The real evaluate stage over a chat output (three contexts) and an agents output (two agents, one of
    them failing one question): what the demo's agents evaluate publishes. ``trained``: also the trained
    adapter's agents output (``agents-trained``: every episode well-formed, the search agent's answers half right)."""
    from memsifter.data.model import Dataset, Question, Session

    sessions = {f"s{i}": Session(f"s{i}", [{"role": "user", "content": f"I went to town {i}"}], f"2024-01-0{i + 1}")
                for i in range(3)}
    qs = [Question(f"q{i}", "locomo", f"where did I go {i}?", f"town {i}", list(sessions), [f"s{i}"],
                   question_type="single-hop") for i in range(3)]
    data, chat, agents = (str(tmp_path / n) for n in ("import", "chat", "agents"))
    pub = storage.Publication(data, "import", {}, "x", "test")
    Dataset(sessions, qs).write(pub)
    pub.publish({})
    base = {"dataset": "locomo", "question_type": "single-hop", "judge": None}
    chat_rows = [{**base, "question_id": q.question_id, "method": method, "answer": ans, "status": "ok",
                  "exact_match": float(ans == q.answer), "f1": 1.0 if ans == q.answer else 0.0,
                  "prompt_tokens": tokens}
                 for method, tokens in (("no memory", 60), ("embed:dense", 1400), ("oracle (gold sessions)", 900))
                 for q in qs for ans in [q.answer if method != "no memory" else "unknown"]]
    agent_rows = []
    for i, q in enumerate(qs):
        agent_rows.append({**base, "question_id": q.question_id, "method": "agent:search", "answer": q.answer,
                           "status": "ok", "exact_match": 1.0, "f1": 1.0, "llm_calls": 2 + i, "searches": 1 + i,
                           "chunks": 0, "prompt_tokens": 1000 * (i + 1), "seconds": 4.0 + i, "format_ok": i != 1})
        failed = i == 2
        agent_rows.append({**base, "question_id": q.question_id, "method": "agent:memory",
                           "answer": None if failed else "town", "status": "error" if failed else "ok",
                           "exact_match": None if failed else 0.0, "f1": None if failed else 2 / 3,
                           "llm_calls": None if failed else 5, "searches": 0, "chunks": None if failed else 4,
                           "prompt_tokens": None if failed else 7000, "seconds": None if failed else 60.0,
                           "format_ok": None if failed else False})
    outputs = [(chat, "chat", chat_rows), (agents, "agents", agent_rows)]
    trained_rows = [{**r, "status": "ok", "answer": "town", "f1": 0.5, "exact_match": 0.0, "format_ok": True,
                     "llm_calls": 2, "chunks": 4 if r["method"] == "agent:memory" else 0, "prompt_tokens": 3000,
                     "seconds": 9.0} for r in agent_rows]
    if trained:
        outputs.append((str(tmp_path / demo.AGENTS_TRAINED), "agents", trained_rows))
    for uri, name, rows in outputs:
        p = storage.Publication(uri, name, {"endpoint": {"model": demo.MODEL}, "tokenizer": demo.MODEL}, "x", "test")
        p.write_table("answers.parquet", pa.Table.from_pylist(rows))
        p.publish({})
    ev = get_stage("evaluate").run({"output": str(tmp_path / demo.AGENTS_EVAL), "input": data,
                                    "answers": [uri for uri, _, _ in outputs]})

    def manifest(rows: list[dict]) -> dict:
        fmt = {m: [r["format_ok"] for r in rows if r["method"] == m and r["status"] == "ok"]
               for m in demo.AGENT_METHODS}
        # what the agents stage's manifest carries: its config (the budgets the demo set) and per-method stats
        return {"config": {"agent_options": demo.AGENT_OPTIONS},
                "stats": {"methods": {m: {"format_ok": sum(v) / len(v), "answered": len(v)} for m, v in fmt.items()}}}

    res = {demo.AGENTS_EVAL: ev, demo.AGENTS: manifest(agent_rows), "embed": {"stats": {"primary": "zsum"}}}
    if trained:
        res[demo.AGENTS_TRAINED] = manifest(trained_rows)
    return {"locomo": res}


def test_agents_table_puts_the_agents_beside_the_chat_contexts_with_cost(evaluated):
    lines = screen.agents_table(evaluated)
    header, rows = lines[0], [ln for ln in lines if ln.startswith("locomo")]
    for col in ("n", "F1 [95% CI]", "EM [95% CI]", "calls", "tokens", "seconds", "well-formed"):
        assert col in header, header
    # chat's contexts first (no memory, dense, the gold sessions), then the agents
    labels = ["no memory", "embed:dense", "oracle (gold sessions)", "agent:search", "agent:memory"]
    assert len(rows) == 5 and [next(i for i, ln in enumerate(rows) if f" {m}" in ln) for m in labels] == \
        list(range(5)), rows
    sbs = evaluated["locomo"][demo.AGENTS_EVAL]["stats"]["side_by_side"]
    assert sbs["questions"] == 2 and not sbs["same"]
    by = {m: next(ln for ln in rows if f" {m}" in ln) for m in ("no memory", "agent:search", "agent:memory",
                                                                   "embed:dense")}
    # every method over the same 2 questions (those all of them answered), F1 and EM with their intervals
    for m, ln in by.items():
        assert re.search(r"\s2\s+\d\.\d{3} \[\d\.\d\d, \d\.\d\d\]\s+\d\.\d{3} \[", ln), (m, ln)
    # cost per question over those questions: the search agent's 2 and 3 calls, 1,000 and 2,000 tokens, 4 and 5 s;
    # its well-formed episodes over all it answered (the agents stage's own count)
    assert re.search(r"\s2\.5\s+1,500\s+4\.5\s+2/3$", by["agent:search"]), by["agent:search"]
    assert re.search(r"\s5\.0\s+7,000\s+60\.0\s+0/2$", by["agent:memory"]), by["agent:memory"]
    # a chat answer is one request; its tokens as its tokenizer counts the prompt; no seconds, no format
    assert re.search(r"\s1\.0\s+1,400\s+-\s+-$", by["embed:dense"]), by["embed:dense"]
    top = demo.AGENT_OPTIONS["agent:memory"]["max_chunks"]
    assert "untrained" in by["agent:search"] and f"top {top} sessions" in by["agent:memory"]
    # the question sets differed (one memory episode failed): the table says which were compared
    assert any("agent:memory 2" in ln and "compared on the 2" in ln for ln in lines), lines


def test_agents_table_puts_the_trained_agents_after_the_untrained_with_their_own_counts(tmp_path):
    """With the shipped trained adapter's section, its rows (evaluate labels them ``agent:… (agents-trained)``)
    follow the untrained agents, say what they are, and take their well-formed counts from their own output."""
    lines = screen.agents_table(_evaluated(tmp_path, trained=True))
    rows = [ln for ln in lines if ln.startswith("locomo")]
    assert len(rows) == 7, rows
    trained = [ln for ln in rows if "trained adapter" in ln]
    assert [ln.split()[1] for ln in trained] == ["agent:search", "agent:memory"] and rows[-2:] == trained, rows
    assert all(ln.endswith("3/3") for ln in trained), trained   # every trained episode well-formed
    untrained = next(ln for ln in rows if ln.split()[1] == "agent:search" and "untrained" in ln)
    assert untrained.endswith("2/3"), untrained


def test_agents_table_says_when_agent_calls_were_replayed_from_the_cache(evaluated):
    """A re-run (--force, --replace) replays the agents' calls from the stage's response cache: their seconds
    are then not the model's, and the table says so."""
    assert not any("replayed" in ln for ln in screen.agents_table(evaluated))
    evaluated["locomo"][demo.AGENTS]["stats"]["client"] = {"requests": 2, "cached": 7}
    notes = [ln for ln in screen.agents_table(evaluated) if "replayed" in ln]
    assert len(notes) == 1 and "7 of the agents' LLM calls" in notes[0] and "seconds" in notes[0]


def test_agents_table_is_empty_without_agents(evaluated):
    assert screen.agents_table({"locomo": {"evaluate": evaluated["locomo"][demo.AGENTS_EVAL]}}) == []


# --------------------------------------------------------------------------- the flags
def _demo(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    memsifter = Path(sys.executable).with_name("memsifter")
    return subprocess.run([str(memsifter), "demo", *argv], cwd=cwd, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("argv, says", [
    (["--data", "synth", "--agents"], "--data synth"),
    (["--agents", "--answers", "0"], "--answers"),
    (["--agents", "--agent-questions", "0"], "--agent-questions"),
    (["--agents", "--answers", "3", "--agent-questions", "4"], "--agent-questions 4"),
    (["--agent-questions", "1"], "--agents"),
])
def test_refused_flags_are_one_line_exit_2_before_anything_runs(tmp_path, argv, says):
    proc = _demo("--out", str(tmp_path / "demo"), *argv, cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and says in err[0], proc.stderr
    assert proc.stdout == "" and not (tmp_path / "demo").exists()


def test_help_says_what_agents_add_and_their_cost(tmp_path):
    proc = _demo("--help", cwd=tmp_path)
    assert proc.returncode == 0
    text = " ".join(proc.stdout.split())
    assert "--agents" in text and "--agent-questions" in text
    assert "agent:search" in text and "agent:memory" in text and "memory service" in text
    assert re.search(r"--agents .*minutes", text), text


# --------------------------------------------------------------------------- end to end
@pytest.mark.slow
def test_demo_with_agents_end_to_end(tmp_path):
    """The real demo with --agents on the first LoCoMo question: both agents answer it with the demo's SmolLM2
    server (agent:search over the memory service the demo starts), and the screen puts them beside chat's
    contexts with n and cost per question. In CI the README's demo has just run (.ci/demo): --agents is added to
    that run, as a user adds it to theirs, and must redo none of its stages; elsewhere a small demo of its own
    runs from an EMPTY model cache."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env.pop("RAY_ADDRESS", None)
    memsifter = Path(sys.executable).with_name("memsifter")
    ci = _ci_demo()
    if ci and ci["returncode"] == 0:
        out, cwd, env["MEMSIFTER_MODEL_CACHE"] = Path(ci["out"]), ci["cwd"], ci["model_cache"]
        argv = [str(memsifter), *ci["argv"], "--agents", "--agent-questions", "1"]
        before = {name: storage.read_text(str(out / "locomo" / name / "_SUCCESS"))
                  for name in ("import", "embed", "rank", "chat", "evaluate")}
    else:
        # an EMPTY model cache: the demo converts SmolLM2 and merges the trained agents' adapter onto it while its
        # two vLLM servers start in threads (the default demo starts one server; a first run once crashed on that
        # race)
        out, cwd, env["MEMSIFTER_MODEL_CACHE"] = tmp_path / "demo", tmp_path, str(tmp_path / "empty-model-cache")
        argv = [str(memsifter), "demo", "--out", str(out), "--questions", "3", "--answers", "1", "--agents",
                "--agent-questions", "1"]
        before = None
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    if before:   # added to a finished demo: its stages were reused as published, not run again
        assert {name: storage.read_text(str(out / "locomo" / name / "_SUCCESS")) for name in before} == before
    noisy = [ln for ln in (proc.stdout + proc.stderr).splitlines()
             if any(w in ln for w in (" INFO ", "WARNING", "Traceback", "it/s]"))]
    assert noisy == [], noisy[:5]
    run = out / "locomo"
    ag = storage.read_manifest(str(run / demo.AGENTS))
    assert ag["stats"]["questions"] == 1 and ag["stats"]["failed"] == 0
    assert set(ag["stats"]["methods"]) == {"agent:search", "agent:memory"}
    assert ag["config"]["endpoint"]["model"] == demo.MODEL
    assert ag["config"]["search_url"].startswith("http://127.0.0.1:")
    mem = ag["stats"]["methods"]["agent:memory"]
    assert 1 <= mem["chunks"] <= demo.AGENT_OPTIONS["agent:memory"]["max_chunks"] and mem["llm_calls"] >= 2
    assert ag["stats"]["methods"]["agent:search"]["llm_calls"] >= 1
    rows = storage.read_parquet(str(run / demo.AGENTS / "answers.parquet")).to_pylist()
    chat = storage.read_parquet(str(run / "chat" / "answers.parquet")).to_pylist()
    # one question (a row per agent), one chat answered
    assert len({r["question_id"] for r in rows}) == 1 and rows[0]["question_id"] in {r["question_id"] for r in chat}
    ev = storage.read_manifest(str(run / demo.AGENTS_EVAL))
    sbs = ev["stats"]["side_by_side"]
    # side by side on the one question every method answered (chat answered more of them in CI's demo)
    assert sbs["questions"] == 1 and (sbs["same"] or before)
    # the plain evaluate scores chat alone, as without --agents
    assert not any(k.startswith("agent:") for k in storage.read_manifest(str(run / "evaluate"))["stats"]["answers"])
    lines = proc.stdout.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("Memory agents beside"))
    table = _rows(lines[start:])
    assert all(len(ln) <= demo.TABLE_WIDTH for ln in lines[start:] if "/" not in ln)
    for method in ("agent:search", "agent:memory"):
        row = next(ln for ln in table if ln.split()[0] == method)
        e = sbs["methods"][method]
        # n, F1 with its interval, then calls, tokens read and seconds per question from the evaluate stats
        assert re.search(r"\s1\s+\d\.\d{3} \[", row), row
        assert f"{e['llm_calls']:.1f}" in row and f"{e['prompt_tokens']:,.0f}" in row, row
        assert f"{e['seconds']:,.1f}" in row, row
    assert any(ln.split()[:2] == ["no", "memory"] for ln in table)
    # the shipped adapter trained as the agents, on the same question with the same budgets and service
    tr = storage.read_manifest(str(run / demo.AGENTS_TRAINED))
    assert tr["config"]["endpoint"]["model"] == demo.TRAINED_AGENTS and tr["stats"]["failed"] == 0
    assert tr["config"]["search_url"] == ag["config"]["search_url"]
    assert tr["stats"]["methods"]["agent:search"]["searches"] >= 1   # the base searched on none of 24 (the issue)
    trained_rows = [ln for ln in table if ln.split()[0].startswith("agent:") and "trained adapter" in ln]
    assert [ln.split()[0] for ln in trained_rows] == ["agent:search", "agent:memory"], table
    assert "agent:search over the memory service" in proc.stdout and "stopped" in proc.stdout
    assert f"{demo.AGENTS_EVAL}/report.md" in proc.stdout and "answer_f1_and_cost.png" in proc.stdout
