"""memsifter.models.tiny: random models of a given shape with a tokenizer padded to the model's vocabulary."""

from __future__ import annotations

import json
import os


def test_tokenizer_padded_to_model_vocab_decodes_every_id(tmp_path):
    from transformers import AutoTokenizer

    from memsifter.models.tiny import EXTRA_TOKENS, build_tokenizer

    corpus = ["I moved to Lisbon last spring and adopted a dog named Biscuit."] * 20
    build_tokenizer(str(tmp_path / "tok"), corpus, vocab_size=400, pad_vocab_to=5000)
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    assert 4990 <= len(tok) <= 5000
    # every id a model of that vocabulary can sample decodes (random-weight speed runs)
    assert isinstance(tok.decode(list(range(len(tok)))), str)
    # filler entries are unreachable: encoding real text never yields them
    ids = tok.encode("Biscuit the dog moved to Lisbon. " * 5 + " ÿþ12 \u00ff")
    assert not [t for t in tok.convert_ids_to_tokens(ids) if t.startswith("\u00ff\u00fe")]
    # the tags stay plain added tokens with ids after the padded vocabulary
    assert tok.convert_tokens_to_ids("<ranking>") >= 4990 - len(EXTRA_TOKENS)


def test_random_model_of_a_shape(tmp_path):
    from transformers import AutoModelForCausalLM

    from memsifter.models.tiny import build_random_model

    shape = dict(vocab_size=1024, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, tie_word_embeddings=True)
    d = build_random_model(str(tmp_path / "m"), shape, ["hello world"] * 10, tokenizer_vocab=300, dtype="float32")
    cfg = json.load(open(os.path.join(d, "config.json")))
    assert cfg["num_key_value_heads"] == 2 and cfg["vocab_size"] == 1024 and cfg["intermediate_size"] == 96
    m = AutoModelForCausalLM.from_pretrained(d)
    assert sum(p.numel() for p in m.parameters()) > 0
    assert build_random_model(d, shape) == d  # second call: already there
