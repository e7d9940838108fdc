"""Figures that recompute (issue 42 item 3): every table ``benchmarks/tables.py`` knows is re-run on the committed
per-question files, and each line it prints must be a line of the documents that publish it (a number edited
by hand in a doc, or a file changed under it, fails here)."""

from __future__ import annotations

import contextlib
import glob
import io
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
import tables  # noqa: E402


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.heavy) if n in tables.HEAVY else n
                                  for n in sorted(tables.TABLES)])
def test_published_table_is_what_the_committed_files_give(name):
    if name in tables.HEAVY and not os.path.exists(tables.HEAVY[name]):
        pytest.skip(f"{tables.HEAVY[name]} is not on this machine")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):   # the command's own main, in process (the CLI: test below)
        assert tables.main([name]) == 0
    printed = [line for line in out.getvalue().splitlines() if line.strip()]
    assert len(printed) >= 2
    for doc in tables.TABLES[name][2]:   # every document that publishes the table publishes all of it
        with open(os.path.join(REPO, doc), encoding="utf-8") as f:
            published = {line.rstrip("\n") for line in f}
        missing = [line for line in printed if line not in published]
        assert not missing, f"{name}: lines of the recomputed table that {doc} does not publish: {missing}"


def test_tables_cli_lists_every_table_with_its_files_and_docs():
    r = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "tables.py"), "--list"], capture_output=True,
                       text=True, cwd=REPO, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert [line.split(":")[0] for line in r.stdout.splitlines()] == sorted(tables.TABLES)
    for name, (_, files, docs) in tables.TABLES.items():
        assert all(os.path.exists(os.path.join(REPO, d)) for d in docs), name
        for pattern in files:   # every file a table says it reads is committed (the shared data set aside)
            assert pattern.startswith("../") or glob.glob(os.path.join(REPO, pattern)), (name, pattern)


def test_the_agents_held_out_conversation_is_conv_26():
    """The agents' split held out LoCoMo conv-26 (150 answerable questions) and trained on conv-30: the committed
    answers say so, and no doc about that run calls its held-out conversation conv-30."""
    rows = tables.answers(tables.AGENTS_SFT)["agent:search, SFT"]
    assert {r["question_id"].rsplit("_q", 1)[0] for r in rows if r["dataset"] == "locomo"} == {"conv-26"}
    for doc in (f"{tables.AGENTS_SFT}/README.md", tables.CARD,
                "benchmarks/results/agents-one-call-2026-11-26/README.md"):
        for line in open(os.path.join(REPO, doc), encoding="utf-8"):
            if "conv-" in line and any(w in line.lower() for w in ("held out", "held-out", "heldout")):
                assert "conv-26" in line, (doc, line)
                assert "conv-30" not in line or "train" in line, (doc, line)
