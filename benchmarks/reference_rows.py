"""The answer table of the agents' GPU run with its reference rows and both F1s, from its committed answers.

Scores the committed per-question answers of ``benchmarks/gpu/results/2026-11-26-h100-agents-sft/answers``
(chat's no memory / first stage / gold sessions, the base and SFT agents) in one ``evaluate`` over the run's
held-out questions: our token F1 and LoCoMo's own QA F1 side by side, the constant-answer reference (chosen on
the other half of the questions: LoCoMo's held-out conversation is one haystack, cut into its first and second
half of questions; LongMemEval's questions alternate) and every method's paired difference to the strongest
reference. No LLM runs. Writes evaluate's output (``report.md``, ``report.json``) under ``--out`` and prints the
demo's answers table (:func:`memsifter.retrieval.screen.answers_table`).

    python benchmarks/reference_rows.py --lme ../shared/data/longmemeval_s_train348.json.gz \\
        --locomo memsifter/samples/locomo_dev2.json.gz \\
        --answers benchmarks/gpu/results/2026-11-26-h100-agents-sft/answers --out /tmp/reference-rows
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(HERE, "gpu"))

ANSWER_FILES = ("chat-base.parquet", "agents-base.parquet", "agents-sft.parquet")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lme", required=True, help="LongMemEval_S file the run's LongMemEval questions come from")
    p.add_argument("--locomo", required=True, help="LoCoMo file the run's LoCoMo questions come from")
    p.add_argument("--answers", required=True, help="folder of the run's answers parquet files")
    p.add_argument("--out", required=True, help="where the dataset and evaluate's output go")
    a = p.parse_args(argv)
    for path in (a.lme, a.locomo, *(os.path.join(a.answers, f) for f in ANSWER_FILES)):
        if not os.path.exists(path):
            print(f"reference_rows: {path} does not exist", file=sys.stderr)
            return 2

    import pyarrow.parquet as pq

    from memsifter.retrieval import screen
    from memsifter.data.importers.locomo import convert_locomo
    from memsifter.data.importers.longmemeval import convert_longmemeval
    from memsifter.stage import get_stage
    from run_agents import publish_questions

    answers = [os.path.join(a.answers, f) for f in ANSWER_FILES]
    ids = sorted({r for f in answers for r in pq.read_table(f, columns=["question_id"]).column(0).to_pylist()})
    data = os.path.join(a.out, "heldout")
    if not os.path.exists(os.path.join(data, "_SUCCESS")):
        parts = [convert_longmemeval(a.lme, "longmemeval_s")[0], convert_locomo(a.locomo, "locomo")[0]]
        publish_questions(parts, ids, data, "the agents' GPU run's held-out questions")
    m = get_stage("evaluate").run({"output": os.path.join(a.out, "evaluate"), "input": data, "answers": answers})
    print("\n".join(screen.answers_table({"held-out": {"evaluate": m}}, width=120)))
    print(f"\nreport: {os.path.join(a.out, 'evaluate', 'report.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
