"""Unpadded ("packed") forward pass for BERT-family encoders (BERT, RoBERTa, XLM-RoBERTa: bge-m3).

A padded batch of texts whose lengths differ spends compute on pad tokens and, because the
attention mask is not all ones, keeps PyTorch's SDPA off its FlashAttention kernel. Here the
texts of a batch are concatenated into one ``[T, hidden]`` sequence with cumulative offsets
``cu_seqlens``; every linear layer, layer norm and activation runs once over the ``T`` real tokens
and attention runs per text:

- on CUDA in half precision: :func:`torch.nn.attention.varlen.varlen_attn` (FlashAttention's
  variable-length kernel, one launch per layer for the whole batch);
- elsewhere (CPU, float32, or a torch without ``varlen_attn``): scaled-dot-product attention text
  by text (exact, slower; it is what the CPU tests check the packing against).

Weights are the Hugging Face module's own (no copy, except Q/K/V fused into one matrix); outputs
match the padded forward up to floating-point reordering (tests compare both on the real
all-MiniLM-L6-v2 weights). Positions restart at every text, as in the padded forward: BERT counts
from 0, (XLM-)RoBERTa from ``padding_idx + 1``.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.nn.functional as F

SUPPORTED = ("bert", "roberta", "xlm-roberta")


def supports_config(cfg: dict) -> bool:
    """Whether an encoder of this ``config.json`` (as a dict) can run packed."""
    return (cfg.get("model_type") in SUPPORTED
            and (cfg.get("position_embedding_type") or "absolute") == "absolute"
            and not cfg.get("is_decoder", False))


def supports(model: Any) -> bool:
    cfg = getattr(model, "config", None)
    return (cfg is not None and supports_config({k: getattr(cfg, k, None) for k in
                                                 ("model_type", "position_embedding_type", "is_decoder")})
            and hasattr(model, "embeddings") and hasattr(model, "encoder"))


def _varlen_attn():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except Exception:  # noqa: BLE001 - older torch: per-text attention
        return None
    return varlen_attn


class PackedEncoder:
    """Packed forward over a loaded HF encoder (``AutoModel``); ``encode_ids`` returns pooled vectors."""

    def __init__(self, model: Any, pooling: str = "cls", normalize: bool = True, compile: bool = False):
        if not supports(model):
            raise ValueError(f"packed forward supports {SUPPORTED} encoders with absolute positions, "
                             f"not {getattr(getattr(model, 'config', None), 'model_type', type(model).__name__)}")
        if pooling not in ("cls", "mean"):
            raise ValueError(f"pooling must be cls or mean, not {pooling!r}")
        self.model = model
        self.cfg = model.config
        self.pooling = pooling
        self.normalize = normalize
        self.heads = self.cfg.num_attention_heads
        self.head_dim = self.cfg.hidden_size // self.heads
        emb = model.embeddings
        self.roberta = self.cfg.model_type in ("roberta", "xlm-roberta")
        self.pos_offset = (emb.padding_idx + 1) if self.roberta else 0
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        # per layer: every weight the layer needs, Q/K/V fused into one GEMM
        self.layers = []
        with torch.no_grad():
            for layer in model.encoder.layer:
                s = layer.attention.self
                ao, lo = layer.attention.output, layer.output
                self.layers.append((
                    torch.cat([s.query.weight, s.key.weight, s.value.weight], 0).contiguous(),
                    torch.cat([s.query.bias, s.key.bias, s.value.bias], 0).contiguous(),
                    ao.dense.weight, ao.dense.bias, ao.LayerNorm.weight, ao.LayerNorm.bias,
                    layer.intermediate.dense.weight, layer.intermediate.dense.bias,
                    lo.dense.weight, lo.dense.bias, lo.LayerNorm.weight, lo.LayerNorm.bias))
        self.eps = (model.encoder.layer[0].attention.output.LayerNorm.eps,
                    model.encoder.layer[0].output.LayerNorm.eps)
        self.varlen = _varlen_attn() if (self.device.type == "cuda" and self.dtype in (torch.float16, torch.bfloat16)) \
            else None
        self.compiled = False
        self._compile_proven = False
        self._layer = self._layer_impl
        if compile and self.varlen is not None:
            # one graph for every layer (weights are arguments), dynamic in the token count
            self._layer = torch.compile(self._layer_impl, dynamic=True)
            self.compiled = True

    # ------------------------------------------------------------------ pieces
    def _act(self, x: torch.Tensor) -> torch.Tensor:
        act = self.cfg.hidden_act
        if act == "gelu":
            return F.gelu(x)
        if act in ("gelu_new", "gelu_pytorch_tanh"):
            return F.gelu(x, approximate="tanh")
        if act == "relu":
            return F.relu(x)
        from transformers.activations import ACT2FN

        return ACT2FN[act](x)

    def _attend_each(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_list: list[int]) -> torch.Tensor:
        out = torch.empty_like(q)
        for a, b in zip(cu_list[:-1], cu_list[1:]):
            # [L, H, D] -> [H, L, D]
            o = F.scaled_dot_product_attention(q[a:b].transpose(0, 1), k[a:b].transpose(0, 1),
                                               v[a:b].transpose(0, 1))
            out[a:b] = o.transpose(0, 1)
        return out

    def _layer_impl(self, x: torch.Tensor, w: tuple, cu: torch.Tensor, max_len: int,
                    cu_list: list[int] | None) -> torch.Tensor:
        wqkv, bqkv, wo, bo, ln1w, ln1b, wi, bi, wo2, bo2, ln2w, ln2b = w
        t, hid = x.shape
        qkv = F.linear(x, wqkv, bqkv).view(t, 3, self.heads, self.head_dim)
        q, k, v = qkv.unbind(1)
        if self.varlen is not None:
            ctx = self.varlen(q, k, v, cu, cu, max_len, max_len)
        else:
            ctx = self._attend_each(q, k, v, cu_list)
        x = F.layer_norm(F.linear(ctx.reshape(t, hid), wo, bo) + x, (hid,), ln1w, ln1b, self.eps[0])
        h = self._act(F.linear(x, wi, bi))
        return F.layer_norm(F.linear(h, wo2, bo2) + x, (hid,), ln2w, ln2b, self.eps[1])

    def _run_layers(self, x: torch.Tensor, cu: torch.Tensor, max_len: int, cu_list: list[int]) -> torch.Tensor:
        try:
            for w in self.layers:
                x = self._layer(x, w, cu, max_len, None if self.varlen is not None else cu_list)
            self._compile_proven = self.compiled
            return x
        except Exception as e:  # noqa: BLE001 - a compile failure (no C compiler, triton) is not the user's
            # only until a compiled batch has run: later errors (out of memory, a CUDA fault) are real
            if not self.compiled or self._compile_proven or isinstance(e, torch.OutOfMemoryError):
                raise
            # torch.compile builds on first use: where it cannot (no C compiler for triton's launcher,
            # an inductor bug), the same layers run eagerly; nothing was written, so redo the batch
            import logging

            logging.getLogger(__name__).warning("embed: torch.compile of the packed encoder failed (%s: %s); "
                                                "running eagerly", type(e).__name__, str(e).splitlines()[0][:200]
                                                if str(e) else "")
            self._layer = self._layer_impl
            self.compiled = False
            raise _Retry() from e

    # ------------------------------------------------------------------ API
    def encode_ids(self, ids: Sequence[Sequence[int]]) -> torch.Tensor:
        """Pooled (and L2-normalised when asked) vectors, one per token-id list, float32 on the model's device."""
        try:
            return self._encode_ids(ids)
        except _Retry:
            return self._encode_ids(ids)

    @torch.inference_mode()
    def _encode_ids(self, ids: Sequence[Sequence[int]]) -> torch.Tensor:
        if not ids:
            return torch.zeros((0, self.cfg.hidden_size), device=self.device)
        lens = [len(x) for x in ids]
        if min(lens) == 0:
            raise ValueError("packed forward got an empty token list")
        cu_list = [0]
        for n in lens:
            cu_list.append(cu_list[-1] + n)
        dev = self.device
        flat = torch.tensor([t for x in ids for t in x], dtype=torch.long, device=dev)
        cu = torch.tensor(cu_list, dtype=torch.int32, device=dev)
        lens_t = torch.tensor(lens, dtype=torch.long, device=dev)
        starts = torch.repeat_interleave(cu[:-1].long(), lens_t)
        pos = torch.arange(flat.shape[0], device=dev) - starts + self.pos_offset
        emb = self.model.embeddings
        x = emb.word_embeddings(flat) + emb.position_embeddings(pos)
        if getattr(emb, "token_type_embeddings", None) is not None:
            x = x + emb.token_type_embeddings.weight[0]
        x = emb.LayerNorm(x)
        max_len = max(lens)
        x = self._run_layers(x, cu, max_len, cu_list)
        if self.pooling == "cls":
            vec = x[cu[:-1].long()]
        else:
            seg = torch.repeat_interleave(torch.arange(len(lens), device=dev), lens_t)
            vec = torch.zeros((len(lens), x.shape[1]), dtype=torch.float32, device=dev)
            vec.index_add_(0, seg, x.float())
            vec = vec / lens_t.unsqueeze(1).float()
        vec = vec.float()
        return F.normalize(vec, dim=-1) if self.normalize else vec


class _Retry(Exception):
    """The compiled forward failed and was switched off: run the batch again, eagerly."""


def flops_per_text(cfg: Any, n_tokens: int) -> float:
    """Forward FLOPs of one text of ``n_tokens`` through a BERT-family encoder (matmuls only)."""
    h, f, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    linear = 2 * n_tokens * (4 * h * h + 2 * h * f)
    attention = 4 * n_tokens * n_tokens * h  # QK^T and AV
    return float(layers * (linear + attention))
