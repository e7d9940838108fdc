"""Stage ``train``: DAPO training of the ranker with verl ``main_ppo`` (MEMSIFTER.md §6).

A pydantic config (:class:`TrainConfig`) becomes a list of Hydra overrides for
``python -m verl.trainer.main_ppo`` (:func:`verl_overrides`); every DAPO setting of §6 is a field of
:class:`DapoSettings` with the paper's value as its default.

What the launcher does, in order:

1. Waits until ``nnodes`` GPU nodes have joined the Ray cluster (when ``RAY_ADDRESS`` is set), then on
   *every* node: stages the prepare-rl parquet files (and an ``s3://`` model) from the storage layer to
   local disk under ``local_dir`` (verl reads local files only), and restores the newest *complete*
   checkpoint from ``<output>/checkpoints/`` into ``<local_dir>/checkpoints/`` with verl's tracker
   file, so ``trainer.resume_mode=auto`` resumes from it on fresh pods. Each node downloads the whole
   step directory (all ranks' shards): which ranks land on which node is decided by verl later.
2. Runs verl in a subprocess. ``trainer.checkpoint_callback_class`` points at
   :class:`S3CheckpointCallback`: after every save the callback runs an upload task on every alive
   node (each node uploads the files it wrote under ``global_step_N/``), then checks that the step is
   complete in S3 (every rank's model shard, plus optimizer/extra shards when saved, ``fsdp_config.json``,
   ``huggingface/``, ``data.pt``) and only then writes ``global_step_N/_COMPLETE.json`` and
   ``latest_checkpointed_iteration.txt``. Resume reads only steps with that marker.
3. Publishes ``verl_config.yaml`` (the composed config), ``overrides.txt`` and ``checkpoints.json``.
   The checkpoints themselves stay at ``<output>/checkpoints/global_step_N/actor/…`` (verl's layout);
   ``collect`` reads them from there.

``memsifter run train --dry-run`` prints the fully composed verl config (what
``python -m verl.trainer.main_ppo --cfg job --resolve …`` prints, composed in-process with Hydra's
compose API), checks it with verl's own ``validate_config``, and exits without starting or publishing
anything, and without any object-store call (an ``s3://`` prepare-rl output is not read: its usual
file names stand in). Hydra refuses an override of
a key that does not exist, so a dry run proves every key; the few keys added with ``+`` are ones verl
reads but does not declare (DAPO's ``reward.reward_kwargs``, ``custom_reward_function.reward_kwargs``
and the Ray job's ``runtime_env.env_vars``).

Notes on verl 0.9.1 (V1 trainer): dynamic sampling is ``algorithm.filter_groups`` with the reward
function's ``acc`` metric; the V1 replay buffer bounds over-generation with
``max_inflight_gen_batches`` (= gen batch / train batch = 32/16 = 2) and logs that it ignores
``max_num_gen_batches``; the stage enforces that bound itself (:func:`collapse_guard`: training stops
after a step that needed more prompts, checkpoints kept, ``stopped_early`` in the report). The overlong penalty is
``reward.reward_kwargs.overlong_buffer_cfg`` read by the ``dapo`` reward manager.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .. import storage
from ..checkpoints import CHECKPOINTS, COMPLETE_MARKER, TRACKER, complete_steps
from ..errors import ConfigError, InputError
from ..reward_settings import RewardSettings
from ..stage import StageConfig, runtime_field, stage, uri_field
from ..vllm_env import engine_env

log = logging.getLogger(__name__)

ENV_CHECKPOINT_URI = "MEMSIFTER_CHECKPOINT_URI"
# Non-secret settings forwarded to verl's Ray actors (credentials stay in the pods' environment).
FORWARD_ENV = ("MEMSIFTER_S3_ENDPOINT", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_REGION",
               "AWS_DEFAULT_REGION", "HF_HUB_OFFLINE")


class DapoSettings(BaseModel):
    """Every DAPO setting of MEMSIFTER.md §6 (defaults = the original run)."""

    model_config = ConfigDict(extra="forbid")

    adv_estimator: str = "grpo"
    use_kl: bool = Field(False, description="KL loss / KL in reward (DAPO: none)")
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.28
    clip_ratio_c: float = 10.0
    loss_agg_mode: str = "token-mean"
    filter_groups: bool = Field(True, description="dynamic sampling: drop groups with zero score variance")
    filter_metric: str = "acc"
    max_num_gen_batches: int = Field(10, ge=0, description=(
        "collapse guard: a step whose dynamic sampling went through more prompts than max_num_gen_batches x "
        "gen_batch_size (discarded zero-variance groups + train_batch_size) stops training there, keeping "
        "every checkpoint: the policy's samples agree on almost every prompt, and each further step costs "
        "more generation for no gradient. verl 0.9.1's V1 trainer ignores this setting, so the stage enforces "
        "it from verl's per-step metrics; 0: no limit"))
    overlong_buffer: bool = True
    overlong_buffer_len: int = 4096
    overlong_penalty_factor: float = 1.0
    max_response_length: int = 16384
    max_prompt_length: int = 135168
    lr: float = 1e-6
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    lr_warmup_steps: int = 10
    rollout_n: int = Field(6, description="rollouts per prompt")
    train_batch_size: int = Field(16, description="prompts per step")
    gen_batch_size: int = Field(32, description="prompts per generation batch")
    ppo_mini_batch_size: int = 16
    ulysses_sequence_parallel_size: int = 2
    param_offload: bool = True
    optimizer_offload: bool = True
    gradient_checkpointing: bool = True
    lora_rank: int = Field(0, ge=0, description="LoRA rank of the actor (0: full fine-tuning, MemSifter's run); "
                           "the trained ranker is then an adapter, exported by collect")
    lora_alpha: int = Field(32, gt=0, description="LoRA scaling numerator (alpha / rank scales the update)")
    lora_target_modules: str | list[str] = Field("all-linear", description="modules given LoRA adapters")
    entropy_coeff: float = Field(0.0, ge=0, description="entropy bonus of the actor loss (DAPO: 0)")
    attn_implementation: Literal["auto", "flash_attention_2", "sdpa", "eager"] = Field(
        "auto", description="actor/ref attention (auto: flash_attention_2 where the flash-attn package is "
        "installed, else sdpa with padded batches; verl's default, flash_attention_2, fails to load without it)")
    fast_logprobs: bool = Field(True, description="compute the actor's token log-probs in blocks instead of "
                                "verl's row-by-row fallback (used without flash-attn; memsifter.verl_patches)")
    rollout_name: str = "vllm"
    rollout_mode: str = "async"
    rollout_temperature: float = 1.0
    rollout_top_p: float = 1.0
    rollout_tensor_parallel_size: int = 2
    rollout_gpu_memory_utilization: float = 0.6
    val_temperature: float = 0.6
    val_top_p: float = 0.95
    save_freq: int = 5
    test_freq: int = 5
    resume_mode: str = "auto"
    total_epochs: int = 1
    total_training_steps: int | None = None
    val_before_train: bool = False


class TrainConfig(StageConfig):
    model: str = Field("Qwen/Qwen3-4B-Thinking-2507", description="base model: hub id, local dir, s3:// URI or a name of `memsifter models list`")
    data: str = uri_field("prepare-rl output (train_*.parquet + test.parquet)", stage="prepare-rl")
    init_adapter: str | None = uri_field("a LoRA adapter to start from (the sft stage's output, its adapter/ "
                                         "directory is used); needs dapo.lora_rank > 0", None,
                                         stage=("sft", "collect"), wire="none")
    nnodes: int = Field(1, ge=1, description="GPU nodes (trainer.nnodes)")
    n_gpus_per_node: int = Field(8, ge=1, description="GPUs per node (trainer.n_gpus_per_node)")
    project_name: str = "memsifter"
    experiment_name: str = "dapo-ranker"
    dapo: DapoSettings = Field(default_factory=DapoSettings)
    reward: RewardSettings = Field(default_factory=RewardSettings)
    logger: list[str] = Field(default_factory=lambda: ["console"], description="trainer.logger backends")
    keep_local_checkpoints: int = Field(2, ge=1, description="checkpoints kept on local disk "
                                        "(trainer.max_actor_ckpt_to_keep); S3 keeps every one")
    extra_overrides: list[str] = Field(default_factory=list,
                                       description="more Hydra overrides for verl main_ppo (appended last)")
    local_dir: str = runtime_field("/tmp/memsifter-train", "local scratch on every node (data, model, checkpoints)")
    dry_run: bool = runtime_field(False, "print the composed verl config and exit; start and publish nothing")
    node_wait_s: float = runtime_field(600.0, "how long to wait for nnodes GPU nodes to join the Ray cluster")

    @model_validator(mode="after")
    def _safe_reward(self) -> "TrainConfig":
        # A task reward calls the working LLM for every rollout: without an explicit endpoint the calls
        # would go to $OPENAI_BASE_URL or api.openai.com. Say so before anything starts.
        if self.reward.mode == "task" and not self.reward.base_url:
            raise ValueError("reward.mode 'task' needs reward.base_url (the working LLM's OpenAI-compatible "
                             "URL) and reward.model; or use reward.mode 'dcg' (no LLM calls)")
        if self.init_adapter and self.dapo.lora_rank <= 0:
            raise ValueError("init_adapter needs dapo.lora_rank > 0 (the adapter is trained further as LoRA)")
        return self

    def preflight(self) -> None:
        """What a run (not a dry run) refuses before it touches anything: a logger whose package is
        missing, and, when verl will start its own Ray here (no ``RAY_ADDRESS``) and load the model on
        this machine, a base model reference it could not load (one line instead of verl's traceback; on
        a cluster the GPU nodes load it from their own disks and caches, which this driver cannot see)."""
        check_loggers(self)
        if not os.environ.get("RAY_ADDRESS") and not storage.is_s3(self.model):
            from ..embedding import check_model_ref

            check_model_ref(self.model, "train", adapters=True)


LOGGER_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow", "swanlab": "swanlab",
                   "vemlp_wandb": "wandb", "clearml": "clearml", "trackio": "trackio"}


def check_loggers(config: "TrainConfig") -> None:
    """verl's tracking backends import their package at start: one that is not installed here (the
    image the stage runs in) is refused now, naming the logger and the package."""
    import importlib.util

    for name in config.logger:
        pkg = LOGGER_PACKAGES.get(name)
        if pkg and importlib.util.find_spec(pkg) is None:
            raise ConfigError(f"train: logger '{name}' needs the Python package {pkg}, which is not installed "
                              "in this environment (the stage's image); install it or drop the logger")


# --------------------------------------------------------------------------- overrides
def _q(v: Any) -> str:
    """A Hydra override value."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(_q(x) for x in v) + "]"
    s = str(v).replace("\\", "\\\\").replace("'", "\\'")
    return f"'{s}'"


def local_paths(config: TrainConfig) -> dict[str, str]:
    root = config.local_dir.rstrip("/")
    return {"root": root, "data": f"{root}/data", "model": f"{root}/model", "checkpoints": f"{root}/{CHECKPOINTS}",
            "adapter": f"{root}/init_adapter"}


def adapter_local(config: TrainConfig) -> str | None:
    """Where verl reads ``init_adapter`` from: the staged copy of an ``s3://`` adapter, else the local
    adapter directory itself (unreadable now, e.g. in a dry run: the staged location)."""
    if not config.init_adapter:
        return None
    if storage.is_s3(config.init_adapter):
        return local_paths(config)["adapter"]
    try:
        return storage.resolve(adapter_source(config.init_adapter))[1]
    except Exception:  # noqa: BLE001 - composing without the input at hand
        return local_paths(config)["adapter"]


def adapter_source(uri: str) -> str:
    """The adapter directory of ``init_adapter``: an sft output holds it under ``adapter/``; a plain
    adapter directory (adapter_config.json at its top) is used as it is."""
    if storage.exists(storage.join(uri, "adapter", "adapter_config.json")):
        return storage.join(uri, "adapter")
    if storage.exists(storage.join(uri, "adapter_config.json")):
        return uri
    raise InputError("no LoRA adapter here (expected adapter/adapter_config.json of an sft output, or "
                     "adapter_config.json)", file=uri, field="init_adapter")


def data_files(config: TrainConfig) -> tuple[list[str], list[str]]:
    """Relative names of the train shards and the test file of the prepare-rl output."""
    manifest = storage.read_manifest(config.data)
    files = sorted(manifest.get("files", {}))
    train = [f for f in files if re.fullmatch(r"train_\d+\.parquet", f)]
    test = [f for f in files if f == "test.parquet"]
    if not train:
        raise InputError("no train_*.parquet files (is this a prepare-rl output?)", file=config.data)
    if not test:
        raise InputError("no test.parquet file (is this a prepare-rl output?)", file=config.data)
    return train, test


def checkpoint_uri(config: TrainConfig) -> str:
    return storage.join(config.output, CHECKPOINTS)


def model_path(config: TrainConfig) -> str:
    """Where verl loads the base model: the staged copy of an ``s3://`` model, the local directory of a
    ``memsifter models`` name (e.g. smollm2-135m-instruct, materialized on first use), else as given."""
    if storage.is_s3(config.model):
        return local_paths(config)["model"]
    from .. import models

    return models.resolve(config.model) if models.lookup(config.model) else config.model


def reward_kwargs(config: TrainConfig) -> dict:
    r = config.reward.model_dump()
    if not r.get("cache_uri"):
        r["cache_uri"] = storage.join(config.output, storage.WORK, "reward_cache")
    return {k: v for k, v in r.items() if v is not None}


def attention(d: DapoSettings) -> tuple[str, bool]:
    """(attn_implementation, use_remove_padding) for the FSDP actor and ref.

    verl 0.9.1 loads the model with ``flash_attention_2`` unless ``model.override_config`` says
    otherwise, and transformers refuses that without the ``flash-attn`` package (seen on the first
    real run, an H100 without it). Remove-padding packs a micro-batch into one sequence, which we only
    trust to flash attention's varlen kernels; without them the actor runs SDPA on padded batches
    (slower, same result). Ulysses sequence parallelism needs remove-padding, so ``auto`` keeps flash
    attention when it is asked for (the pods' image must then carry flash-attn).
    """
    import importlib.util

    impl = d.attn_implementation
    if impl == "auto":
        have = importlib.util.find_spec("flash_attn") is not None
        impl = "flash_attention_2" if have or d.ulysses_sequence_parallel_size > 1 else "sdpa"
        if not have and impl == "flash_attention_2":
            log.warning("train: flash-attn is not installed here, but dapo.ulysses_sequence_parallel_size=%d "
                        "needs flash_attention_2: the GPU pods' image must carry flash-attn (or set "
                        "dapo.ulysses_sequence_parallel_size=1 for SDPA)", d.ulysses_sequence_parallel_size)
    if impl != "flash_attention_2" and d.ulysses_sequence_parallel_size > 1:
        raise ConfigError(f"dapo.ulysses_sequence_parallel_size={d.ulysses_sequence_parallel_size} needs "
                          f"flash_attention_2 (remove padding), not {impl!r}")
    return impl, impl == "flash_attention_2"


def verl_overrides(config: TrainConfig, train_files: list[str] | None = None,
                   val_files: list[str] | None = None) -> list[str]:
    """The Hydra overrides for ``verl.trainer.main_ppo`` (MEMSIFTER.md §6)."""
    d = config.dapo
    p = local_paths(config)
    if train_files is None or val_files is None:
        tr, te = data_files(config)
        train_files = [f"{p['data']}/{f}" for f in tr]
        val_files = [f"{p['data']}/{f}" for f in te]
    if d.gen_batch_size % d.train_batch_size:
        raise ConfigError(f"dapo.gen_batch_size ({d.gen_batch_size}) must be a multiple of "
                          f"dapo.train_batch_size ({d.train_batch_size})")
    max_len = d.max_prompt_length + d.max_response_length
    attn, remove_padding = attention(d)
    a, r = "actor_rollout_ref.actor", "actor_rollout_ref.rollout"
    o: list[tuple[str, Any]] = [
        # data
        ("data.train_files", train_files), ("data.val_files", val_files),
        ("data.prompt_key", "prompt"), ("data.reward_fn_key", "data_source"),
        ("data.max_prompt_length", d.max_prompt_length), ("data.max_response_length", d.max_response_length),
        ("data.train_batch_size", d.train_batch_size), ("data.gen_batch_size", d.gen_batch_size),
        ("data.filter_overlong_prompts", True), ("data.truncation", "error"), ("data.shuffle", True),
        ("data.return_raw_chat", True),
        # algorithm: GRPO advantages, no KL, dynamic sampling
        ("algorithm.adv_estimator", d.adv_estimator), ("algorithm.use_kl_in_reward", d.use_kl),
        ("algorithm.kl_ctrl.kl_coef", 0.0 if not d.use_kl else 0.001),
        ("algorithm.filter_groups.enable", d.filter_groups), ("algorithm.filter_groups.metric", d.filter_metric),
        ("algorithm.filter_groups.max_num_gen_batches", d.max_num_gen_batches),
        ("algorithm.filter_groups.max_inflight_gen_batches", d.gen_batch_size // d.train_batch_size),
        # model
        ("actor_rollout_ref.model.path", model_path(config)),
        ("actor_rollout_ref.model.use_remove_padding", remove_padding),
        ("actor_rollout_ref.model.enable_gradient_checkpointing", d.gradient_checkpointing),
        ("actor_rollout_ref.model.lora_rank", d.lora_rank),
        ("actor_rollout_ref.model.lora_alpha", d.lora_alpha),
        ("actor_rollout_ref.model.target_modules", d.lora_target_modules),
        ("actor_rollout_ref.model.lora_adapter_path", adapter_local(config)),
        # actor: clipped surrogate, token-mean loss, optimiser
        (f"{a}.use_kl_loss", d.use_kl), (f"{a}.kl_loss_coef", 0.0 if not d.use_kl else 0.001),
        (f"{a}.entropy_coeff", d.entropy_coeff), (f"{a}.clip_ratio_low", d.clip_ratio_low),
        (f"{a}.clip_ratio_high", d.clip_ratio_high), (f"{a}.clip_ratio_c", d.clip_ratio_c),
        (f"{a}.loss_agg_mode", d.loss_agg_mode),
        (f"{a}.optim.lr", d.lr), (f"{a}.optim.weight_decay", d.weight_decay),
        (f"{a}.optim.lr_warmup_steps", d.lr_warmup_steps), (f"{a}.optim.clip_grad", d.grad_clip),
        (f"{a}.grad_clip", d.grad_clip),
        (f"{a}.ppo_mini_batch_size", d.ppo_mini_batch_size), (f"{a}.use_dynamic_bsz", True),
        (f"{a}.ppo_max_token_len_per_gpu", max_len),
        (f"{a}.ulysses_sequence_parallel_size", d.ulysses_sequence_parallel_size),
        (f"{a}.fsdp_config.param_offload", d.param_offload),
        (f"{a}.fsdp_config.optimizer_offload", d.optimizer_offload),
        ("actor_rollout_ref.ref.fsdp_config.param_offload", d.param_offload),
        ("actor_rollout_ref.ref.log_prob_max_token_len_per_gpu", max_len),
        # rollout: vLLM, async, n per prompt
        (f"{r}.name", d.rollout_name), (f"{r}.mode", d.rollout_mode), (f"{r}.n", d.rollout_n),
        (f"{r}.temperature", d.rollout_temperature), (f"{r}.top_p", d.rollout_top_p),
        (f"{r}.tensor_model_parallel_size", d.rollout_tensor_parallel_size),
        (f"{r}.gpu_memory_utilization", d.rollout_gpu_memory_utilization),
        (f"{r}.max_model_len", max_len), (f"{r}.max_num_batched_tokens", max_len),
        (f"{r}.log_prob_max_token_len_per_gpu", max_len),
        # LoRA: the actor merges the adapter into its weights for each sync and sends whole weights (vLLM
        # runs without LoRA); only the adapter is trained and exported. verl 0.9.1's adapter-only sync
        # sends an EMPTY adapter under FSDP1 with peft >= 0.21 (peft derives key prefixes from module
        # names that keep FSDP's inner '_fsdp_wrapped_module.', so no state-dict key matches), and vLLM
        # 0.24 then stops in _create_merged_loras_inplace with StopIteration: seen on the H100
        # (benchmarks/gpu/results/2026-11-24-h100-m2), reproduced on CPU (tests/test_train_lora_sync.py).
        *([("actor_rollout_ref.model.lora.merge", True), (f"{r}.load_format", "safetensors")]
          if d.lora_rank > 0 else []),
        (f"{r}.val_kwargs.do_sample", True), (f"{r}.val_kwargs.temperature", d.val_temperature),
        (f"{r}.val_kwargs.top_p", d.val_top_p), (f"{r}.val_kwargs.n", 1),
        # reward: our function under the DAPO manager
        ("reward.reward_manager.name", "dapo"),
        ("reward.custom_reward_function.path", "pkg://memsifter.rewards"),
        ("reward.custom_reward_function.name", "compute_score"),
        # trainer
        ("trainer.nnodes", config.nnodes), ("trainer.n_gpus_per_node", config.n_gpus_per_node),
        ("trainer.project_name", config.project_name), ("trainer.experiment_name", config.experiment_name),
        ("trainer.logger", config.logger),
        ("trainer.save_freq", d.save_freq), ("trainer.test_freq", d.test_freq),
        ("trainer.resume_mode", d.resume_mode), ("trainer.total_epochs", d.total_epochs),
        ("trainer.total_training_steps", d.total_training_steps),
        ("trainer.val_before_train", d.val_before_train),
        ("trainer.default_local_dir", p["checkpoints"]),
        ("trainer.max_actor_ckpt_to_keep", config.keep_local_checkpoints),
        ("trainer.checkpoint_callback_class", "memsifter.stages.train.S3CheckpointCallback"),
    ]
    out = [f"{k}={_q(v)}" for k, v in o]
    # Keys verl reads but does not declare: added with '+'.
    added: list[tuple[str, Any]] = [
        ("reward.reward_kwargs.overlong_buffer_cfg.enable", d.overlong_buffer),
        ("reward.reward_kwargs.overlong_buffer_cfg.len", d.overlong_buffer_len),
        ("reward.reward_kwargs.overlong_buffer_cfg.penalty_factor", d.overlong_penalty_factor),
        ("reward.reward_kwargs.overlong_buffer_cfg.log", True),
        ("reward.reward_kwargs.max_resp_len", d.max_response_length),
    ]
    added += [(f"reward.custom_reward_function.reward_kwargs.{k}", v) for k, v in reward_kwargs(config).items()]
    env = {ENV_CHECKPOINT_URI: checkpoint_uri(config)}
    env.update({k: os.environ[k] for k in FORWARD_ENV if os.environ.get(k)})
    env.update(engine_env())  # verl's vLLM rollout servers run in these Ray actors
    if d.fast_logprobs:  # imported by `import verl` in every Ray worker of the run
        from memsifter import verl_patches

        env["VERL_USE_EXTERNAL_MODULES"] = verl_patches.external_modules(os.environ.get("VERL_USE_EXTERNAL_MODULES"))
    added += [(f"ray_kwargs.ray_init.runtime_env.env_vars.{k}", v) for k, v in sorted(env.items())]
    out += [f"+{k}={_q(v)}" for k, v in added]
    # A user's own override of the same key in extra_overrides (the workaround before this setting
    # existed, usually with '+') wins: ours is left out, or Hydra would refuse to add the key twice.
    key = "actor_rollout_ref.model.override_config.attn_implementation"
    if not any(o.lstrip("+").split("=", 1)[0] == key for o in config.extra_overrides):
        out.append(f"++{key}={_q(attn)}")
    return out + list(config.extra_overrides)


def placement_request(config: TrainConfig) -> dict:
    """The Ray resources verl asks for, to check against the chart's worker groups.

    verl's ``ResourcePoolManager`` makes one STRICT_PACK placement group per node with
    ``n_gpus_per_node`` bundles of ``{"CPU": 3, "GPU": 1}`` (max_colocate_count = 3); the task runner,
    reward-loop workers and agent-loop workers are plain actors placed on any node with CPUs.
    """
    n, g = config.nnodes, config.n_gpus_per_node
    bundle = {"CPU": 3, "GPU": 1}
    return {
        "nnodes": n, "gpus_per_node": g, "total_gpus": n * g,
        "placement_groups": [{"strategy": "STRICT_PACK", "bundles": [dict(bundle) for _ in range(g)]}
                             for _ in range(n)],
        "per_gpu_node": {"GPU": g, "CPU": 3 * g},
        "cpu_actors": {"task_runner": 1, "reward_loop_workers": 8, "agent_loop_workers": 8},
    }


# --------------------------------------------------------------------------- composing (dry run)
def compose(config: TrainConfig, overrides: list[str] | None = None, timeout: float = 300,
            in_process: bool = False) -> str:
    """The fully composed verl config (YAML), as ``python -m verl.trainer.main_ppo --cfg job --resolve``
    prints it; raises ConfigError naming the problem when Hydra refuses an override (unknown key).

    ``in_process`` composes with Hydra's compose API on verl's config module (same defaults list and
    override grammar; no interpreter start-up)."""
    if overrides is None:
        overrides = verl_overrides(config)
    if in_process:
        from hydra import compose as hydra_compose
        from hydra import initialize_config_module
        from hydra.core.global_hydra import GlobalHydra
        from omegaconf import OmegaConf

        GlobalHydra.instance().clear()
        try:
            with initialize_config_module(config_module="verl.trainer.config", version_base=None):
                cfg = hydra_compose(config_name="ppo_trainer", overrides=list(overrides))
        except Exception as e:  # noqa: BLE001 - Hydra's override/key errors
            raise ConfigError(f"verl rejected the composed config: {type(e).__name__}: {e}") from e
        finally:
            GlobalHydra.instance().clear()
        return OmegaConf.to_yaml(cfg, resolve=True)
    cmd = [sys.executable, "-m", "verl.trainer.main_ppo", "--cfg", "job", "--resolve", *overrides]
    env = {**os.environ, "HYDRA_FULL_ERROR": "1", "TOKENIZERS_PARALLELISM": "false"}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if p.returncode != 0:
        tail = "\n".join((p.stderr or p.stdout).strip().splitlines()[-15:])
        raise ConfigError(f"verl rejected the composed config:\n{tail}")
    return p.stdout  # Hydra prints the YAML alone on stdout (verl's warnings go to stderr)


def validate_composed(yaml_text: str) -> Any:
    """Run verl's own ``validate_config`` on a composed config; returns the OmegaConf config."""
    from omegaconf import OmegaConf
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    cfg = OmegaConf.create(yaml_text)
    with contextlib.redirect_stdout(sys.stderr):  # verl prints its verdict; stdout stays pure YAML
        validate_config(config=cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
    return cfg


def dry_run(config: TrainConfig, validate: bool = True, in_process: bool = False,
            unchecked: list[str] | None = None) -> str:
    """Compose (and validate) the verl config without starting anything.

    No object store is contacted (no S3 call, no listing, no lease): an ``s3://`` prepare-rl output is
    not read and the usual file names stand in (a store that is down would otherwise hold the dry run
    for the whole retry budget); a local one is read for its file names (a local read cannot stall),
    and when that fails the usual names stand in too. What was not read is appended to ``unchecked``."""
    check_loggers(config)
    assumed = ["train_00000.parquet"], ["test.parquet"]
    if storage.is_s3(config.data):
        train, test = assumed
        if unchecked is not None:
            unchecked.append(f"data {config.data}: not read (a dry run makes no object-store call); "
                             f"file names assumed: {train + test}")
    else:
        try:
            train, test = data_files(config)
        except Exception as e:  # noqa: BLE001 - missing/unpublished input: still compose
            train, test = assumed
            if unchecked is not None:
                unchecked.append(f"data {config.data}: not read ({type(e).__name__}: "
                                 f"{str(e).splitlines()[0][:200]}); file names assumed: {train + test}")
    p = local_paths(config)
    overrides = verl_overrides(config, [f"{p['data']}/{f}" for f in train], [f"{p['data']}/{f}" for f in test])
    text = compose(config, overrides, in_process=in_process)
    if validate:
        validate_composed(text)
    return text


# --------------------------------------------------------------------------- checkpoints in S3
def missing_files(files: dict[str, int]) -> list[str]:
    """What a ``global_step_N`` file listing (relative path -> size) lacks to be a complete checkpoint."""
    missing = []
    cfg = "actor/fsdp_config.json"
    if cfg not in files:
        return [cfg]
    ranks = [re.fullmatch(r"actor/model_world_size_(\d+)_rank_(\d+)\.pt", f) for f in files]
    sizes = {int(m.group(1)) for m in ranks if m}
    if len(sizes) != 1:
        return ["actor/model_world_size_*_rank_*.pt"]
    ws = sizes.pop()
    for kind in ("model", "optim", "extra_state"):
        present = any(f.startswith(f"actor/{kind}_world_size_{ws}_rank_") for f in files)
        if kind == "model" or present:
            missing += [f"actor/{kind}_world_size_{ws}_rank_{r}.pt" for r in range(ws)
                        if f"actor/{kind}_world_size_{ws}_rank_{r}.pt" not in files]
    if "actor/huggingface/config.json" not in files:
        missing.append("actor/huggingface/config.json")
    if "data.pt" not in files:
        missing.append("data.pt")
    return missing


def _sizes(uri: str) -> dict[str, int]:
    fs, root = storage.resolve(uri)
    import pyarrow.fs as pafs

    sel = pafs.FileSelector(root, recursive=True, allow_not_found=True)
    infos = storage.retrying(lambda: fs.get_file_info(sel), uri)
    return {i.path[len(root):].lstrip("/"): i.size for i in infos if i.type == pafs.FileType.File}


def upload_local_step(local_step_dir: str, step_uri: str) -> list[tuple[str, int]]:
    """Upload the files of one node's ``global_step_N`` directory (skips identical-size objects)."""
    if not os.path.isdir(local_step_dir):
        return []
    remote = _sizes(step_uri)
    done = []
    for root, _, files in os.walk(local_step_dir):
        for f in sorted(files):
            full = os.path.join(root, f)
            rel = os.path.relpath(full, local_step_dir).replace(os.sep, "/")
            size = os.path.getsize(full)
            if remote.get(rel) != size:
                storage.copy_file(full, storage.join(step_uri, rel))
            done.append((rel, size))
    return done


def mark_complete(ckpt_uri: str, step: int) -> dict:
    """Write ``_COMPLETE.json`` for a step whose files are all in S3; raises if some are missing."""
    step_uri = storage.join(ckpt_uri, f"global_step_{step}")
    files = {k: v for k, v in _sizes(step_uri).items() if k != COMPLETE_MARKER}
    missing = missing_files(files)
    if missing:
        raise RuntimeError(f"checkpoint {step_uri} is incomplete: missing {missing[:5]}")
    marker = {"step": step, "files": files, "bytes": sum(files.values()), "completed_at": storage.utcnow()}
    storage.write_bytes(storage.join(step_uri, COMPLETE_MARKER), json.dumps(marker, indent=2).encode())
    storage.write_bytes(storage.join(ckpt_uri, TRACKER), str(step).encode())
    return marker


def restore_step(ckpt_uri: str, step: int | None, local_root: str) -> int | None:
    """Make ``local_root`` resume from ``step`` (download it, write verl's tracker); None: from scratch."""
    tracker = os.path.join(local_root, TRACKER)
    if step is None:
        if os.path.exists(tracker):
            os.remove(tracker)  # S3 is the source of truth: no complete checkpoint there, start over
        return None
    step_uri = storage.join(ckpt_uri, f"global_step_{step}")
    local = os.path.join(local_root, f"global_step_{step}")
    for rel in storage.list_files(step_uri):
        if rel == COMPLETE_MARKER:
            continue
        dest = os.path.join(local, rel)
        if os.path.exists(dest):
            continue
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        storage.copy_file(storage.join(step_uri, rel), dest)
    os.makedirs(local_root, exist_ok=True)
    with open(tracker, "w") as f:
        f.write(str(step))
    return step


# --------------------------------------------------------------------------- running on every node
def _ray_connected() -> bool:
    try:
        import ray
    except ImportError:
        return False
    return ray.is_initialized()


def on_every_node(fn: Any, *args: Any) -> list[Any]:
    """Run ``fn(*args)`` once on every alive Ray node (num_cpus=0: GPU nodes' CPUs are reserved);
    locally when Ray is not initialised. Returns the results."""
    if not _ray_connected():
        return [fn(*args)]
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    remote = ray.remote(num_cpus=0, max_retries=2)(fn)
    refs = [remote.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote(*args)
            for n in ray.nodes() if n.get("Alive")]
    return ray.get(refs)


def wait_for_gpu_nodes(nnodes: int, gpus_per_node: int, timeout: float) -> int:
    import ray

    deadline = time.time() + timeout
    while True:
        n = sum(1 for node in ray.nodes()
                if node.get("Alive") and node.get("Resources", {}).get("GPU", 0) >= gpus_per_node)
        if n >= nnodes or time.time() > deadline:
            if n < nnodes:
                log.warning("only %d of %d GPU nodes joined within %.0fs; staging on those", n, nnodes, timeout)
            return n
        time.sleep(5)


def _stage_node(data_uri: str, data_files_: list[str], model_uri: str | None, paths: dict[str, str],
                ckpt_uri: str, step: int | None, adapter_uri: str | None = None) -> dict:
    """On one node: data, model, the starting adapter and checkpoint from the storage layer to local disk."""
    os.makedirs(paths["data"], exist_ok=True)
    if adapter_uri:
        storage.download_dir(adapter_uri, paths["adapter"])
    for f in data_files_:
        dest = os.path.join(paths["data"], f)
        if not os.path.exists(dest):
            storage.copy_file(storage.join(data_uri, f), dest)
    if model_uri:
        storage.download_dir(model_uri, paths["model"])
    restored = restore_step(ckpt_uri, step, paths["checkpoints"])
    import socket

    return {"host": socket.gethostname(), "restored_step": restored}


class S3CheckpointCallback:
    """verl ``trainer.checkpoint_callback_class``: upload each saved step from every node, then mark it.

    Duck-typed to ``verl.trainer.ppo.checkpoint_callback.CheckpointCallback`` (constructed with
    ``config=``, called with ``on_save(trainer=, global_step=, checkpoint_dir=, async_save=)`` on the
    trainer's driver after the workers saved). An exception here aborts training, on purpose: a run
    whose checkpoints cannot be stored should not continue silently.
    """

    def __init__(self, config: Any = None):
        self.config = config
        self.uri = os.environ.get(ENV_CHECKPOINT_URI)

    def on_save(self, trainer: Any = None, global_step: int = 0, checkpoint_dir: str = "",
                async_save: bool = False, **kwargs: Any) -> None:
        if not self.uri:
            log.warning("%s is not set: checkpoint %s stays on local disk only", ENV_CHECKPOINT_URI, checkpoint_dir)
            return
        if async_save:
            log.warning("async checkpoint save: step %s is uploaded when the next synchronous save happens",
                        global_step)
            return
        sync_checkpoint(checkpoint_dir, self.uri, int(global_step))


def sync_checkpoint(local_step_dir: str, ckpt_uri: str, step: int) -> dict:
    """Every node uploads what it wrote for ``step``; then the step is checked and marked complete."""
    step_uri = storage.join(ckpt_uri, f"global_step_{step}")
    t0 = time.time()
    uploaded = on_every_node(upload_local_step, local_step_dir, step_uri)
    marker = mark_complete(ckpt_uri, step)
    log.info("checkpoint step %d: %d files (%.1f MB) from %d node(s) in %.1fs -> %s", step, len(marker["files"]),
             marker["bytes"] / 1e6, sum(1 for u in uploaded if u), time.time() - t0, step_uri)
    return marker


# --------------------------------------------------------------------------- the stage
EVICTED_KEY = "training/filter_groups/evicted_samples"  # verl V1: DAPO-filtered groups (prompts) per step


def collapse_guard(d: DapoSettings) -> Callable[[dict], str | None] | None:
    """The bound verl's V1 trainer does not apply (``max_num_gen_batches``): given one step's metrics,
    the reason to stop when dynamic sampling went through more than ``max_num_gen_batches x
    gen_batch_size`` prompts to fill the step's ``train_batch_size`` groups, else None.

    When almost every prompt's samples score the same, the policy has collapsed (measured on an H100,
    2026-11-24 machine 10: LoRA lr 2e-4, discarded groups per step 2, 4, 32, 55, 192, 501, 706, 3,561
    while the token entropy fell 0.18 -> 0.04 and the step grew from 21 s to 306 s)."""
    if not d.filter_groups or d.max_num_gen_batches <= 0:
        return None
    limit = d.max_num_gen_batches * d.gen_batch_size

    def check(rec: dict) -> str | None:
        evicted = rec.get(EVICTED_KEY)
        if evicted is None or evicted + d.train_batch_size <= limit:
            return None
        entropy = rec.get("actor/entropy")
        return (f"step {rec['step']}: dynamic sampling discarded {int(evicted)} prompt groups whose "
                f"{d.rollout_n} samples all scored the same to fill {d.train_batch_size}, more than "
                f"max_num_gen_batches x gen_batch_size = {d.max_num_gen_batches} x {d.gen_batch_size} = {limit} "
                f"prompts: the policy has collapsed"
                + (f" (actor/entropy {entropy:.3f})" if entropy is not None else "")
                + ". Training stops here; the checkpoints saved so far are kept. To go on: lower dapo.lr, "
                  "raise dapo.entropy_coeff, or set dapo.max_num_gen_batches=0 (no limit)")
    return check


def _stop(proc: subprocess.Popen, grace_s: float = 60.0) -> threading.Timer:
    """SIGINT (verl's driver shuts its Ray workers down on the way out), SIGKILL after ``grace_s``;
    the caller keeps reading the output meanwhile so the child never blocks on a full pipe."""
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGINT)
    timer = threading.Timer(grace_s, lambda: proc.poll() is None and proc.kill())
    timer.daemon = True
    timer.start()
    return timer


def _run_verl(overrides: list[str], sink: Any = None, guard: Callable[[dict], str | None] | None = None,
              cmd: list[str] | None = None) -> str | None:
    """verl ``main_ppo`` in a child process; its output is echoed line by line and every per-step
    metric line goes to ``sink`` (:class:`memsifter.trainmetrics.MetricsSink`). ``guard`` sees each
    step's metrics; when it gives a reason, verl is stopped after that step and the reason returned
    (None: verl ran to its end). ``cmd`` replaces verl's command line (tests)."""
    from ..trainmetrics import parse_line

    cmd = cmd or [sys.executable, "-m", "verl.trainer.main_ppo", *overrides]
    log.info("starting verl: %s", " ".join(shlex.quote(c) for c in cmd))
    env = {**os.environ, "HYDRA_FULL_ERROR": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace", bufsize=1)
    stopped: str | None = None
    timer = None
    try:
        for line in proc.stdout:  # type: ignore[union-attr]
            sys.stdout.write(line)
            if stopped:
                continue  # verl is shutting down: echo, nothing more counts
            rec = sink.feed(line) if sink is not None else (parse_line(line) if guard else None)
            if rec and guard and (stopped := guard(rec)):
                log.error("collapse guard: %s", stopped)
                timer = _stop(proc)
        rc = proc.wait()
    finally:
        if timer is not None:
            timer.cancel()
        if proc.poll() is None:
            proc.kill()
        if sink is not None:
            sink.flush()
    if rc != 0 and stopped is None:
        raise RuntimeError(f"verl main_ppo exited with status {rc}")
    return stopped


def publish_metrics(out: storage.Publication, sink: Any, title: str) -> dict:
    """``metrics.jsonl`` and ``training_curves.png`` of the run (every attempt's steps), and a summary."""
    from .. import trainmetrics

    records = sink.sorted()
    out.write_text("metrics.jsonl", sink.jsonl())
    out.write_bytes("training_curves.png", trainmetrics.plot(records, title))
    return trainmetrics.summary(records)


def preview(config: TrainConfig) -> dict:
    """``--dry-run``: print the composed verl config (stdout) and what was not checked (stderr)."""
    unchecked: list[str] = []
    # Hydra's compose API in this process gives the same YAML as `main_ppo --cfg job --resolve` without a
    # second interpreter importing verl and torch (about half of a dry run's CPU time).
    print(dry_run(config, in_process=True, unchecked=unchecked))
    unchecked += [f"output {config.output}: not touched (no manifest read, nothing published)",
                  f"model {config.model}: not loaded (verl loads it at start)",
                  f"checkpoints under {checkpoint_uri(config)}: not listed (resume is decided at start)"]
    if config.reward.mode == "task":
        unchecked.append(f"working LLM {config.reward.base_url}: not called")
    print("# dry run: verl config composed and validated; nothing was started or published\n# not checked:\n"
          + "\n".join(f"#   - {u}" for u in unchecked), file=sys.stderr)
    return {"unchecked": unchecked}


@stage("train", TrainConfig, family="train", gpus=8, preview=preview,
       help="DAPO training of the ranker with verl (checkpoints to S3, resume from S3; --dry-run composes only)")
def run(config: TrainConfig, out: storage.Publication) -> dict:
    train, test = data_files(config)
    p = local_paths(config)
    overrides = verl_overrides(config, [f"{p['data']}/{f}" for f in train], [f"{p['data']}/{f}" for f in test])
    composed = compose(config, overrides)
    ckpt_uri = checkpoint_uri(config)
    steps = complete_steps(ckpt_uri)
    resume = steps[-1] if steps and config.dapo.resume_mode == "auto" else None
    if os.environ.get("RAY_ADDRESS"):
        import ray

        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
        wait_for_gpu_nodes(config.nnodes, config.n_gpus_per_node, config.node_wait_s)
    try:
        staged = on_every_node(_stage_node, config.data, train + test,
                               config.model if storage.is_s3(config.model) else None, p, ckpt_uri, resume,
                               adapter_source(config.init_adapter) if config.init_adapter else None)
    finally:
        if _ray_connected():
            import ray

            ray.shutdown()
    log.info("staged on %d node(s); resuming from step %s", len(staged), resume)
    from ..trainmetrics import MetricsSink

    # verl's per-step metrics, kept under the output as they come (they outlive the pod; a resumed
    # run continues the curves)
    sink = MetricsSink(storage.join(out.work, "metrics.jsonl"))
    stopped = _run_verl(overrides, sink, collapse_guard(config.dapo))
    steps = complete_steps(ckpt_uri)
    out.write_text("verl_config.yaml", composed)
    out.write_text("overrides.txt", "\n".join(overrides) + "\n")
    out.write_json("checkpoints.json", {"uri": ckpt_uri, "steps": steps})
    metrics = publish_metrics(out, sink, f"{config.experiment_name}: {config.model}, reward {config.reward.mode}")
    return {"checkpoint_uri": ckpt_uri, "complete_steps": steps, "resumed_from": resume, "nodes": len(staged),
            "placement": placement_request(config), "metrics": metrics,
            **({"stopped_early": {"reason": stopped, "last_complete_step": steps[-1] if steps else None}}
               if stopped else {})}
