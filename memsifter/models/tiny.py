"""Tiny stand-in models, built locally (no hub access): a 2-layer Qwen3 with its own tokenizer.

Used by the tests and the offline demo, where the real ranker (``zstanjj/MemSifter-4B-Thinking``)
and a real working LLM cannot be downloaded. The weights are random: outputs are well-formed text
from the model's vocabulary, not sensible answers. The tokenizer is a byte-level BPE trained on the
given texts, with Qwen-style chat markers and a ChatML chat template, so vLLM, transformers and
verl load it like any Hugging Face model directory.
"""

from __future__ import annotations

import json
import os
from typing import Iterable

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EXTRA_TOKENS = ["<think>", "</think>", "<ranking>", "</ranking>", "<answer>", "</answer>"]

DEFAULT_CORPUS = [
    "I moved to Lisbon last spring and adopted a dog named Biscuit.",
    "The ranking lists the most relevant sessions first: 3, 0, 7, 1.",
    "<think>The user asked about travel plans.</think><ranking>2, 0, 1</ranking>",
    "<answer>Biscuit</answer> The answer is in session 4.",
    "What did I say about my guitar, my job, my sister and the concert in Paris?",
]


# Qwen3-4B's shape (config.json of Qwen/Qwen3-4B-Thinking-2507), for speed runs with random weights.
QWEN3_4B = dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=262144,
                rope_theta=5000000.0, tie_word_embeddings=True)


def build_tokenizer(out_dir: str, corpus: Iterable[str] = (), vocab_size: int = 512,
                    pad_vocab_to: int | None = None, max_length: int = 32768):
    """A byte-level BPE trained on ``corpus`` with Qwen-style chat markers and a ChatML template.

    ``pad_vocab_to``: fill the BPE vocabulary with never-produced byte-level tokens up to this size,
    so that every id a model of that vocabulary can sample decodes (speed runs with random weights
    and Qwen3's 151,936-row embedding)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    texts = list(corpus) + DEFAULT_CORPUS
    tok.train_from_iterator(texts * 4 if len(texts) < 1000 else texts, trainer=trainer)
    if pad_vocab_to:
        spec = json.loads(tok.to_str())
        vocab = spec["model"]["vocab"]
        # byte-level spellings of the bytes 0xFF 0xFE (never in UTF-8 text) + digits: reachable by no
        # merge, so encoding never produces them; they decode (to U+FFFD)
        target = pad_vocab_to - len(EXTRA_TOKENS) - 1
        i = 0
        while len(vocab) < target:
            vocab.setdefault("\u00ff\u00fe" + str(i), len(vocab))
            i += 1
        tok = Tokenizer.from_str(json.dumps(spec))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token=None, unk_token=None,
                                   additional_special_tokens=["<|im_start|>"])
    # Tag tokens are ordinary added tokens, as in Qwen3: decoding with skip_special_tokens keeps them.
    fast.add_tokens(EXTRA_TOKENS)
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = max_length
    os.makedirs(out_dir, exist_ok=True)
    fast.save_pretrained(out_dir)
    return fast


def build_random_model(out_dir: str, shape: dict, corpus: Iterable[str] = (), tokenizer_vocab: int = 32000,
                       dtype: str = "bfloat16", device: str = "cpu", seed: int = 0) -> str:
    """A randomly initialised Qwen3 causal LM of the given ``shape`` (Qwen3Config fields, e.g.
    :data:`QWEN3_4B`) with a tokenizer trained on ``corpus`` whose vocabulary is padded to the model's;
    for speed runs (speed depends on shape and token counts, not on weight values)."""
    if os.path.exists(os.path.join(out_dir, "config.json")) and \
            os.path.exists(os.path.join(out_dir, "tokenizer.json")):
        return out_dir
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    shape = dict(shape)
    fast = build_tokenizer(out_dir, corpus, vocab_size=tokenizer_vocab, pad_vocab_to=shape["vocab_size"],
                           max_length=shape.get("max_position_embeddings", 32768))
    assert len(fast) <= shape["vocab_size"], (len(fast), shape["vocab_size"])
    torch.manual_seed(seed)
    cfg = Qwen3Config(**shape, bos_token_id=fast.pad_token_id, eos_token_id=fast.convert_tokens_to_ids("<|im_end|>"),
                      pad_token_id=fast.pad_token_id, torch_dtype=dtype)
    with torch.device(device):
        model = Qwen3ForCausalLM(cfg).to(getattr(torch, dtype))
    model.save_pretrained(out_dir, safe_serialization=True)
    _mark(out_dir, cfg, f"Randomly initialised Qwen3 ({sum(p.numel() for p in model.parameters())/1e9:.2f}B "
                        f"parameters) built by memsifter.models.tiny.build_random_model; random weights.\n")
    return out_dir


def _mark(out_dir: str, cfg, text: str) -> None:
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": cfg.eos_token_id, "pad_token_id": cfg.pad_token_id,
                   "do_sample": True, "temperature": 0.6}, f)
    with open(os.path.join(out_dir, "MEMSIFTER_TINY.txt"), "w") as f:
        f.write(text)


def build_tiny_model(out_dir: str, corpus: Iterable[str] = (), vocab_size: int = 512,
                     hidden_size: int = 64, layers: int = 2, heads: int = 2, head_dim: int = 32,
                     max_position_embeddings: int = 32768, seed: int = 0) -> str:
    """Write a tiny Qwen3 causal LM + tokenizer to ``out_dir`` (skips if already there)."""
    if os.path.exists(os.path.join(out_dir, "config.json")) and \
            os.path.exists(os.path.join(out_dir, "tokenizer.json")):
        return out_dir
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    fast = build_tokenizer(out_dir, corpus, vocab_size=vocab_size, max_length=max_position_embeddings)
    torch.manual_seed(seed)
    vocab = len(fast)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=hidden_size, intermediate_size=hidden_size * 2,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                      head_dim=head_dim, max_position_embeddings=max_position_embeddings,
                      tie_word_embeddings=True, bos_token_id=fast.pad_token_id,
                      eos_token_id=fast.convert_tokens_to_ids("<|im_end|>"),
                      pad_token_id=fast.pad_token_id, torch_dtype="float32")
    model = Qwen3ForCausalLM(cfg)
    model.save_pretrained(out_dir, safe_serialization=True)
    _mark(out_dir, cfg, "Untrained tiny stand-in model built by memsifter.models.tiny; random weights.\n")
    return out_dir
