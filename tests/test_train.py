"""train: verl main_ppo overrides, dry run on CPU, checkpoints to S3 and resume from S3."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pyarrow as pa
import pytest
import yaml

from memsifter.store import storage
from memsifter.errors import ConfigError
from memsifter.stage import code_version
from memsifter.stages import train
from memsifter.stages.train import TrainConfig, sync_checkpoint
from memsifter.training import checkpoints, placement, verl_config, verl_settings
from memsifter.training.checkpoints import (COMPLETE_MARKER, TRACKER, S3CheckpointCallback, complete_steps,
                                            missing_files)
from memsifter.training.placement import placement_request
from memsifter.training.verl_config import verl_overrides


def fake_prepare_rl(uri: str) -> str:
    """A published prepare-rl output with the right file names (content is not read by a dry run)."""
    pub = storage.Publication(uri, "prepare-rl", {}, "test", code_version())
    t = pa.table({"data_source": ["memsifter_synth"]})
    pub.write_table("train_00000.parquet", t)
    pub.write_table("train_00001.parquet", t)
    pub.write_table("test.parquet", t)
    pub.publish({"rows": {"train": 2, "test": 1}})
    return uri


def fake_model_dir(root) -> str:
    """A directory that passes the stage's model check (config.json); verl, which would load it, is
    replaced by a stand-in in the tests that use it."""
    d = os.path.join(str(root), "base-model")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        f.write('{"model_type": "qwen3"}')   # the check wants a model type transformers knows
    return d


def test_overrides_carry_every_recipe_setting(tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "very-secret-value")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-secret")
    monkeypatch.setenv("MEMSIFTER_S3_ENDPOINT", "http://s3.local:8333")
    cfg = TrainConfig(output="s3://b/run/train", data=fake_prepare_rl(str(tmp_path / "rl")), nnodes=3,
                      reward={"mode": "task", "base_url": "http://working-llm:8000/v1"})
    ov = dict(o.split("=", 1) for o in verl_overrides(cfg))
    expect = {
        "algorithm.adv_estimator": "'grpo'", "algorithm.use_kl_in_reward": "false",
        "actor_rollout_ref.actor.use_kl_loss": "false",
        "actor_rollout_ref.actor.clip_ratio_low": "0.2", "actor_rollout_ref.actor.clip_ratio_high": "0.28",
        "actor_rollout_ref.actor.clip_ratio_c": "10.0", "actor_rollout_ref.actor.loss_agg_mode": "'token-mean'",
        "algorithm.filter_groups.enable": "true", "algorithm.filter_groups.metric": "'acc'",
        "actor_rollout_ref.actor.entropy_coeff": "0.0",
        "algorithm.filter_groups.max_num_gen_batches": "10", "algorithm.filter_groups.max_inflight_gen_batches": "2",
        "+reward.reward_kwargs.overlong_buffer_cfg.len": "4096", "+reward.reward_kwargs.max_resp_len": "16384",
        "data.max_response_length": "16384", "data.max_prompt_length": "135168",
        "actor_rollout_ref.actor.optim.lr": "1e-06", "actor_rollout_ref.actor.optim.weight_decay": "0.1",
        "actor_rollout_ref.actor.grad_clip": "1.0", "actor_rollout_ref.rollout.n": "6",
        "data.train_batch_size": "16", "data.gen_batch_size": "32",
        "actor_rollout_ref.actor.ulysses_sequence_parallel_size": "2",
        "actor_rollout_ref.actor.fsdp_config.param_offload": "true",
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload": "true",
        "actor_rollout_ref.rollout.name": "'vllm'", "actor_rollout_ref.rollout.mode": "'async'",
        "trainer.n_gpus_per_node": "8", "trainer.nnodes": "3", "trainer.save_freq": "5", "trainer.test_freq": "5",
        "trainer.resume_mode": "'auto'", "reward.reward_manager.name": "'dapo'",
        "reward.custom_reward_function.path": "'pkg://memsifter.training.rewards'",
        "trainer.checkpoint_callback_class": "'memsifter.training.checkpoints.S3CheckpointCallback'",
        "+ray_kwargs.ray_init.runtime_env.env_vars.MEMSIFTER_CHECKPOINT_URI": "'s3://b/run/train/checkpoints'",
        "+reward.custom_reward_function.reward_kwargs.mode": "'task'",
        "data.train_files": "['/tmp/memsifter-train/data/train_00000.parquet',"
                            "'/tmp/memsifter-train/data/train_00001.parquet']",
    }
    for k, v in expect.items():
        assert ov.get(k) == v, k
    assert ov["+ray_kwargs.ray_init.runtime_env.env_vars.MEMSIFTER_S3_ENDPOINT"] == "'http://s3.local:8333'"
    joined = " ".join(verl_overrides(cfg))
    assert "very-secret-value" not in joined and "sk-secret" not in joined  # secrets stay in the pods' env
    with pytest.raises(ConfigError, match=r"verl.data.gen_batch_size \(20\) must be a multiple of "
                                          r"verl.data.train_batch_size \(16\)"):
        TrainConfig(output="x", data=str(tmp_path / "rl"), verl={"data": {"gen_batch_size": 20}})


# verl's command line of the default train config, captured from the code before the `verl:` block
# replaced the `dapo:` settings (issue 31 item 5): the default run's verl command must not change.
DEFAULT_OVERRIDES = [
    "data.train_files=['/tmp/memsifter-train/data/train_00000.parquet']",
    "data.val_files=['/tmp/memsifter-train/data/test.parquet']",
    "data.prompt_key='prompt'",
    "data.reward_fn_key='data_source'",
    "data.max_prompt_length=135168",
    "data.max_response_length=16384",
    "data.train_batch_size=16",
    "data.gen_batch_size=32",
    "data.filter_overlong_prompts=true",
    "data.truncation='error'",
    "data.shuffle=true",
    "data.return_raw_chat=true",
    "algorithm.adv_estimator='grpo'",
    "algorithm.use_kl_in_reward=false",
    "algorithm.kl_ctrl.kl_coef=0.0",
    "algorithm.filter_groups.enable=true",
    "algorithm.filter_groups.metric='acc'",
    "algorithm.filter_groups.max_num_gen_batches=10",
    "algorithm.filter_groups.max_inflight_gen_batches=2",
    "actor_rollout_ref.model.path='Qwen/Qwen3-4B-Thinking-2507'",
    "actor_rollout_ref.model.use_remove_padding=true",
    "actor_rollout_ref.model.enable_gradient_checkpointing=true",
    "actor_rollout_ref.model.lora_rank=0",
    "actor_rollout_ref.model.lora_alpha=32",
    "actor_rollout_ref.model.target_modules='all-linear'",
    "actor_rollout_ref.model.lora_adapter_path=null",
    "actor_rollout_ref.actor.use_kl_loss=false",
    "actor_rollout_ref.actor.kl_loss_coef=0.0",
    "actor_rollout_ref.actor.entropy_coeff=0.0",
    "actor_rollout_ref.actor.clip_ratio_low=0.2",
    "actor_rollout_ref.actor.clip_ratio_high=0.28",
    "actor_rollout_ref.actor.clip_ratio_c=10.0",
    "actor_rollout_ref.actor.loss_agg_mode='token-mean'",
    "actor_rollout_ref.actor.optim.lr=1e-06",
    "actor_rollout_ref.actor.optim.weight_decay=0.1",
    "actor_rollout_ref.actor.optim.lr_warmup_steps=10",
    "actor_rollout_ref.actor.optim.clip_grad=1.0",
    "actor_rollout_ref.actor.grad_clip=1.0",
    "actor_rollout_ref.actor.ppo_mini_batch_size=16",
    "actor_rollout_ref.actor.use_dynamic_bsz=true",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=151552",
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
    "actor_rollout_ref.actor.fsdp_config.param_offload=true",
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true",
    "actor_rollout_ref.ref.fsdp_config.param_offload=true",
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=151552",
    "actor_rollout_ref.rollout.name='vllm'",
    "actor_rollout_ref.rollout.mode='async'",
    "actor_rollout_ref.rollout.n=6",
    "actor_rollout_ref.rollout.temperature=1.0",
    "actor_rollout_ref.rollout.top_p=1.0",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
    "actor_rollout_ref.rollout.gpu_memory_utilization=0.6",
    "actor_rollout_ref.rollout.max_model_len=151552",
    "actor_rollout_ref.rollout.max_num_batched_tokens=151552",
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=151552",
    "actor_rollout_ref.rollout.val_kwargs.do_sample=true",
    "actor_rollout_ref.rollout.val_kwargs.temperature=0.6",
    "actor_rollout_ref.rollout.val_kwargs.top_p=0.95",
    "actor_rollout_ref.rollout.val_kwargs.n=1",
    "reward.reward_manager.name='dapo'",
    "reward.custom_reward_function.path='pkg://memsifter.training.rewards'",
    "reward.custom_reward_function.name='compute_score'",
    "trainer.nnodes=1",
    "trainer.n_gpus_per_node=8",
    "trainer.project_name='memsifter'",
    "trainer.experiment_name='dapo-ranker'",
    "trainer.logger=['console']",
    "trainer.save_freq=5",
    "trainer.test_freq=5",
    "trainer.resume_mode='auto'",
    "trainer.total_epochs=1",
    "trainer.total_training_steps=null",
    "trainer.val_before_train=false",
    "trainer.default_local_dir='/tmp/memsifter-train/checkpoints'",
    "trainer.max_actor_ckpt_to_keep=2",
    "trainer.checkpoint_callback_class='memsifter.training.checkpoints.S3CheckpointCallback'",
    "+reward.reward_kwargs.overlong_buffer_cfg.enable=true",
    "+reward.reward_kwargs.overlong_buffer_cfg.len=4096",
    "+reward.reward_kwargs.overlong_buffer_cfg.penalty_factor=1.0",
    "+reward.reward_kwargs.overlong_buffer_cfg.log=true",
    "+reward.reward_kwargs.max_resp_len=16384",
    "+reward.custom_reward_function.reward_kwargs.mode='dcg'",
    "+reward.custom_reward_function.reward_kwargs.model='gpt-4o-mini'",
    "+reward.custom_reward_function.reward_kwargs.api_key_env='OPENAI_API_KEY'",
    "+reward.custom_reward_function.reward_kwargs.temperature=0.3",
    "+reward.custom_reward_function.reward_kwargs.max_tokens=512",
    "+reward.custom_reward_function.reward_kwargs.concurrency=64",
    "+reward.custom_reward_function.reward_kwargs.max_retries=4",
    "+reward.custom_reward_function.reward_kwargs.top_k=10",
    "+reward.custom_reward_function.reward_kwargs.cache_uri='s3://b/run/train/_work/reward_cache'",
    "+reward.custom_reward_function.reward_kwargs.format='exact'",
    "+ray_kwargs.ray_init.runtime_env.env_vars.MEMSIFTER_CHECKPOINT_URI='s3://b/run/train/checkpoints'",
    "+ray_kwargs.ray_init.runtime_env.env_vars.VERL_USE_EXTERNAL_MODULES='memsifter.training.verl_patches'",
    "+ray_kwargs.ray_init.runtime_env.env_vars.VLLM_USE_FLASHINFER_SAMPLER='0'",
    "++actor_rollout_ref.model.override_config.attn_implementation='flash_attention_2'",
]


def test_default_verl_command_is_unchanged(monkeypatch):
    import importlib.util

    for k in (*verl_config.FORWARD_ENV, "VERL_USE_EXTERNAL_MODULES", "VLLM_USE_FLASHINFER_SAMPLER"):
        monkeypatch.delenv(k, raising=False)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda n, *a: None if n in ("flash_attn", "flashinfer") else real(n, *a))
    cfg = TrainConfig(output="s3://b/run/train", data="s3://b/run/rl")
    got = verl_overrides(cfg, ["/tmp/memsifter-train/data/train_00000.parquet"],
                         ["/tmp/memsifter-train/data/test.parquet"])
    # Hydra applies overrides of distinct keys independently of their order: the same set, each key once
    assert sorted(got) == sorted(DEFAULT_OVERRIDES)
    assert len({o.lstrip("+").split("=", 1)[0] for o in got}) == len(got)


# --------------------------------------------------------------------------- verl's own names
def test_verl_block_merges_over_the_recipe_in_verls_names(tmp_path):
    """A `verl:` block in verl's key names (nested, or dotted keys) is merged over the platform's DAPO recipe
    (memsifter/configs/verl/dapo.yaml); what the platform derives follows the merged values."""
    cfg = TrainConfig(output="s3://b/t", data="s3://b/rl", verl={
        "actor_rollout_ref": {"rollout": {"n": 16, "tensor_model_parallel_size": 1}},
        "data": {"train_batch_size": 32, "gen_batch_size": 96, "max_response_length": 1024},
        "actor_rollout_ref.actor.optim.lr": 5e-6,
        "trainer": {"total_training_steps": 40}})
    ov = dict(o.split("=", 1) for o in verl_overrides(cfg, ["/x/train.parquet"], ["/x/test.parquet"]))
    assert ov["actor_rollout_ref.rollout.n"] == "16" and ov["actor_rollout_ref.rollout.tensor_model_parallel_size"] == "1"
    assert ov["data.train_batch_size"] == "32" and ov["actor_rollout_ref.actor.optim.lr"] == "5e-06"
    assert ov["trainer.total_training_steps"] == "40"
    assert ov["algorithm.filter_groups.max_inflight_gen_batches"] == "3"  # 96 / 32
    assert ov["actor_rollout_ref.rollout.max_model_len"] == str(135168 + 1024)  # prompt + response
    assert ov["+reward.reward_kwargs.max_resp_len"] == "1024"
    assert ov["actor_rollout_ref.actor.clip_ratio_high"] == "0.28"  # the recipe's, untouched
    # a derived value the user sets is theirs
    mine = TrainConfig(output="s3://b/t", data="s3://b/rl",
                       verl={"actor_rollout_ref": {"rollout": {"max_model_len": 4096}}})
    ov = dict(o.split("=", 1) for o in verl_overrides(mine, ["/x/a.parquet"], ["/x/b.parquet"]))
    assert ov["actor_rollout_ref.rollout.max_model_len"] == "4096"
    assert ov["actor_rollout_ref.rollout.max_num_batched_tokens"] == str(135168 + 16384)


def test_every_recipe_key_is_a_key_of_verls_config():
    """The recipe and the names of the former `dapo:` settings point at keys verl's composed config has (or
    the few it reads without declaring), so a verl upgrade that renames one fails here."""
    schema = verl_settings.verl_schema()
    if schema is None:
        pytest.skip("verl is not installed")
    for path, value in verl_settings.leaves(verl_settings.merged()):
        verl_settings.check_key(path, value, f"recipe {path}")
    import yaml as _yaml
    from importlib import resources

    legacy = _yaml.safe_load(resources.files("memsifter").joinpath(*verl_settings.LEGACY).read_text())
    for old, new in legacy.items():
        for path in ([new] if isinstance(new, str) else new if isinstance(new, list) else []):
            verl_settings.check_key(path, None, f"legacy {old}")


def test_a_typo_under_verl_is_one_line_with_a_suggestion(tmp_path):
    if verl_settings.verl_schema() is None:
        pytest.skip("verl is not installed")
    with pytest.raises(ConfigError) as e:
        TrainConfig(output="o", data="d", verl={"actor_rollout_ref": {"rollout": {"tensor_parallel_size": 2}}})
    msg = str(e.value)
    assert msg.startswith("train.verl.actor_rollout_ref.rollout.tensor_parallel_size: ") and "\n" not in msg
    assert "(did you mean 'tensor_model_parallel_size'?)" in msg
    with pytest.raises(ConfigError, match=r"train.verl.actor_rollout_ref.rolout.n: .*did you mean 'rollout'"):
        TrainConfig(output="o", data="d", verl={"actor_rollout_ref.rolout.n": 2})
    with pytest.raises(ConfigError, match=r"train.verl.data.train_batch_size: expected a number"):
        TrainConfig(output="o", data="d", verl={"data": {"train_batch_size": "many"}})
    with pytest.raises(ConfigError, match=r"train.extra_overrides\[1\]: actor_rollout_ref.actor.no_such_knob: "):
        TrainConfig(output="o", data="d", extra_overrides=["trainer.save_freq=2", "actor_rollout_ref.actor.no_such_knob=1"])
    # keys under a mapping verl leaves open (its own empty defaults, reward_kwargs) are verl's to read
    ok = TrainConfig(output="o", data="d", verl={"actor_rollout_ref": {"rollout": {"engine_kwargs": {"vllm": {
        "enable_sleep_mode": True}}}}, "reward": {"reward_kwargs": {"overlong_buffer_cfg": {"len": 512}}}})
    ov = verl_overrides(ok, ["/x/a.parquet"], ["/x/b.parquet"])
    assert "+actor_rollout_ref.rollout.engine_kwargs.vllm.enable_sleep_mode=true" in ov
    assert "+reward.reward_kwargs.overlong_buffer_cfg.len=512" in ov
    # the command line: exit 2, one line, no traceback
    p = subprocess.run([sys.executable, "-m", "memsifter.cli", "run", "train", "--dry-run", "--data", str(tmp_path),
                        "--output", str(tmp_path / "t"), "--set", "verl.actor_rollout_ref.rollout.tensor_parallel_size=1"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert "train.verl.actor_rollout_ref.rollout.tensor_parallel_size: " in p.stderr
    assert "did you mean 'tensor_model_parallel_size'" in p.stderr


def test_keys_the_platform_sets_are_refused_under_verl():
    cases = {"trainer.nnodes": "`nnodes`", "trainer.n_gpus_per_node": "`n_gpus_per_node`",
             "actor_rollout_ref.model.path": "`model`", "data.train_files": "`data`",
             "trainer.default_local_dir": "`local_dir`", "reward.custom_reward_function.path": "`reward`",
             "actor_rollout_ref.model.lora_adapter_path": "`init_adapter`",
             "trainer.checkpoint_callback_class": "`output`", "trainer.logger": "`logger`"}
    for key, field in cases.items():
        with pytest.raises(ConfigError, match=rf"^train.verl.{key}: set by the train config's {field}"):
            TrainConfig(output="o", data="d", verl={key: 1})
    with pytest.raises(ConfigError, match=r"^train.extra_overrides\[0\]: trainer.nnodes: set by the train config's `nnodes`"):
        TrainConfig(output="o", data="d", extra_overrides=["trainer.nnodes=4"])


def test_cross_field_checks_read_the_merged_verl_values():
    def bad(block, match, **kw):
        with pytest.raises((ConfigError, ValueError), match=match):
            TrainConfig(output="o", data="d", verl=block, **kw)

    bad({"data.gen_batch_size": 40}, r"verl.data.gen_batch_size \(40\) must be a multiple of verl.data.train_batch_size \(16\)")
    bad({"data.train_batch_size": 0}, r"verl.data.train_batch_size must be a positive integer")
    bad({"actor_rollout_ref.model.lora_rank": -1}, r"verl.actor_rollout_ref.model.lora_rank must be >= 0")
    bad({"actor_rollout_ref.model.lora_alpha": 0}, r"verl.actor_rollout_ref.model.lora_alpha must be > 0")
    bad({"actor_rollout_ref.actor.entropy_coeff": -0.1}, r"verl.actor_rollout_ref.actor.entropy_coeff must be >= 0")
    bad({"actor_rollout_ref.model.override_config.attn_implementation": "sdpa"},
        r"verl.actor_rollout_ref.actor.ulysses_sequence_parallel_size=2 needs flash_attention_2")
    bad({}, r"init_adapter needs verl.actor_rollout_ref.model.lora_rank > 0", init_adapter="/a")
    # the checks see extra_overrides too
    with pytest.raises(ConfigError, match=r"verl.data.gen_batch_size \(24\) must be a multiple"):
        TrainConfig(output="o", data="d", extra_overrides=["data.gen_batch_size=24"])
    assert TrainConfig(output="o", data="d", init_adapter="/a", verl={"actor_rollout_ref.model.lora_rank": 8})


def test_a_users_verl_override_file_works_as_is(tmp_path):
    """The file a user passes to verl on the command line (one override a line, '+'/'++', comments) goes
    to verl verbatim, after the recipe; what the platform derives and checks sees its values."""
    f = tmp_path / "my.overrides"
    f.write_text("# my verl settings\n\n"
                 "actor_rollout_ref.rollout.n=12  \n"
                 "data.max_response_length=2048\n"
                 "+actor_rollout_ref.rollout.engine_kwargs.vllm.swap_space=4\n"
                 "++reward.reward_kwargs.overlong_buffer_cfg.len=256\n"
                 "  # every 7 steps\ntrainer.save_freq=7\n")
    cfg = TrainConfig(output=str(tmp_path / "t"), data=fake_prepare_rl(str(tmp_path / "rl")),
                      verl_overrides_file=str(f), extra_overrides=["trainer.test_freq=3"],
                      verl={"actor_rollout_ref": {"actor": {"ulysses_sequence_parallel_size": 1}}})
    ovs = verl_overrides(cfg, ["/x/train.parquet"], ["/x/test.parquet"])
    assert ovs[-6:] == ["actor_rollout_ref.rollout.n=12", "data.max_response_length=2048",
                        "+actor_rollout_ref.rollout.engine_kwargs.vllm.swap_space=4",
                        "++reward.reward_kwargs.overlong_buffer_cfg.len=256", "trainer.save_freq=7",
                        "trainer.test_freq=3"]  # the file's lines, then extra_overrides
    keys = [o.lstrip("+").split("=", 1)[0] for o in ovs]
    assert len(keys) == len(set(keys)), "each key once: the recipe's value gives way to the file's"
    ov = dict(o.split("=", 1) for o in ovs)
    assert ov["actor_rollout_ref.rollout.max_model_len"] == str(135168 + 2048)  # derived from the file's value
    assert ov["+reward.reward_kwargs.max_resp_len"] == "2048"
    composed = yaml.safe_load(verl_config.compose(cfg, ovs, in_process=True))
    assert composed["actor_rollout_ref"]["rollout"]["n"] == 12 and composed["trainer"]["save_freq"] == 7
    assert composed["trainer"]["test_freq"] == 3 and composed["data"]["max_response_length"] == 2048
    assert composed["reward"]["reward_kwargs"]["overlong_buffer_cfg"]["len"] == 256
    assert composed["actor_rollout_ref"]["rollout"]["engine_kwargs"]["vllm"]["swap_space"] == 4
    # a bad line names the file and the line
    f.write_text("# ok\ndata.gen_batch_size=30\n")
    with pytest.raises(ConfigError, match=rf"verl.data.gen_batch_size \(30\) must be a multiple"):
        verl_overrides(cfg, ["/x/a.parquet"], ["/x/b.parquet"])
    f.write_text("# ok\ntrainer.nnodes=2\n")
    with pytest.raises(ConfigError, match=rf"^{f}: line 2: trainer.nnodes: set by the train config's `nnodes`"):
        verl_overrides(cfg, ["/x/a.parquet"], ["/x/b.parquet"])
    if verl_settings.verl_schema() is not None:
        f.write_text("actor_rollout_ref.rollout.temprature=0.5\n")
        with pytest.raises(ConfigError, match=rf"^{f}: line 1: actor_rollout_ref.rollout.temprature: .*'temperature'"):
            verl_overrides(cfg, ["/x/a.parquet"], ["/x/b.parquet"])
    f.write_text("trainer.save_freq=1,2\n")
    with pytest.raises(ConfigError, match="a sweep"):
        verl_overrides(cfg, ["/x/a.parquet"], ["/x/b.parquet"])


def test_the_former_dapo_section_is_refused_with_its_replacement():
    with pytest.raises(ConfigError) as e:
        TrainConfig(output="o", data="d", dapo={"rollout_tensor_parallel_size": 1, "lr": 2e-5, "fast_logprobs": False})
    msg = str(e.value)
    assert msg.startswith("train.dapo: ") and "\n" not in msg
    assert "verl: {actor_rollout_ref: {rollout: {tensor_model_parallel_size: 1}, actor: {optim: {lr: 2.0e-05}}}}" in msg
    assert "fast_logprobs: false" in msg
    with pytest.raises(ConfigError, match=r"train.dapo.rollout_tp: no such former setting \(did you mean 'rollout_top_p'"):
        TrainConfig(output="o", data="d", dapo={"rollout_tp": 1})
    block, fields = verl_settings.from_dapo({"use_kl": True, "grad_clip": 0.5})
    assert block == {"algorithm": {"use_kl_in_reward": True}, "actor_rollout_ref": {"actor": {
        "use_kl_loss": True, "optim": {"clip_grad": 0.5}}}} and fields == {}


def test_placement_request_matches_verls_resource_pool():
    req = placement_request(TrainConfig(output="x", data="y", nnodes=2, n_gpus_per_node=8))
    assert req["total_gpus"] == 16 and len(req["placement_groups"]) == 2
    assert req["placement_groups"][0] == {"strategy": "STRICT_PACK", "bundles": [{"CPU": 3, "GPU": 1}] * 8}
    assert req["per_gpu_node"] == {"GPU": 8, "CPU": 24}


def test_dry_run_composes_a_config_verl_accepts(tmp_path):
    """`memsifter run train --dry-run` composes with verl's Hydra (unknown keys fail) and validates."""
    data = fake_prepare_rl(str(tmp_path / "rl"))
    out = str(tmp_path / "train")
    p = subprocess.run([sys.executable, "-m", "memsifter.cli", "run", "train", "--dry-run", "--data", data,
                        "--output", out, "--nnodes", "2", "--set", "reward.mode=dcg",
                        "--set", "model=/models/MemSifter-base", "--local-dir", "/scratch"],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "validate_config] All configuration checks passed" in p.stderr
    cfg = yaml.safe_load(p.stdout)  # stdout is the composed config alone
    a, r = cfg["actor_rollout_ref"]["actor"], cfg["actor_rollout_ref"]["rollout"]
    assert cfg["algorithm"]["adv_estimator"] == "grpo" and cfg["algorithm"]["use_kl_in_reward"] is False
    assert a["use_kl_loss"] is False and (a["clip_ratio_low"], a["clip_ratio_high"], a["clip_ratio_c"]) == (0.2, 0.28, 10.0)
    assert a["loss_agg_mode"] == "token-mean" and a["optim"]["lr"] == 1e-6 and a["optim"]["weight_decay"] == 0.1
    assert a["grad_clip"] == 1.0 and a["ulysses_sequence_parallel_size"] == 2
    assert a["fsdp_config"]["param_offload"] and a["fsdp_config"]["optimizer_offload"]
    assert cfg["actor_rollout_ref"]["ref"]["ulysses_sequence_parallel_size"] == 2  # follows the actor
    fg = cfg["algorithm"]["filter_groups"]
    assert fg["enable"] and fg["metric"] == "acc" and fg["max_num_gen_batches"] == 10
    assert r["name"] == "vllm" and r["mode"] == "async" and r["n"] == 6
    assert cfg["data"]["train_batch_size"] == 16 and cfg["data"]["gen_batch_size"] == 32
    assert cfg["data"]["max_prompt_length"] == 135168 and cfg["data"]["max_response_length"] == 16384
    assert cfg["data"]["train_files"] == ["/scratch/data/train_00000.parquet", "/scratch/data/train_00001.parquet"]
    assert cfg["actor_rollout_ref"]["model"]["path"] == "/models/MemSifter-base"
    rw = cfg["reward"]
    assert rw["reward_manager"]["name"] == "dapo" and rw["custom_reward_function"]["path"] == "pkg://memsifter.training.rewards"
    assert rw["custom_reward_function"]["reward_kwargs"]["mode"] == "dcg"
    assert rw["reward_kwargs"]["overlong_buffer_cfg"] == {"enable": True, "len": 4096, "penalty_factor": 1.0, "log": True}
    t = cfg["trainer"]
    assert (t["nnodes"], t["n_gpus_per_node"], t["save_freq"], t["test_freq"], t["resume_mode"]) == (2, 8, 5, 5, "auto")
    assert t["default_local_dir"] == "/scratch/checkpoints"
    assert t["checkpoint_callback_class"] == "memsifter.training.checkpoints.S3CheckpointCallback"
    assert not os.path.exists(os.path.join(out, "_SUCCESS"))  # a dry run publishes nothing
    # an override of a key verl does not have is refused when the config is read, and by verl's Hydra
    with pytest.raises(ConfigError, match=r"train.extra_overrides\[0\]: actor_rollout_ref.actor.no_such_knob: "
                                          "verl has no key 'no_such_knob' under actor_rollout_ref.actor"):
        TrainConfig(output=out, data=data, extra_overrides=["actor_rollout_ref.actor.no_such_knob=1"])
    good = TrainConfig(output=out, data=data)
    with pytest.raises(ConfigError, match="Could not override 'actor_rollout_ref.actor.no_such_knob'"):
        verl_config.compose(good, [*verl_overrides(good, ["/x/train.parquet"], ["/x/test.parquet"]),
                             "actor_rollout_ref.actor.no_such_knob=1"], in_process=True)


# --------------------------------------------------------------------------- checkpoints
def write_fake_step(root: str, step: int, world_size: int = 2, skip: tuple[str, ...] = ()) -> str:
    """Files named as verl writes them for one save (the content does not matter here)."""
    d = os.path.join(root, f"global_step_{step}")
    names = ["actor/fsdp_config.json", "actor/huggingface/config.json", "actor/huggingface/tokenizer.json", "data.pt"]
    for kind in ("model", "optim", "extra_state"):
        names += [f"actor/{kind}_world_size_{world_size}_rank_{r}.pt" for r in range(world_size)]
    for n in names:
        if n in skip:
            continue
        os.makedirs(os.path.dirname(os.path.join(d, n)), exist_ok=True)
        with open(os.path.join(d, n), "w") as f:
            f.write(json.dumps({"world_size": world_size}) if n.endswith("fsdp_config.json") else f"{n}@{step}")
    return d


def test_missing_files_of_a_checkpoint():
    full = {f"actor/{k}_world_size_2_rank_{r}.pt": 1 for k in ("model", "optim", "extra_state") for r in (0, 1)}
    full.update({"actor/fsdp_config.json": 1, "actor/huggingface/config.json": 1, "data.pt": 1})
    assert missing_files(full) == []
    assert missing_files({k: v for k, v in full.items() if k != "actor/optim_world_size_2_rank_1.pt"}) == \
        ["actor/optim_world_size_2_rank_1.pt"]
    assert missing_files({k: v for k, v in full.items() if "optim" not in k}) == []  # optimizer not saved at all
    assert missing_files({k: v for k, v in full.items() if k != "data.pt"}) == ["data.pt"]
    assert missing_files({"data.pt": 1}) == ["actor/fsdp_config.json"]


def test_the_checkpoint_callback_verl_is_given_loads_by_its_name():
    """verl imports trainer.checkpoint_callback_class by its dotted name in its driver: the name the stage
    writes is the class that uploads and marks the steps (memsifter.training.checkpoints), importable
    without the stage module."""
    import importlib

    cfg = TrainConfig(output="s3://b/t", data="s3://b/rl")
    ov = dict(o.split("=", 1) for o in verl_overrides(cfg, ["/x/train.parquet"], ["/x/test.parquet"]))
    module, _, name = ov["trainer.checkpoint_callback_class"].strip("'").rpartition(".")
    assert getattr(importlib.import_module(module), name) is S3CheckpointCallback
    assert S3CheckpointCallback.__module__ == module == "memsifter.training.checkpoints"


def test_checkpoints_upload_from_every_ray_node_and_resume(s3_env, s3_root, tmp_path, monkeypatch):
    """The callback verl calls after each save: Ray tasks on every node upload, then the step is marked."""
    import ray

    ckpt = storage.join(s3_root, "train", "checkpoints")
    local = str(tmp_path / "node" / "checkpoints")
    write_fake_step(local, 5)
    write_fake_step(local, 10, skip=("actor/model_world_size_2_rank_1.pt",))  # a node's upload is missing
    monkeypatch.setenv(checkpoints.ENV_CHECKPOINT_URI, ckpt)
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    # a real (local, one-node) Ray cluster: the per-node upload and staging run as Ray tasks
    ray.init(address="local", num_cpus=1, include_dashboard=False, runtime_env={"env_vars": s3_env.env()}, log_to_driver=False)
    try:
        cb = S3CheckpointCallback(config=None)
        cb.on_save(trainer=None, global_step=5, checkpoint_dir=os.path.join(local, "global_step_5"))
        with pytest.raises(RuntimeError, match="incomplete: missing.*model_world_size_2_rank_1"):
            cb.on_save(trainer=None, global_step=10, checkpoint_dir=os.path.join(local, "global_step_10"))
        # fresh pods: every node restores the newest complete step and verl's tracker file
        fresh = {"root": str(tmp_path / "fresh"), "data": str(tmp_path / "fresh" / "data"),
                 "model": str(tmp_path / "fresh" / "model"), "checkpoints": str(tmp_path / "fresh" / "ckpt")}
        data = fake_prepare_rl(storage.join(s3_root, "rl"))
        staged = placement.on_every_node(train._stage_node, data, ["train_00000.parquet", "test.parquet"], None,
                                     fresh, ckpt, complete_steps(ckpt)[-1])
    finally:
        ray.shutdown()
    assert storage.exists(storage.join(ckpt, "global_step_5", COMPLETE_MARKER))
    assert not storage.exists(storage.join(ckpt, "global_step_10", COMPLETE_MARKER))
    assert storage.read_text(storage.join(ckpt, TRACKER)) == "5"
    assert complete_steps(ckpt) == [5]
    marker = storage.read_json(storage.join(ckpt, "global_step_5", COMPLETE_MARKER))
    assert len(marker["files"]) == 10 and marker["step"] == 5
    assert [s["restored_step"] for s in staged] == [5]
    assert open(os.path.join(fresh["checkpoints"], TRACKER)).read() == "5"
    assert open(os.path.join(fresh["checkpoints"], "global_step_5", "actor", "model_world_size_2_rank_1.pt")).read() \
        == "actor/model_world_size_2_rank_1.pt@5"
    assert os.path.exists(os.path.join(fresh["data"], "train_00000.parquet"))


def test_train_stage_resumes_from_s3_on_fresh_local_disk(s3_env, s3_root, tmp_path, monkeypatch):
    """The launcher (verl itself replaced by a stand-in that saves like verl does and calls the callback)."""
    data = fake_prepare_rl(storage.join(s3_root, "rl"))
    out = storage.join(s3_root, "train")
    seen = []

    def fake_verl(overrides, sink=None, guard=None):
        ov = dict(o.lstrip("+").split("=", 1) for o in overrides)
        local = ov["trainer.default_local_dir"].strip("'")
        files = [f.strip("'") for f in ov["data.train_files"].strip("[]").split(",")]
        assert all(os.path.exists(f) for f in files), "data staged to local disk before verl starts"
        tracker = os.path.join(local, TRACKER)
        start = int(open(tracker).read()) if os.path.exists(tracker) else 0  # verl's resume_mode=auto
        seen.append(start)
        monkeypatch.setenv(checkpoints.ENV_CHECKPOINT_URI, ov["ray_kwargs.ray_init.runtime_env.env_vars.MEMSIFTER_CHECKPOINT_URI"].strip("'"))
        for step in (start + 5, start + 10):
            d = write_fake_step(local, step)
            with open(tracker, "w") as f:
                f.write(str(step))
            S3CheckpointCallback().on_save(global_step=step, checkpoint_dir=d)

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(train, "_run_verl", fake_verl)
    monkeypatch.setattr(train, "compose", lambda config, overrides=None, timeout=300: "composed: true\n")
    model = fake_model_dir(tmp_path)
    m1 = train.run({"output": out, "data": data, "local_dir": str(tmp_path / "pod1"), "model": model,
                    "n_gpus_per_node": 2})
    assert m1["stats"]["complete_steps"] == [5, 10] and m1["stats"]["resumed_from"] is None
    # a second run on a fresh pod (empty local disk) resumes from step 10 in S3
    m2 = train.run({"output": out, "data": data, "local_dir": str(tmp_path / "pod2"), "experiment_name": "again",
                    "model": model, "n_gpus_per_node": 2},
                   force=True, replace=True)  # another experiment name: another config, so --replace
    assert seen == [0, 10] and m2["stats"]["resumed_from"] == 10
    assert m2["stats"]["complete_steps"] == [5, 10, 15, 20]
    assert json.loads(storage.read_text(storage.join(out, "checkpoints.json")))["steps"] == [5, 10, 15, 20]
    assert "trainer.nnodes=1" in storage.read_text(storage.join(out, "overrides.txt"))
    # the checkpoints were written by 2 GPU processes: a run on 1 GPU is refused before anything starts
    # (verl 0.9.1 would die in a worker, opening model_world_size_1_rank_0.pt)
    with pytest.raises(ConfigError, match=r"written by 2 GPU processes and this run has nnodes x "
                                          r"n_gpus_per_node = 1; .*collect.*merge"):
        train.run({"output": out, "data": data, "local_dir": str(tmp_path / "pod3"), "experiment_name": "one",
                   "model": model, "n_gpus_per_node": 1, "resume_other_size": "refuse"}, force=True, replace=True)
    assert seen == [0, 10], "verl never started"
    assert checkpoints.checkpoint_world_size(storage.join(out, "checkpoints"), 20) == 2


def test_a_run_goes_on_at_another_gpu_count_from_the_checkpoints_weights(tiny_model_dir, tmp_path, monkeypatch,
                                                                         caplog):
    """Issue 43 item 4: real FSDP2 checkpoints written by 2 processes (verl's own checkpoint manager, gloo, CPU),
    resumed on 1 GPU. The stage collects the newest step's weights and starts verl from them without verl's resume,
    for the steps left; the steps and checkpoints it then writes are numbered on from that step, the metrics
    continue, the report says what was not carried (optimizer, data order). verl itself is replaced by a stand-in
    that checks what it is given and saves like verl (no GPU here)."""
    import torch
    from safetensors.torch import load_file
    from test_collect import expected_weights, make_fsdp_checkpoints

    from memsifter.stages import train
    from memsifter.training.checkpoints import ENV_STEP_OFFSET

    fsdp = make_fsdp_checkpoints(tiny_model_dir, str(tmp_path / "fsdp"))
    out, data = str(tmp_path / "train"), fake_prepare_rl(str(tmp_path / "rl"))
    ckpt = storage.join(out, "checkpoints")
    for step in (2, 4):
        sync_checkpoint(os.path.join(fsdp, f"global_step_{step}"), ckpt, step)
    seen = {}

    def fake_verl(overrides, sink=None, guard=None):
        ov = dict(o.lstrip("+").split("=", 1) for o in overrides)
        seen.update(ov)
        local = ov["trainer.default_local_dir"].strip("'")
        assert not os.path.exists(os.path.join(local, TRACKER)), "verl is not told to resume"
        env = "ray_kwargs.ray_init.runtime_env.env_vars."
        monkeypatch.setenv(checkpoints.ENV_CHECKPOINT_URI, ov[env + checkpoints.ENV_CHECKPOINT_URI].strip("'"))
        monkeypatch.setenv(ENV_STEP_OFFSET, ov[env + ENV_STEP_OFFSET].strip("'"))
        for step in (1, 2):   # verl counts from 1 again
            sink.feed(f"(TaskRunner pid=1) step:{step} - critic/score/mean:{0.1 * step}")
            S3CheckpointCallback().on_save(global_step=step, checkpoint_dir=write_fake_step(local, step, world_size=1))

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(train, "_run_verl", fake_verl)
    monkeypatch.setattr(train, "compose", lambda config, overrides=None, timeout=300: "composed: true\n")
    cfg = {"output": out, "data": data, "local_dir": str(tmp_path / "pod"), "model": tiny_model_dir,
           "n_gpus_per_node": 1, "verl": {"trainer": {"total_training_steps": 10}}}
    with pytest.raises(ConfigError, match="written by 2 GPU processes and this run has nnodes x n_gpus_per_node = 1"):
        train.run({**cfg, "resume_other_size": "refuse"})
    caplog.set_level(logging.INFO, logger="memsifter.stages.train")
    m = train.run(cfg)
    assert "going on from step 4's model (written by 2 GPU processes, now 1) for 6 step(s)" in caplog.text
    start = seen["actor_rollout_ref.model.path"].strip("'")
    assert start == storage.join(out, "_work", "resized-from-4", "global_step_4")
    got = load_file(os.path.join(start, "model.safetensors"))
    want = expected_weights(tiny_model_dir, 4)
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want), "step 4's weights"
    assert seen["trainer.resume_mode"] == "'disable'" and seen["trainer.total_training_steps"] == "6"
    rec = m["stats"]["resized"]
    assert rec["from_step"] == 4 and rec["written_by_gpus"] == 2 and rec["gpus"] == 1 and rec["steps_left"] == 6
    assert rec["optimizer"].startswith("fresh") and rec["what"] == "model"
    assert m["stats"]["complete_steps"] == [2, 4, 5, 6] and checkpoints.checkpoint_world_size(ckpt, 6) == 1
    steps = [json.loads(x)["step"] for x in storage.read_text(storage.join(out, "metrics.jsonl")).splitlines()]
    assert steps == [5, 6]
    # the next attempt at this size is an ordinary resume, from step 6
    seen.clear()
    monkeypatch.setattr(train, "_run_verl", lambda overrides, sink=None, guard=None: seen.update(
        dict(o.lstrip("+").split("=", 1) for o in overrides)))
    m2 = train.run({**cfg, "experiment_name": "again"}, force=True, replace=True)
    assert m2["stats"]["resumed_from"] == 6 and "resized" not in m2["stats"]
    assert seen["actor_rollout_ref.model.path"].strip("'") == tiny_model_dir


def test_example_train_config_validates_and_matches_the_defaults():
    from importlib import resources

    from memsifter.stage import load_config_file, validate_config

    data = load_config_file(str(resources.files("memsifter").joinpath("configs", "train_example.yaml")))
    c = validate_config("train", data)
    assert c.nnodes == 2 and c.reward.mode == "task" and c.reward.api_key_env == "WORKING_LLM_API_KEY"
    recipe, shown = verl_settings.merged(), list(verl_settings.leaves(data["verl"]))
    assert shown and all(verl_settings.get(recipe, k) == v for k, v in shown), "the example repeats the recipe's values"
    collect_merge = load_config_file(str(resources.files("memsifter").joinpath("configs",
                                                                              "collect_merge_example.yaml")))
    validate_config("collect", collect_merge["collect"])
    validate_config("merge", collect_merge["merge"])


@pytest.mark.parametrize("name", ["prepare-rl", "train", "collect", "merge"])
def test_cli_help(name, capsys):
    from memsifter.cli import main

    with pytest.raises(SystemExit) as e:
        main(["run", name, "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert f"memsifter run {name}" in text and "--output" in text
    if name == "train":
        assert "--dry-run" in text and "--nnodes" in text


def test_verl_trainer_runtime_imports_are_installed():
    """What verl 0.9.1's trainer imports only when a run starts (not on --cfg job), found missing on
    the GPU run: ``transfer_queue`` (TransferQueue, verl's "verl-core" extra) and ``orjson``."""
    import importlib

    for mod in ("transfer_queue", "orjson", "verl.trainer.main_ppo", "verl.utils.tracking"):
        importlib.import_module(mod)


def test_overrides_turn_off_flashinfer_sampler_when_absent(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.delenv("VLLM_USE_FLASHINFER_SAMPLER", raising=False)
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "flashinfer" else real(n, *a))
    cfg = TrainConfig(output=str(tmp_path / "t"), data=fake_prepare_rl(str(tmp_path / "rl")))
    ov = verl_overrides(cfg)
    assert "+ray_kwargs.ray_init.runtime_env.env_vars.VLLM_USE_FLASHINFER_SAMPLER='0'" in ov


def test_dry_run_never_touches_the_output_store_and_says_what_it_did_not_check(tmp_path):
    """An unreachable S3 endpoint stops neither the composition nor the validation of a dry run."""
    env = {**os.environ, "MEMSIFTER_S3_ENDPOINT": "http://127.0.0.1:9", "AWS_ACCESS_KEY_ID": "x",
           "AWS_SECRET_ACCESS_KEY": "y", "AWS_REGION": "us-east-1"}
    p = subprocess.run([sys.executable, "-m", "memsifter.cli", "run", "train", "--dry-run",
                        "--data", "s3://nowhere/rl", "--output", "s3://nowhere/train", "--set", "reward.mode=dcg",
                        "--local-dir", "/scratch"], capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    cfg = yaml.safe_load(p.stdout)
    assert cfg["data"]["train_files"] == ["/scratch/data/train_00000.parquet"]
    assert "# not checked:" in p.stderr and "data s3://nowhere/rl: not read" in p.stderr
    assert "output s3://nowhere/train: not touched" in p.stderr


def test_inside_an_image_without_flash_attn_the_recipe_is_refused_in_one_line(tmp_path):
    """Issue 43 item 6: where the run's own image runs the dry run (MEMSIFTER_IMAGE, set by images/base), a recipe
    that needs flash-attn (Ulysses > 1, or flash_attention_2 asked for) and an image without it is one line, exit 2,
    before anything runs; outside an image it stays a warning (the pods' image is not this machine)."""
    cfg = tmp_path / "t.yaml"
    cfg.write_text(yaml.safe_dump({"output": str(tmp_path / "out"), "data": "s3://nowhere/rl", "model": "m"}))
    env = {k: v for k, v in os.environ.items() if k != "MEMSIFTER_IMAGE"}
    args = [sys.executable, "-m", "memsifter.cli", "run", "train", "--config", str(cfg), "--dry-run"]
    outside = subprocess.run(args, capture_output=True, text=True, timeout=600, env=env)
    assert outside.returncode == 0, outside.stderr[-2000:]
    assert "needs flash_attention_2: the GPU pods' image must carry flash-attn" in outside.stderr
    inside = subprocess.run(args, capture_output=True, text=True, timeout=600, env={**env, "MEMSIFTER_IMAGE": "1"})
    assert inside.returncode == 2, inside.stderr[-2000:]
    err = [line for line in inside.stderr.splitlines() if line.strip()]
    assert len(err) == 1 and "ulysses_sequence_parallel_size=2 needs flash-attn" in err[0] and "this image" in err[0]
    assert not (tmp_path / "out").exists() and not inside.stdout
    one = subprocess.run([*args, "--set", "verl.actor_rollout_ref.actor.ulysses_sequence_parallel_size=1"],
                         capture_output=True, text=True, timeout=600, env={**env, "MEMSIFTER_IMAGE": "1"})
    assert one.returncode == 0, one.stderr[-2000:]


def test_attention_falls_back_to_sdpa_without_flash_attn(tmp_path, monkeypatch):
    """verl 0.9.1 loads the actor with flash_attention_2 unless told otherwise; without the flash-attn
    package transformers refuses (the first real GPU run stopped there). auto picks SDPA on padded
    batches then, unless Ulysses parallelism (which needs remove-padding) is asked for."""
    import importlib.util


    real = importlib.util.find_spec
    data = fake_prepare_rl(str(tmp_path / "rl"))

    def ov(have: bool, sp: int = 2, attn: str | None = None) -> dict:
        monkeypatch.setattr(importlib.util, "find_spec",
                            lambda n, *a: (real("json") if have else None) if n == "flash_attn" else real(n, *a))
        block = {"actor_rollout_ref": {"actor": {"ulysses_sequence_parallel_size": sp},
                                       **({"model": {"override_config": {"attn_implementation": attn}}} if attn else {})}}
        return dict(o.split("=", 1) for o in verl_overrides(TrainConfig(output=str(tmp_path / "t"), data=data,
                                                                          verl=block)))

    key, rp = "++actor_rollout_ref.model.override_config.attn_implementation", "actor_rollout_ref.model.use_remove_padding"
    o = ov(False, sp=1)
    assert (o[key], o[rp]) == ("'sdpa'", "false")
    o = ov(True, sp=1)
    assert (o[key], o[rp]) == ("'flash_attention_2'", "true")
    o = ov(False)  # the default recipe (Ulysses 2) keeps flash attention: the image must carry it
    assert (o[key], o[rp]) == ("'flash_attention_2'", "true")
    o = ov(True, sp=1, attn="eager")
    assert (o[key], o[rp]) == ("'eager'", "false")
    with pytest.raises(ConfigError, match="verl.actor_rollout_ref.actor.ulysses_sequence_parallel_size=2 needs "
                                          "flash_attention_2"):
        ov(True, attn="sdpa")
    with pytest.raises(ConfigError, match="attn_implementation: expected one of auto, flash_attention_2, "
                                          "flash_attention_4, sdpa, eager"):
        ov(True, sp=1, attn="flash")

    # a user's own override of the key (with '+', as before this setting existed) wins and composes
    from memsifter.stages import train

    cfg = TrainConfig(output=str(tmp_path / "t"), data=data,
                      verl={"actor_rollout_ref": {"actor": {"ulysses_sequence_parallel_size": 1}}},
                      extra_overrides=["+actor_rollout_ref.model.override_config.attn_implementation=eager"])
    ovs = verl_overrides(cfg, ["/x/train.parquet"], ["/x/test.parquet"])
    assert [o for o in ovs if "attn_implementation" in o] == cfg.extra_overrides
    import yaml

    composed = yaml.safe_load(verl_config.compose(cfg, ovs, in_process=True))
    assert composed["actor_rollout_ref"]["model"]["override_config"]["attn_implementation"] == "eager"
    composed = yaml.safe_load(verl_config.compose(cfg.model_copy(update={"extra_overrides": []}),
                                            verl_overrides(cfg.model_copy(update={"extra_overrides": []}),
                                                           ["/x/train.parquet"], ["/x/test.parquet"]),
                                            in_process=True))
    assert composed["actor_rollout_ref"]["model"]["override_config"]["attn_implementation"] in (
        "sdpa", "flash_attention_2")


def _flash(monkeypatch, fa2: bool, fa4: bool) -> None:
    """This interpreter as one with flash-attn 2 (distribution ``flash-attn``) and/or FlashAttention-4
    (``flash-attn-4``, same ``flash_attn`` package) installed: find_spec and importlib.metadata say so; any installed
    distribution stands in for theirs."""
    import importlib.metadata
    import importlib.util

    real_spec, real_dist = importlib.util.find_spec, importlib.metadata.distribution
    have = {"flash-attn": fa2, "flash-attn-4": fa4}

    def distribution(name):
        if name in have:
            if not have[name]:
                raise importlib.metadata.PackageNotFoundError(name)
            return real_dist("pytest")
        return real_dist(name)

    monkeypatch.setattr(importlib.metadata, "distribution", distribution)
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: (real_spec("json") if fa2 or fa4 else None)
                        if n == "flash_attn" else real_spec(n, *a))


def test_attention_takes_flash_attention_4_where_only_flash_attn_4_is_installed(tmp_path, monkeypatch):
    """Issue 43 item 6: FlashAttention-4 (PyPI flash-attn-4, transformers' flash_attention_4) is a varlen attention
    for verl's remove padding and Ulysses; auto takes it where flash-attn 2 is missing, and it composes with
    Ulysses 2. Where both are installed auto keeps flash_attention_2; a bare ``flash_attn`` module (no distribution
    recorded) is flash-attn 2, as before."""
    import yaml

    monkeypatch.delenv("MEMSIFTER_IMAGE", raising=False)
    data = fake_prepare_rl(str(tmp_path / "rl"))
    key, rp = "++actor_rollout_ref.model.override_config.attn_implementation", "actor_rollout_ref.model.use_remove_padding"

    def cfg(sp: int = 2, attn: str | None = None) -> TrainConfig:
        block = {"actor_rollout_ref": {"actor": {"ulysses_sequence_parallel_size": sp},
                                       **({"model": {"override_config": {"attn_implementation": attn}}} if attn else {})}}
        return TrainConfig(output=str(tmp_path / "t"), data=data, verl=block)

    def ov(sp: int = 2, attn: str | None = None) -> dict:
        return dict(o.split("=", 1) for o in verl_overrides(cfg(sp, attn)))

    _flash(monkeypatch, fa2=False, fa4=True)
    assert verl_settings.flash_packages() == {"flash_attention_4"}
    o = ov(sp=1)
    assert (o[key], o[rp]) == ("'flash_attention_4'", "true")
    o = ov()
    assert (o[key], o[rp]) == ("'flash_attention_4'", "true")
    o = ov(attn="flash_attention_4")
    assert (o[key], o[rp]) == ("'flash_attention_4'", "true")
    c = cfg()
    composed = yaml.safe_load(verl_config.compose(c, verl_overrides(c, ["/x/train.parquet"], ["/x/test.parquet"]),
                                                  in_process=True))
    model, actor = composed["actor_rollout_ref"]["model"], composed["actor_rollout_ref"]["actor"]
    assert model["override_config"]["attn_implementation"] == "flash_attention_4"
    assert model["use_remove_padding"] is True and actor["ulysses_sequence_parallel_size"] == 2
    with pytest.raises(ConfigError, match="ulysses_sequence_parallel_size=2 needs flash_attention_2 or "
                                          "flash_attention_4 \\(remove padding\\), not 'sdpa'"):
        ov(attn="sdpa")

    _flash(monkeypatch, fa2=True, fa4=True)
    assert verl_settings.flash_packages() == {"flash_attention_2", "flash_attention_4"}
    assert ov()[key] == "'flash_attention_2'"
    assert ov(sp=1, attn="flash_attention_4")[key] == "'flash_attention_4'"
    _flash(monkeypatch, fa2=False, fa4=False)
    assert verl_settings.flash_packages() == set()
    import importlib.metadata
    import importlib.util

    real_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: real_spec("json") if n == "flash_attn"
                        else real_spec(n, *a))  # flash_attn importable, neither distribution recorded: flash-attn 2
    assert verl_settings.flash_packages() == {"flash_attention_2"}
    assert ov(sp=1)[key] == "'flash_attention_2'"


def test_flash_attention_4_without_flash_attn_4_is_refused_inside_an_image(tmp_path, monkeypatch, caplog):
    """An explicit flash_attention_4 where flash-attn-4 is missing: inside a memsifter image (MEMSIFTER_IMAGE) one
    ConfigError naming the package (flash-attn 2 does not provide it); elsewhere a warning (the pods' image is not
    this machine)."""
    data = fake_prepare_rl(str(tmp_path / "rl"))
    fa4 = {"actor_rollout_ref": {"model": {"override_config": {"attn_implementation": "flash_attention_4"}}}}
    for fa2 in (False, True):
        _flash(monkeypatch, fa2=fa2, fa4=False)
        monkeypatch.setenv("MEMSIFTER_IMAGE", "1")
        with pytest.raises(ConfigError, match=r"attn_implementation=flash_attention_4 needs flash-attn-4 .*this image"):
            TrainConfig(output=str(tmp_path / "t"), data=data, verl=fa4)
        monkeypatch.delenv("MEMSIFTER_IMAGE")
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="memsifter.stages.train"):
            o = dict(x.split("=", 1) for x in verl_overrides(TrainConfig(output=str(tmp_path / "t"), data=data,
                                                                         verl=fa4)))
        assert o["++actor_rollout_ref.model.override_config.attn_implementation"] == "'flash_attention_4'"
        assert "flash-attn-4 is not installed here" in caplog.text
        assert "needs flash_attention_4: the GPU pods' image must carry flash-attn-4" in caplog.text
    # and flash_attention_2 asked for where only flash-attn-4 is installed names flash-attn
    _flash(monkeypatch, fa2=False, fa4=True)
    monkeypatch.setenv("MEMSIFTER_IMAGE", "1")
    fa2 = {"actor_rollout_ref": {"model": {"override_config": {"attn_implementation": "flash_attention_2"}}}}
    with pytest.raises(ConfigError, match=r"needs flash-attn \(flash_attention_2, varlen kernels\).*"
                                          r"flash-attn-4 is installed here"):
        TrainConfig(output=str(tmp_path / "t"), data=data, verl=fa2)


def test_base_model_by_name_resolves_to_the_materialized_directory():
    """`model: smollm2-135m-instruct` (memsifter models) is what verl loads, as a local HF directory."""
    from memsifter.models import registry as models
    from memsifter.errors import ConfigError
    from memsifter.training.verl_config import model_path

    try:
        want = models.resolve("smollm2-135m-instruct")
    except ConfigError as e:
        pytest.skip(str(e))
    cfg = TrainConfig(output="o", data="d", model="smollm2-135m-instruct", reward={"mode": "dcg"})
    assert model_path(cfg) == want and os.path.isfile(os.path.join(want, "config.json"))
    assert model_path(cfg.model_copy(update={"model": "Qwen/Qwen3-4B"})) == "Qwen/Qwen3-4B"


def test_safe_training_defaults(tmp_path, monkeypatch):
    """Issue 19: the default reward makes no LLM calls; a task reward without an endpoint, a logger
    whose package is missing, and a missing API key for a hosted endpoint are one-line errors (exit 2
    in the dry run), never calls to api.openai.com with a placeholder key."""
    import importlib.util

    from memsifter.models.llm import LLMEndpoint

    assert TrainConfig(output="o", data="d").reward.mode == "dcg"
    data = fake_prepare_rl(str(tmp_path / "rl"))
    base = [sys.executable, "-m", "memsifter.cli", "run", "train", "--dry-run", "--data", data,
            "--output", str(tmp_path / "train")]
    p = subprocess.run([*base, "--set", "reward.mode=task"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and "reward.mode 'task' needs reward.base_url" in p.stderr, p.stderr[-2000:]
    assert "Traceback" not in p.stderr
    missing = next(n for n in ("mlflow", "wandb", "swanlab") if importlib.util.find_spec(n) is None)
    p = subprocess.run([*base, "--set", f"logger=[console,{missing}]"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and f"logger '{missing}' needs the Python package" in p.stderr, p.stderr[-2000:]
    assert not os.path.exists(tmp_path / "train")  # the dry run touched nothing
    monkeypatch.delenv("WORKING_KEY", raising=False)
    hosted = LLMEndpoint(base_url="https://llm.example.com/v1", model="m", api_key_env="WORKING_KEY")
    with pytest.raises(ConfigError, match="WORKING_KEY is not set"):
        hosted.api_key()
    monkeypatch.setenv("WORKING_KEY", "k")
    assert hosted.api_key() == "k"
    assert LLMEndpoint(base_url="http://127.0.0.1:8000/v1", api_key_env="WORKING_KEY2").api_key() == "EMPTY"
    assert LLMEndpoint(base_url="https://llm.example.com/v1", api_key_env=None).api_key() == "EMPTY"


def test_training_metrics_replayed_from_a_recorded_verl_log(tmp_path):
    """Issue 19: verl's metric lines (here replayed from the real H100 runs of 2026-11-23: a fresh run
    of 2 steps, then a resumed run's step 3) become metrics.jsonl under the output's _work/ while the run
    goes on, a resumed attempt continues the curves, and the stage publishes metrics.jsonl, a PNG and
    a summary."""
    from memsifter.training import trainmetrics
    from memsifter.stages.train import publish_metrics

    root = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "gpu", "results", "2026-11-23-h100-c")
    first = open(os.path.join(root, "call7-train1.log"), errors="replace").read().splitlines()
    second = open(os.path.join(root, "call8-train2.log"), errors="replace").read().splitlines()
    work = str(tmp_path / "train" / "_work" / "metrics.jsonl")
    sink = trainmetrics.MetricsSink(work, flush_every_s=0)
    got = [r for r in (sink.feed(ln) for ln in first) if r]
    assert [r["step"] for r in got] == [1, 2]
    assert got[0]["critic/score/mean"] == pytest.approx(-0.978515625) and got[1]["timing_s/step"] > 0
    assert [r["step"] for r in trainmetrics.read_jsonl(open(work).read())] == [1, 2]  # saved as it went
    resumed = trainmetrics.MetricsSink(work, flush_every_s=0)  # a restarted pod: the curves continue
    for ln in second:
        resumed.feed(ln)
    resumed.flush()
    assert [r["step"] for r in resumed.sorted()] == [1, 2, 3]
    assert trainmetrics.parse_line("INFO step:7 - no metrics here") is None
    assert trainmetrics.parse_line("\x1b[36m(TaskRunnerV1 pid=1)\x1b[0m step:4 - a/b:1.5 - c:nan - d:x") == \
        {"step": 4, "a/b": 1.5}
    pub = storage.Publication(str(tmp_path / "train"), "train", {}, "h", "test")
    summ = publish_metrics(pub, resumed, "replay")
    pub.publish({"metrics": summ})
    assert summ["steps"] == 3 and summ["critic/score/mean"]["first"] == pytest.approx(-0.9785, abs=1e-4)
    assert "timing_s/step" in summ and "response_length/mean" in summ
    assert storage.read_bytes(str(tmp_path / "train" / "training_curves.png"))[:4] == b"\x89PNG"
    assert len(trainmetrics.read_jsonl(storage.read_text(str(tmp_path / "train" / "metrics.jsonl")))) == 3


def test_overrides_install_fast_logprobs_by_setting(tmp_path, monkeypatch):
    """fast_logprobs (default on) sets VERL_USE_EXTERNAL_MODULES in every Ray worker of the run, so that
    `import verl` installs memsifter.training.verl_patches there (tests/test_verl_patches.py); a user's own modules stay."""
    from memsifter.training import verl_patches

    key = "+ray_kwargs.ray_init.runtime_env.env_vars.VERL_USE_EXTERNAL_MODULES"
    monkeypatch.delenv("VERL_USE_EXTERNAL_MODULES", raising=False)
    data = fake_prepare_rl(str(tmp_path / "rl"))
    on = dict(o.split("=", 1) for o in verl_overrides(TrainConfig(output="s3://b/t", data=data)))
    assert on[key] == f"'{verl_patches.MODULE}'"
    off = dict(o.split("=", 1) for o in verl_overrides(TrainConfig(output="s3://b/t", data=data,
                                                                    fast_logprobs=False)))
    assert key not in off
    monkeypatch.setenv("VERL_USE_EXTERNAL_MODULES", "my_models")
    kept = dict(o.split("=", 1) for o in verl_overrides(TrainConfig(output="s3://b/t", data=data)))
    assert kept[key] == f"'my_models,{verl_patches.MODULE}'"
    assert verl_patches.external_modules(f"a,{verl_patches.MODULE}") == f"a,{verl_patches.MODULE}"


def test_flash_attention_4_installs_verl_patches_even_without_fast_logprobs(tmp_path, monkeypatch):
    """FA4 takes transformers' varlen calls only through verl_patches.install_fa4 (max_seqlen as an int), so a run on
    flash_attention_4 lists the module in every Ray worker whatever fast_logprobs says; with fast_logprobs off the
    log-prob patch is then turned off by MEMSIFTER_FAST_LOGPROBS=0. sdpa without fast_logprobs lists nothing."""
    from memsifter.training import verl_patches

    env = "+ray_kwargs.ray_init.runtime_env.env_vars."
    mods, fast = env + "VERL_USE_EXTERNAL_MODULES", env + verl_patches.FAST_LOGPROBS_ENV
    assert verl_patches.FAST_LOGPROBS_ENV == "MEMSIFTER_FAST_LOGPROBS"
    monkeypatch.delenv("VERL_USE_EXTERNAL_MODULES", raising=False)
    monkeypatch.delenv("MEMSIFTER_IMAGE", raising=False)
    _flash(monkeypatch, fa2=False, fa4=True)
    data = fake_prepare_rl(str(tmp_path / "rl"))

    def ov(attn: str, fast_logprobs: bool) -> dict:
        block = {"actor_rollout_ref": {"actor": {"ulysses_sequence_parallel_size": 1},
                                       "model": {"override_config": {"attn_implementation": attn}}}}
        return dict(o.split("=", 1) for o in verl_overrides(TrainConfig(output="s3://b/t", data=data, verl=block,
                                                                        fast_logprobs=fast_logprobs)))

    off = ov("flash_attention_4", False)
    assert off[mods] == f"'{verl_patches.MODULE}'" and off[fast] == "'0'"
    on = ov("flash_attention_4", True)
    assert on[mods] == f"'{verl_patches.MODULE}'" and fast not in on
    sdpa = ov("sdpa", False)
    assert mods not in sdpa and fast not in sdpa
    assert ov("sdpa", True)[mods] == f"'{verl_patches.MODULE}'"


M10_LOG = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "gpu", "results", "2026-11-24-h100-m10",
                       "logs", "train-dcg.log")


def _recorded_steps() -> list[dict]:
    from memsifter.training import trainmetrics

    lines = open(M10_LOG, errors="replace").read().splitlines()
    return [r for r in map(trainmetrics.parse_line, lines) if r]


def test_collapse_guard_on_the_recorded_collapsing_run():
    """The H100 run of 2026-11-24 (machine 10; LoRA lr 2e-4, 16 prompts x 8 samples, gen batch 32)
    collapsed: verl's V1 trainer ignores max_num_gen_batches, and the 8th step's dynamic sampling went
    through 3,561 discarded groups (306 s). The guard stops at the first step over 10 x 32 prompts."""
    recs = _recorded_steps()
    assert [r["step"] for r in recs] == list(range(0, 9))  # step 0: validation before training
    d = verl_settings.merged({"actor_rollout_ref.rollout.n": 8, "data": {"train_batch_size": 16, "gen_batch_size": 32}})
    check = train.collapse_guard(d)
    verdicts = [check(r) for r in recs]
    assert verdicts[:6] == [None] * 6  # 2 … 192 discarded groups: under 320 - 16
    assert verdicts[6] and verdicts[6].startswith("step 6: dynamic sampling discarded 501 prompt groups")
    assert "10 x 32 = 320" in verdicts[6] and "actor/entropy 0.056" in verdicts[6]
    # the bound follows the settings; 0 or no dynamic sampling turns it off
    def with_(**fg):
        return verl_settings.merged({"actor_rollout_ref.rollout.n": 8, "algorithm": {"filter_groups": fg}})

    assert train.collapse_guard(with_(max_num_gen_batches=200))(recs[-1]) is None
    assert train.collapse_guard(with_(max_num_gen_batches=2))(recs[4])  # 55 + 16 > 64
    assert train.collapse_guard(with_(max_num_gen_batches=0)) is None
    assert train.collapse_guard(with_(enable=False)) is None
    assert "set verl.algorithm.filter_groups.max_num_gen_batches=0 (no limit)" in verdicts[6]
    from memsifter.training import trainmetrics  # the curves show it: entropy and discarded groups are panels

    summ = trainmetrics.summary(recs)
    assert summ["training/filter_groups/evicted_samples"]["last"] == 3561.0
    assert summ["actor/entropy"]["first"] > 4 * summ["actor/entropy"]["last"]
    with pytest.raises(ConfigError, match="verl.algorithm.filter_groups.max_num_gen_batches must be >= 0"):
        TrainConfig(output="o", data="d", verl={"algorithm.filter_groups.max_num_gen_batches": -1})


def test_run_verl_stops_a_collapsing_child_and_keeps_its_metrics(tmp_path):
    """A real child process replays the recorded run's output line by line and would then hang: the
    guard stops it with SIGINT after step 6's line (the child's handler prints and exits 130, as a
    Python driver interrupted by Ctrl-C does), the metrics of steps 1-6 are kept, and the reason is
    returned instead of an error for the non-zero exit."""
    from memsifter.training import trainmetrics

    lines = [ln for ln in open(M10_LOG, errors="replace").read().splitlines() if trainmetrics.parse_line(ln)]
    feed = tmp_path / "lines.txt"
    feed.write_text("\n".join(lines) + "\n")
    script = ("import signal,sys,time\n"
              "def bye(*a):\n    print('interrupted: shutting down ray'); sys.stdout.flush(); sys.exit(130)\n"
              "signal.signal(signal.SIGINT, bye)\n"
              f"for ln in open({str(feed)!r}):\n    print(ln, end=''); sys.stdout.flush(); time.sleep(0.05)\n"
              "time.sleep(30)\n")
    sink = trainmetrics.MetricsSink(str(tmp_path / "metrics.jsonl"), flush_every_s=0)
    d = verl_settings.merged({"actor_rollout_ref": {"rollout": {"n": 8}}})
    import time as _t

    t0 = _t.time()
    reason = train._run_verl([], sink, train.collapse_guard(d), cmd=[sys.executable, "-c", script])
    assert _t.time() - t0 < 25, "stopped by SIGINT, not by the 30 s sleep or the kill timer"
    assert reason and reason.startswith("step 6:")
    assert [r["step"] for r in sink.sorted()] == [0, 1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in trainmetrics.read_jsonl((tmp_path / "metrics.jsonl").read_text())] == list(range(7))
    # without a guard the same child's failure is an error, as before
    with pytest.raises(RuntimeError, match="exited with status 3"):
        train._run_verl([], None, None, cmd=[sys.executable, "-c", "import sys; print('step:1 - a:1'); sys.exit(3)"])


def test_train_stage_reports_a_collapse_stop_and_publishes(s3_env, s3_root, tmp_path, monkeypatch):
    """The stage publishes after a guard stop (the checkpoints so far are the run's result) and says
    why and where it stopped in the report. verl is replaced by a stand-in (no GPU here) that saves a
    step like verl, then feeds the recorded run's metric lines through the stage's guard."""
    data = fake_prepare_rl(storage.join(s3_root, "rl"))
    out = storage.join(s3_root, "train-stopped")

    def fake_verl(overrides, sink=None, guard=None):
        ov = dict(o.lstrip("+").split("=", 1) for o in overrides)
        local = ov["trainer.default_local_dir"].strip("'")
        monkeypatch.setenv(checkpoints.ENV_CHECKPOINT_URI,
                           ov["ray_kwargs.ray_init.runtime_env.env_vars.MEMSIFTER_CHECKPOINT_URI"].strip("'"))
        d = write_fake_step(local, 4)
        S3CheckpointCallback().on_save(global_step=4, checkpoint_dir=d)
        for rec in _recorded_steps():
            sink.feed("step:%d - %s" % (rec["step"], " - ".join(f"{k}:{v}" for k, v in rec.items() if k != "step")))
            if (why := guard(rec)):
                return why
        return None

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(train, "_run_verl", fake_verl)
    monkeypatch.setattr(train, "compose", lambda config, overrides=None, timeout=300: "composed: true\n")
    model = fake_model_dir(tmp_path)
    m = train.run({"output": out, "data": data, "local_dir": str(tmp_path / "pod"), "model": model,
                   "verl": {"actor_rollout_ref": {"rollout": {"n": 8}},
                            "data": {"train_batch_size": 16, "gen_batch_size": 32}}})
    # the base is recorded beside the checkpoints before verl starts: collect finds it for a run that is
    # stopped before it publishes (a GRPO run at its deadline), where no train manifest names the model
    from memsifter.stages.collect import base_model_of
    record = json.loads(storage.read_bytes(storage.join(m["stats"]["checkpoint_uri"], checkpoints.BASE_RECORD)))
    assert record["model"] == model
    assert base_model_of(m["stats"]["checkpoint_uri"], 4, None) == model
    stop = m["stats"]["stopped_early"]
    assert stop["reason"].startswith("step 6:") and stop["last_complete_step"] == 4
    assert m["stats"]["complete_steps"] == [4] and m["stats"]["metrics"]["steps"] == 7  # with step 0
    assert storage.exists(storage.join(out, "_SUCCESS"))


def test_entropy_memory_benchmark_runs_on_the_cpu():
    """``benchmarks/gpu/entropy_memory.py`` (machine 12: an entropy bonus adds 33% to the peak memory of a
    32k-token micro-batch, and verl's entropy checkpointing does not lower that peak) runs here on a tiny
    model: three rows, and the entropy in the loss keeps the most for the backward pass."""
    import importlib.util
    import json as _json

    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "gpu", "entropy_memory.py")
    spec = importlib.util.spec_from_file_location("entropy_memory", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"entropy-memory-{os.getpid()}.json")
    assert mod.main(["--device", "cpu", "--tiny", "--repeats", "1", "--json", out]) == 0
    rows = {r["mode"]: r for r in _json.load(open(out))["rows"]}
    os.remove(out)
    assert set(rows) == {"none", "plain", "ckpt"}
    assert rows["plain"]["saved_bytes"] > rows["ckpt"]["saved_bytes"] > 0
    assert rows["plain"]["saved_bytes"] > rows["none"]["saved_bytes"] > 0


def test_agent_loops_on_off_as_yaml_reads_them(tmp_path):
    """``--set agent.loops=on`` reaches the config as YAML's true: taken as "on" (and false as "off"), while a
    wrong word still fails naming the field."""
    base = {"output": str(tmp_path / "o"), "data": str(tmp_path / "d")}
    assert TrainConfig(**base, agent={"loops": True}).agent.loops == "on"
    assert TrainConfig(**base, agent={"loops": False}).agent.loops == "off"
    assert TrainConfig(**base, agent={"loops": "auto"}).agent.loops == "auto"
    with pytest.raises(ValueError, match="loops"):
        TrainConfig(**base, agent={"loops": "sometimes"})
