"""The training half end to end on CPU, every hand-off through the storage layer on SeaweedFS:

synth dataset -> prepare-rl -> rewards of sampled responses (verl's dataset class and DAPO reward
manager, configured by the composed train config) -> train --dry-run -> real FSDP checkpoints
uploaded by the train checkpoint sync -> collect -> merge. A real DAPO step needs GPUs.
"""

from __future__ import annotations

import os

import pytest
import torch

from memsifter.store import storage
from memsifter.stage import get_stage
from memsifter.stages import train
from memsifter.stages.prepare_rl import ground_truth

from test_collect import STEPS, expected_weights, fsdp_root  # noqa: F401  (a session fixture, shared)
from test_reward import qwen_like_tokenizer

pytestmark = pytest.mark.slow


def _data_proto(tok, responses: list[str], items: list[dict]):
    from verl import DataProto

    ids = [tok(r, add_special_tokens=False)["input_ids"] for r in responses]
    width = max(len(i) for i in ids) + 1
    resp = torch.full((len(ids), width), tok.pad_token_id)
    mask = torch.zeros((len(ids), 4 + width), dtype=torch.long)
    for j, i in enumerate(ids):
        resp[j, :len(i)] = torch.tensor(i)
        mask[j, :4 + len(i)] = 1
    return DataProto.from_dict(
        tensors={"responses": resp, "prompts": torch.full((len(ids), 4), tok.pad_token_id), "attention_mask": mask},
        non_tensors={"data_source": [it["data_source"] for it in items],
                     "reward_model": [it["reward_model"] for it in items],
                     "extra_info": [it["extra_info"] for it in items]})


def test_training_chain_on_seaweedfs(s3_env, s3_root, tiny_model_dir, fsdp_root, tmp_path):
    from omegaconf import OmegaConf
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from verl.trainer.ppo.reward import load_reward_manager
    from verl.utils.dataset.rl_dataset import RLHFDataset

    # 1. dataset
    ds = storage.join(s3_root, "synth")
    get_stage("synth").run({"output": ds, "questions": 10, "sessions_per_question": 8, "seed": 11})
    # 2. RL data
    rl = storage.join(s3_root, "rl")
    m = get_stage("prepare-rl").run({"output": rl, "datasets": [ds], "tokenizer": tiny_model_dir, "shard_rows": 4,
                                     "recipe": {"train": {"synth": 6}, "test": {"synth": 2}}})
    assert m["stats"]["rows"] == {"train": 6, "test": 2} and len(m["stats"]["files"]["train"]) == 2
    # 3. dry-run train: the composed config verl accepts (and validates), DCG reward for this run
    cfg = train.TrainConfig(output=storage.join(s3_root, "train"), data=rl, model=tiny_model_dir,
                            reward={"mode": "dcg"}, local_dir=str(tmp_path / "pod"))
    composed = OmegaConf.create(train.dry_run(cfg, in_process=True))  # the CLI path is in test_train
    assert composed.reward.custom_reward_function.reward_kwargs.mode == "dcg"
    # 4. rewards of sampled responses, through verl's dataset class and DAPO reward manager
    local_rl = storage.download_dir(rl, str(tmp_path / "rl"))
    tok = AutoTokenizer.from_pretrained(qwen_like_tokenizer(tiny_model_dir, tmp_path / "tok"))
    data = RLHFDataset(data_files=[os.path.join(local_rl, f) for f in m["stats"]["files"]["train"]], tokenizer=tok,
                       config=OmegaConf.create({"prompt_key": "prompt", "max_prompt_length": 135168,
                                                "filter_overlong_prompts_workers": 1,
                                                "cache_dir": str(tmp_path / "verl-cache")}))
    items = [data[i] for i in range(3)]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    torch.manual_seed(0)
    responses, expected = [], []
    for it in items:
        gold, n = ground_truth(it)
        k = min(10, n)
        others = [i for i in range(n) if i not in gold]
        good = gold + others
        bad = others + gold
        # sampled from the (random) tiny model: not a valid ranking
        prompt_ids = tok.apply_chat_template(it["raw_prompt"], add_generation_prompt=True, return_tensors="pt",
                                             return_dict=True)["input_ids"][:, -512:]
        sampled = tok.decode(model.generate(prompt_ids, max_new_tokens=12, do_sample=True)[0, prompt_ids.shape[1]:],
                             skip_special_tokens=True)
        dcg = lambda order: sum(1 / torch.log2(torch.tensor(r + 2.0)).item()  # noqa: E731
                                for r, s in enumerate(order[:k]) if s in gold) / len(gold)
        responses += [f"<think>gold first</think><ranking>{', '.join(map(str, good))}</ranking>",
                      f"gold last</think><ranking>{', '.join(map(str, bad))}</ranking>", sampled]
        expected += [dcg(good), dcg(bad), 0.0]
    manager = load_reward_manager(composed, tok)
    triples = [it for it in items for _ in range(3)]
    proto = _data_proto(tok, responses, triples)
    scores = [manager.loop.run_until_complete(manager.run_single(proto[i:i + 1])) for i in range(len(responses))]
    got = [s["reward_extra_info"]["acc"] for s in scores]
    assert got == pytest.approx(expected)
    assert all(g > b for g, b in zip(got[0::3], got[1::3]))
    # 5. FSDP checkpoints as verl writes them, uploaded by the train stage's checkpoint sync
    ckpt = train.checkpoint_uri(cfg)
    for s in STEPS:
        train.sync_checkpoint(os.path.join(fsdp_root, f"global_step_{s}"), ckpt, s)
    assert train.complete_steps(ckpt) == list(STEPS)
    # 6. collect every complete step
    col = storage.join(s3_root, "collect")
    mc = get_stage("collect").run({"output": col, "checkpoints": cfg.output, "in_process": True})
    assert mc["stats"]["steps"] == list(STEPS)
    # 7. merge them (uniform, float32 accumulation, bf16 out)
    merged = storage.join(s3_root, "merged")
    mm = get_stage("merge").run({"output": merged, "checkpoints": col, "steps": list(STEPS)})
    assert mm["stats"]["dtype"] == "bfloat16"
    local = storage.download_dir(merged, str(tmp_path / "merged"))
    out = AutoModelForCausalLM.from_pretrained(local, dtype=torch.float32)
    exp = [expected_weights(tiny_model_dir, s) for s in STEPS]
    for name, p in out.state_dict().items():
        if name not in exp[0]:
            continue  # tied weights
        ref = sum(e[name].double() for e in exp) / len(exp)
        torch.testing.assert_close(p.double(), ref, rtol=1e-2, atol=1e-3)
    assert out.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, do_sample=False).shape == (1, 5)
