"""Figures that recompute (issue 42 item 3): every table ``benchmarks/tables.py`` knows is re-run on the committed
files it names (per-question answers and rankings; a speed table's JSON or log; a ranker run's aggregates), and
each line it prints must be a line of every document that publishes it (a number edited by hand in a doc, or a
file changed under it, fails here); a table of figures that no command prints must say that it is not
recomputable. Reads files only: no model runs (``reference-rows`` runs ``evaluate`` over a shared file: --heavy)."""

from __future__ import annotations

import contextlib
import functools
import glob
import re
import io
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
import tables  # noqa: E402


@functools.lru_cache(maxsize=None)
def recomputed(name: str) -> tuple[str, ...]:
    """The lines ``tables.py NAME`` prints (the command's own main, in process; the CLI: a test below)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert tables.main([name]) == 0
    return tuple(line for line in out.getvalue().splitlines() if line.strip())


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.heavy) if n in tables.HEAVY else n
                                  for n in sorted(tables.TABLES)])
def test_published_table_is_what_the_committed_files_give(name):
    if name in tables.HEAVY and not os.path.exists(tables.HEAVY[name]):
        pytest.skip(f"{tables.HEAVY[name]} is not on this machine")
    printed = recomputed(name)
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


# Where issue 42 item 3 asks for recomputed tables: README, benchmarks/README, the model cards, the results READMEs
# (benchmarks/results and the GPU runs' benchmarks/gpu/results), the GPU notes benchmarks/gpu/README.
DOCS = ["README.md", "benchmarks/README.md", *sorted(glob.glob("memsifter/adapters/*/MODEL_CARD.md", root_dir=REPO)),
        *sorted(glob.glob("benchmarks/results/*/README.md", root_dir=REPO)), "benchmarks/gpu/README.md",
        *sorted(glob.glob("benchmarks/gpu/results/*/README.md", root_dir=REPO))]
# a cell that starts with a number
FIGURE = re.compile(r"^\**[−+-]?\(?\d[\d,.]*\)?(%|x|×| s| GiB| GB| MB| ms)?\**( |$)")
FACTS = {  # tables of facts, not of measurements (each says where its numbers come from)
    ("README.md", "| name | what | licence | context | PyPI | good for |"),   # memsifter.models.registry's models
}


def test_every_table_of_figures_is_recomputed_or_says_it_cannot_be():
    """A table whose cells hold figures is either printed by ``tables.py`` for that document, or the paragraph
    above it says that it is not recomputable (its run's output was not committed). Key/value tables (a model
    card's ``| | |``) and the listed fact tables hold facts of the setup, not results."""
    printed: dict[str, set] = {}
    for name, (_, _, docs) in tables.TABLES.items():
        if name not in tables.HEAVY:
            for doc in docs:
                printed.setdefault(doc, set()).update(recomputed(name))
    for name in tables.HEAVY:   # their lines are checked with --heavy; here they only count as recomputed
        for doc in tables.TABLES[name][2]:
            with open(os.path.join(REPO, doc), encoding="utf-8") as f:
                printed.setdefault(doc, set()).update(line.rstrip("\n") for line in f)
    unbacked = []
    for doc in DOCS:
        with open(os.path.join(REPO, doc), encoding="utf-8") as f:
            lines = f.read().split("\n")
        i = 0
        while i < len(lines):
            if not lines[i].startswith("|"):
                i += 1
                continue
            j = i
            while j < len(lines) and lines[j].startswith("|"):
                j += 1
            cells = [c.strip() for row in lines[i + 2:j] for c in row.strip("|").split("|")[1:]]
            said = " ".join(lines[max(0, i - 8):i]).lower()
            if (any(FIGURE.match(c) for c in cells) and lines[i].replace(" ", "") != "|||"
                    and (doc, lines[i]) not in FACTS and not all(row in printed.get(doc, ()) for row in lines[i:j])
                    and "not recomputable" not in said and "not committed" not in said):
                unbacked.append(f"{doc}:{i + 1}: {lines[i][:80]}")
            i = j
    assert not unbacked, "tables of figures neither recomputed by tables.py nor marked not recomputable: " + \
        "; ".join(unbacked)


@pytest.mark.parametrize("doc", sorted(tables.FIGURES))
def test_prose_figures_are_what_the_committed_files_give(doc):
    """The headline figures a document states in its sentences, computed from the committed files
    (``tables.py --figures``), appear in it word for word (line breaks aside)."""
    with open(os.path.join(REPO, doc), encoding="utf-8") as f:
        text = " ".join(f.read().split())
    missing = [p for p in tables.FIGURES[doc]() if " ".join(p.split()) not in text]
    assert not missing, f"{doc} does not state: {missing}"
