"""Embedding throughput: naive per-question embedding vs the embed stage's dedup + length buckets.

Measured in the same run, with the same model (all-MiniLM-L6-v2 from the PyPI package, CPU, fp32)
and the same :class:`memsifter.models.embedding.Embedder`, so only the batching strategy differs:

- ``naive``      : every question embeds its whole haystack (+ the question), batches of ``--batch``
                   in haystack order: what the original did per question.
- ``dedup``      : each distinct text once (content hash), batches of ``--batch`` in hash order.
- ``dedup+bucket``: each distinct text once, length-bucketed batches (``plan_batches``): the stage.

Prints a table with wall time, texts embedded, padded tokens computed and the ratio to ``naive``,
and checks that all three give the same similarities.

    python benchmarks/bench_embed.py                  # synthetic data with shared sessions
    python benchmarks/bench_embed.py --dataset lme --questions 8   # ../shared LongMemEval dev30

CPU precision (``--mode precision``): the same texts and length-bucketed batches through the
Embedder in float32 (the embed stage before issue 9), bfloat16 (the CPU default where the CPU has
bf16 matrix units) and torch int8 dynamic quantisation of the Linear layers, side by side in one run:
texts/s, the ratio to float32, the largest question-session similarity difference and the share of
questions whose top-10 is identical to float32's.

    python benchmarks/bench_embed.py --mode precision --dataset sample --questions 6
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def load(dataset: str, questions: int, tmp: str):
    from memsifter.data.model import Dataset, read_dataset
    from memsifter.stage import get_stage

    if dataset == "sample":
        from memsifter import samples

        get_stage("import").run({"output": f"{tmp}/d", "format": "longmemeval",
                                 "source": samples.path(samples.LONGMEMEVAL)})
    elif dataset == "lme":
        src = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "longmemeval_s_dev30.json.gz")
        get_stage("import").run({"output": f"{tmp}/d", "format": "longmemeval", "source": os.path.abspath(src)})
    else:
        get_stage("synth").run({"output": f"{tmp}/d", "questions": questions, "sessions_per_question": 24,
                                "seed": 0})
    ds = read_dataset(f"{tmp}/d")
    qs = ds.questions[:questions]
    used = {s for q in qs for s in q.haystack_session_ids}
    return Dataset({k: v for k, v in ds.sessions.items() if k in used}, qs)


def padded_tokens(emb, batches) -> int:
    total = 0
    for b in batches:
        lens = [len(x) for x in emb.tokenizer(list(b), truncation=True, max_length=emb.spec.max_length)["input_ids"]]
        total += max(lens) * len(lens)
    return total


def precision(args, ds) -> int:
    """float32 vs bf16 vs int8 on the same texts and batches (see the module docstring)."""
    import copy

    import torch

    from memsifter.models import embedding
    from memsifter.retrieval.render import render_session
    from memsifter.stages.embed import turn_units

    os.environ["MEMSIFTER_EMBED_CPU_BF16"] = "0"
    spec = embedding.ModelSpec.resolve("all-MiniLM-L6-v2")  # the stage's settings (max_length 256)
    emb = embedding.Embedder(spec, "cpu")
    sids = sorted({s for q in ds.questions for s in q.haystack_session_ids})
    units = {s: turn_units(ds.sessions[s].turns, 200) for s in sids}
    texts = sorted({q.question for q in ds.questions} | {t for s in sids for t in units[s]}
                   | ({render_session(ds.sessions[s].turns) for s in sids} if args.sessions else set()))
    plan = embedding.plan_batches([(str(i), t) for i, t in enumerate(texts)], spec.max_length)
    fp32 = emb.model
    variants = {"float32": fp32, "bfloat16": copy.deepcopy(fp32).to(torch.bfloat16),
                "int8 dynamic": torch.ao.quantization.quantize_dynamic(copy.deepcopy(fp32), {torch.nn.Linear},
                                                                       dtype=torch.qint8)}
    encoders = {}
    try:  # ONNX Runtime (float32 and int8 dynamic) of the same weights, when installed (not a dependency)
        encoders = onnx_encoders(emb, tempfile.mkdtemp(prefix="bench-onnx-"))
    except ImportError as e:
        print(f"  (ONNX Runtime variants skipped: {e})")
    res, vecs = {}, {}
    for name, model in list(variants.items()) + list(encoders.items()):
        if name in encoders:
            emb.encode = model
        else:
            emb.model = model
        emb.encode(texts[:8])  # warm-up
        out = np.zeros((len(texts), emb.dim), dtype=np.float32)
        t0 = time.perf_counter()
        for b in plan:
            out[[int(i) for i, _ in b]] = emb.encode([t for _, t in b])
        res[name] = time.perf_counter() - t0
        vecs[name] = out
        print(f"  {name}: {len(texts) / res[name]:.1f} texts/s", flush=True)
    idx = {t: i for i, t in enumerate(texts)}

    def sims(v, q):  # the turns method's session scores: best unit per session
        qv = v[idx[q.question]]
        return np.array([max(float(v[idx[u]] @ qv) for u in units[s]) for s in q.haystack_session_ids])

    print(f"\nCPU precision: {len(ds.questions)} LongMemEval questions, {len(sids)} sessions, {len(texts)} "
          f"texts (turn units + questions{' + whole sessions' if args.sessions else ''}), all-MiniLM-L6-v2, "
          f"max_length {spec.max_length}, {torch.get_num_threads()} threads, {len(plan)} batches\n")
    print("| precision | seconds | texts/s | speed vs float32 | max |similarity diff| | max |vector diff| "
          "| identical top-10 |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name in vecs:
        v = vecs[name]
        diff, same = 0.0, 0
        for q in ds.questions:
            a, b = sims(vecs["float32"], q), sims(v, q)
            diff = max(diff, float(np.abs(a - b).max()))
            same += embedding_top(a) == embedding_top(b)
        print(f"| {name} | {res[name]:.2f} | {len(texts) / res[name]:.1f} | {res['float32'] / res[name]:.2f}x | "
              f"{diff:.2e} | {float(np.abs(v - vecs['float32']).max()):.2e} | {same}/{len(ds.questions)} |")
    return 0


def onnx_encoders(emb, tmp: str) -> dict:
    """encode() functions running the Embedder's float32 weights exported to ONNX (TorchScript exporter),
    in ONNX Runtime as exported and int8 dynamically quantised; pooling and normalisation as the Embedder."""
    import onnxruntime as ort
    import torch
    from onnxruntime.quantization import QuantType, quantize_dynamic

    enc = emb.tokenizer(["warm up", "two"], return_tensors="pt", padding=True)
    names = [k for k in ("input_ids", "attention_mask", "token_type_ids") if k in enc]
    model = emb.model

    class Wrap(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = model

        def forward(self, *args):
            return self.m(**dict(zip(names, args))).last_hidden_state

    fp32, int8 = os.path.join(tmp, "model.onnx"), os.path.join(tmp, "model.int8.onnx")
    axes = {k: {0: "batch", 1: "seq"} for k in names + ["hidden"]}
    # The exporter restores the wrapper's train/eval mode recursively afterwards: export an eval-mode
    # wrapper, or dropout would be left on in the Embedder's model.
    torch.onnx.export(Wrap().eval(), tuple(enc[k] for k in names), fp32, input_names=names, output_names=["hidden"],
                      dynamic_axes=axes, opset_version=17, dynamo=False)
    model.eval()
    quantize_dynamic(fp32, int8, weight_type=QuantType.QInt8)
    out = {}
    for label, path in (("onnxruntime float32", fp32), ("onnxruntime int8", int8)):
        so = ort.SessionOptions()
        so.intra_op_num_threads = torch.get_num_threads()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])

        def encode(texts, sess=sess):
            x = emb.tokenizer(list(texts), truncation=True, max_length=emb.spec.max_length, padding=True,
                              return_tensors="np")
            h = sess.run(None, {k: x[k].astype(np.int64) for k in names})[0]
            m = x["attention_mask"][..., None].astype(np.float32)
            v = (h * m).sum(1) / np.maximum(m.sum(1), 1e-9)
            return (v / np.linalg.norm(v, axis=1, keepdims=True)).astype(np.float32)
        out[label] = encode
    return out


def embedding_top(scores, k: int = 10) -> list[int]:
    from memsifter.stages.embed import order_by

    return order_by(scores)[:k]


def main() -> int:
    from memsifter.models import embedding
    from memsifter.retrieval.render import render_session

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=["batching", "precision"], default="batching")
    p.add_argument("--sessions", action="store_true", help="precision: also embed whole sessions")
    p.add_argument("--dataset", choices=["synth", "lme", "sample"], default="synth")
    p.add_argument("--questions", type=int, default=12)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    args = p.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        ds = load(args.dataset, args.questions, tmp)
    if args.mode == "precision":
        return precision(args, ds)
    os.environ["MEMSIFTER_EMBED_CPU_BF16"] = "0"  # the batching comparison is in float32
    spec = embedding.ModelSpec.resolve("all-MiniLM-L6-v2", max_length=args.max_length)
    emb = embedding.Embedder(spec)
    emb.encode(["warm up"] * 4)
    text = {sid: render_session(s.turns) for sid, s in ds.sessions.items()}

    # naive: per question, haystack order
    naive_batches = []
    for q in ds.questions:
        seq = [q.question] + [text[s] for s in q.haystack_session_ids]
        naive_batches += [seq[i:i + args.batch] for i in range(0, len(seq), args.batch)]
    distinct = {embedding.text_hash(t): t for t in list(text.values()) + [q.question for q in ds.questions]}
    dedup_batches = []
    items = sorted(distinct.items())
    for i in range(0, len(items), args.batch):
        dedup_batches.append([t for _, t in items[i:i + args.batch]])
    plan = embedding.plan_batches(items, spec.max_length, tokens_per_batch=args.batch * spec.max_length,
                                  max_batch_size=4 * args.batch)
    bucket_batches = [[t for _, t in b] for b in plan]

    results = {}
    vectors = {}
    for name, batches in (("naive", naive_batches), ("dedup", dedup_batches), ("dedup+bucket", bucket_batches)):
        t0 = time.perf_counter()
        out = {}
        for b in batches:
            for t, v in zip(b, emb.encode(b)):
                out[t] = v
        secs = time.perf_counter() - t0
        results[name] = {"secs": secs, "texts": sum(len(b) for b in batches), "batches": len(batches),
                         "padded": padded_tokens(emb, batches)}
        vectors[name] = out

    # same similarities whatever the batching
    ref = vectors["naive"]
    for name in ("dedup", "dedup+bucket"):
        for q in ds.questions:
            a = np.array([ref[text[s]] for s in q.haystack_session_ids]) @ ref[q.question]
            b = np.array([vectors[name][text[s]] for s in q.haystack_session_ids]) @ vectors[name][q.question]
            assert np.allclose(a, b, atol=1e-4), name

    refs = sum(len(q.haystack_session_ids) for q in ds.questions)
    print(f"\nembed benchmark: dataset={args.dataset}, {len(ds.questions)} questions, {refs} session references, "
          f"{len(ds.sessions)} distinct sessions; all-MiniLM-L6-v2 CPU fp32, max_length {spec.max_length}, "
          f"{args.threads} threads\n")
    base = results["naive"]
    print(f"| {'strategy':<13} | {'texts':>6} | {'batches':>7} | {'padded tokens':>13} | {'seconds':>8} | "
          f"{'texts/s':>8} | {'speed-up vs naive':>17} |")
    print(f"|{'-' * 15}|{'-' * 8}|{'-' * 9}|{'-' * 15}|{'-' * 10}|{'-' * 10}|{'-' * 19}|")
    for name, r in results.items():
        print(f"| {name:<13} | {r['texts']:>6} | {r['batches']:>7} | {r['padded']:>13} | {r['secs']:>8.2f} | "
              f"{r['texts'] / r['secs']:>8.1f} | {base['secs'] / r['secs']:>16.2f}x |")
    print("\n(similarities identical across strategies within 1e-4)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
