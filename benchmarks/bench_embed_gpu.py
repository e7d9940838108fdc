"""GPU embedding throughput of the embed stage's Embedder on a bge-m3-shaped encoder.

bge-m3's weights cannot be downloaded here, so the encoder is an XLM-RoBERTa with bge-m3's shape
(24 layers, hidden 1024, 16 heads, FFN 4096, 8194 positions) and random weights, with a BPE
tokenizer trained on the data; throughput depends on the shape and the token counts, not on the
weight values. Data: the synthetic generator with long sessions (LongMemEval-like haystacks where
filler sessions recur across questions).

Strategies x precisions, all measured in this run, ratios against ``naive`` in fp32:

- ``naive``        : per question, the whole haystack + question in haystack order, fixed batches
                     (what the original did: every question re-embeds shared sessions);
- ``dedup``        : each distinct text once, same fixed batches (isolates the dedup gain);
- ``dedup+bucket`` : each distinct text once, length-bucketed batches under a token budget (the stage).

    python benchmarks/bench_embed_gpu.py --questions 64 --sessions 48 --turns 24
    python benchmarks/bench_embed_gpu.py --tiny --device cpu      # smoke run of the script itself
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def build_encoder(out_dir: str, texts: list[str], tiny: bool) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast, XLMRobertaConfig, XLMRobertaModel

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    specials = ["<s>", "<pad>", "</s>", "<unk>"]
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=8000 if not tiny else 500,
                                                        special_tokens=specials, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A </s>",
                                                       special_tokens=[("<s>", 0), ("</s>", 2)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", cls_token="<s>",
                                   sep_token="</s>", pad_token="<pad>", unk_token="<unk>")
    fast.model_max_length = 8192
    fast.save_pretrained(out_dir)
    if tiny:
        cfg = XLMRobertaConfig(vocab_size=len(fast), hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                               intermediate_size=128, max_position_embeddings=8194, pad_token_id=1)
    else:  # bge-m3's encoder shape
        cfg = XLMRobertaConfig(vocab_size=len(fast), hidden_size=1024, num_hidden_layers=24,
                               num_attention_heads=16, intermediate_size=4096, max_position_embeddings=8194,
                               type_vocab_size=1, pad_token_id=1, layer_norm_eps=1e-5)
    XLMRobertaModel(cfg).save_pretrained(out_dir)
    return out_dir


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--questions", type=int, default=64)
    p.add_argument("--sessions", type=int, default=48)
    p.add_argument("--turns", type=int, default=24)
    p.add_argument("--max-length", type=int, default=8192)
    p.add_argument("--naive-batch", type=int, default=8)
    p.add_argument("--tokens-per-batch", type=int, default=65536)
    p.add_argument("--dtypes", default="float32,float16,bfloat16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="2-layer encoder (smoke test on CPU)")
    args = p.parse_args()

    import torch

    from memsifter.models import embedding
    from memsifter.data.synth import SynthConfig, generate
    from memsifter.retrieval.render import render_session

    ds = generate(SynthConfig(output="unused", questions=args.questions, sessions_per_question=args.sessions,
                              turns_per_session=args.turns, seed=0))
    # The generator draws filler from a small pool, so many sessions share their text; a closing
    # turn naming the session keeps every session distinct, so the dedup gain measured here comes
    # only from sessions shared across questions (as LongMemEval's recurring filler sessions).
    text = {sid: render_session(s.turns + [{"role": "user", "content": f"(note {sid})"}])
            for sid, s in ds.sessions.items()}
    tmp = tempfile.mkdtemp(prefix="bge-m3-shape-")
    t0 = time.perf_counter()
    build_encoder(tmp, list(text.values())[:2000], args.tiny)
    build_s = time.perf_counter() - t0

    naive = []
    for q in ds.questions:
        seq = [q.question] + [text[s] for s in q.haystack_session_ids]
        naive += [seq[i:i + args.naive_batch] for i in range(0, len(seq), args.naive_batch)]
    distinct = sorted({embedding.text_hash(t): t for t in list(text.values()) + [q.question for q in ds.questions]}.items())
    dedup = [[t for _, t in distinct[i:i + args.naive_batch]] for i in range(0, len(distinct), args.naive_batch)]
    plan = [[t for _, t in b] for b in embedding.plan_batches(distinct, args.max_length,
                                                               tokens_per_batch=args.tokens_per_batch,
                                                               max_batch_size=256)]
    rows = []
    for dtype in args.dtypes.split(","):
        spec = embedding.ModelSpec.resolve(tmp, pooling="cls", max_length=args.max_length, dtype=dtype)
        emb = embedding.Embedder(spec, device=args.device)
        ntok = lambda b: sum(len(x) for x in emb.tokenizer(b, truncation=True, max_length=args.max_length)["input_ids"])  # noqa: E731
        emb.encode(["warm up"] * 4)
        for name, batches in (("naive", naive), ("dedup", dedup), ("dedup+bucket", plan)):
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            for b in batches:
                emb.encode(b)
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            secs = time.perf_counter() - t0
            peak = torch.cuda.max_memory_allocated() / 2**30 if args.device.startswith("cuda") else float("nan")
            texts = sum(len(b) for b in batches)
            tokens = sum(ntok(b) for b in batches)
            rows.append((dtype, name, texts, tokens, secs, peak))
            print(f"  {dtype:<9} {name:<13} {texts:>6} texts {tokens:>10} tokens {secs:8.2f} s", flush=True)
        del emb
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()

    dev = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu"
    refs = sum(len(q.haystack_session_ids) for q in ds.questions)
    print(f"\nembed GPU benchmark on {dev}: {'tiny' if args.tiny else 'bge-m3-shaped'} encoder (random weights, "
          f"built in {build_s:.0f} s), {len(ds.questions)} questions, {refs} session references, "
          f"{len(ds.sessions)} distinct sessions (each session embedded {refs / len(ds.sessions):.2f}x by naive), "
          f"max_length {args.max_length}\n")
    base = next(r for r in rows if r[0] == "float32" and r[1] == "naive") if any(
        r[0] == "float32" and r[1] == "naive" for r in rows) else rows[0]
    print("| precision | strategy | texts | tokens | seconds | tokens/s | peak GPU GiB | speed-up vs naive fp32 |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for dtype, name, texts, tokens, secs, peak in rows:
        print(f"| {dtype} | {name} | {texts} | {tokens} | {secs:.2f} | {tokens / secs:,.0f} | {peak:.1f} | "
              f"{base[4] / secs:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
