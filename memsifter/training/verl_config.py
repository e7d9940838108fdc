"""A train config as verl's command line: the Hydra overrides for ``verl.trainer.main_ppo``
(:func:`verl_overrides`), the composed config they give (:func:`compose`, checked by verl's own
``validate_config``: :func:`validate_composed`) and the dry run (:func:`dry_run`), which composes without
any object-store call. What each override is and why: :mod:`memsifter.stages.train`. The settings
engine underneath is :mod:`memsifter.training.verl_settings`; ``config`` arguments are train configs
(:class:`memsifter.stages.train.TrainConfig`).
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
from typing import Any

from ..agents import verl_names
from ..errors import ConfigError, InputError
from ..models.vllm_env import engine_env
from ..store import storage
from .checkpoints import CHECKPOINTS, ENV_CHECKPOINT_URI
from .verl_settings import (ATTN_KEY, ENV_KEY, _declared, _has, _merge, _q, _set, _under, attention, expand, get,
                            leaves, override_lines, settings, verl_schema)

# Non-secret settings forwarded to verl's Ray actors (credentials stay in the pods' environment).
FORWARD_ENV = ("MEMSIFTER_S3_ENDPOINT", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_REGION",
               "AWS_DEFAULT_REGION", "HF_HUB_OFFLINE")


LOGGER_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow", "swanlab": "swanlab",
                   "vemlp_wandb": "wandb", "clearml": "clearml", "trackio": "trackio"}


def check_loggers(config: Any) -> None:
    """verl's tracking backends import their package at start: one that is not installed here (the
    image the stage runs in) is refused now, naming the logger and the package."""
    import importlib.util

    for name in config.logger:
        pkg = LOGGER_PACKAGES.get(name)
        if pkg and importlib.util.find_spec(pkg) is None:
            raise ConfigError(f"train: logger '{name}' needs the Python package {pkg}, which is not installed "
                              "in this environment (the stage's image); install it or drop the logger")


def local_paths(config: Any) -> dict[str, str]:
    root = config.local_dir.rstrip("/")
    return {"root": root, "data": f"{root}/data", "model": f"{root}/model", "checkpoints": f"{root}/{CHECKPOINTS}",
            "adapter": f"{root}/init_adapter"}


def adapter_local(config: Any) -> str | None:
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


def data_files(config: Any) -> tuple[list[str], list[str]]:
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


def checkpoint_uri(config: Any) -> str:
    return storage.join(config.output, CHECKPOINTS)


AGENT_COLUMN = "agent_name"


def agent_names(config: Any, remote: bool = False) -> set[str] | None:
    """The ``agent_name`` values of the data's rows (train and test files): an empty set for rows without
    the column (the ranker's prepare-rl rows); None when not read (``s3://`` data unless ``remote``: a dry
    run makes no object-store call). ``agent.loops: off`` reads nothing and gives an empty set."""
    if config.agent.loops == "off" or (storage.is_s3(config.data) and not remote):
        return set() if config.agent.loops == "off" else None
    import pyarrow.parquet as pq

    try:
        train, test = data_files(config)
    except Exception:  # noqa: BLE001 - unpublished input (a dry run composes anyway)
        return None
    names: set[str] = set()
    for f in train + test:
        uri = storage.join(config.data, f)
        fs, path = storage.resolve(uri)
        with fs.open_input_file(path) as fh:
            pf = pq.ParquetFile(fh)
            if AGENT_COLUMN not in pf.schema_arrow.names:
                continue
            col = pf.read(columns=[AGENT_COLUMN]).column(AGENT_COLUMN)
        for v in col.unique().to_pylist():
            if v is None or v not in verl_names.LOOPS:
                raise InputError(f"agent_name {v!r} is not a memsifter agent loop (known: "
                                 f"{', '.join(verl_names.LOOPS)})", file=uri, field=AGENT_COLUMN)
            names.add(v)
    return names


def agent_loops(config: Any, names: set[str] | None) -> set[str] | None:
    """The agent loops a run needs (None: not agent rows), by ``agent.loops`` and the names read; checks
    that the search loop has a memory service to search."""
    if config.agent.loops == "off" or (config.agent.loops == "auto" and not names):
        return None
    if config.agent.loops == "on" and names is not None and not names:
        raise ConfigError(f"train: agent.loops is on, but the rows of {config.data} have no {AGENT_COLUMN} column "
                          "(a prepare-agents output has it)")
    loops = set(names) if names else set(verl_names.LOOPS)
    if loops & verl_names.SEARCH_LOOPS and not config.search_url and names is not None:
        raise ConfigError("train: the data has memsifter_search rows and search_url is not set: the search agent "
                          "searches the memory service (memsifter serve) during rollouts; set search_url (e.g. "
                          "--set search_url=http://127.0.0.1:8000)")
    return loops


def model_path(config: Any) -> str:
    """Where verl loads the base model: the staged copy of an ``s3://`` model, the local directory of a
    ``memsifter models`` name (e.g. smollm2-135m-instruct, materialized on first use), else as given."""
    if storage.is_s3(config.model):
        return local_paths(config)["model"]
    from ..models import registry as models

    return models.resolve(config.model) if models.lookup(config.model) else config.model


def reward_kwargs(config: Any) -> dict:
    r = config.reward.model_dump()
    if not r.get("cache_uri"):
        r["cache_uri"] = storage.join(config.output, storage.WORK, "reward_cache")
    return {k: v for k, v in r.items() if v is not None}


def verl_overrides(config: Any, train_files: list[str] | None = None,
                   val_files: list[str] | None = None, file_lines: list[str] | None = None,
                   remote: bool = False) -> list[str]:
    """The Hydra overrides for ``verl.trainer.main_ppo`` (MEMSIFTER.md §6): the recipe with the config's
    ``verl:`` block merged over it, what the config's own fields set, what is derived from verl's values
    (unless set), then the lines of ``verl_overrides_file`` (``file_lines``; None: read it) and
    ``extra_overrides`` as written. A key verl reads but does not declare gets '+'.

    Rows of the memory agents (an ``agent_name`` column, :func:`agent_names`; ``remote``: read ``s3://``
    data too) get verl's agent loops: ``actor_rollout_ref.rollout.agent.agent_loop_config_path`` = the
    shipped ``memsifter/configs/verl/agent_loops.yaml``, the v1 trainer (``trainer.use_v1``: a loop returns
    one output per trajectory), the ``naive`` reward manager unless the user chose one (it hands the last
    output's ``extra_fields``, the episode's answer, to the reward function), the reward's ``agent_metric``
    and ``agent_format_score``, and the memory service's URL (and its key's variable name) in the Ray job's
    environment. Ranker rows with ``reward.mode: improvement`` get the ranker's agent loop
    (:mod:`memsifter.training.ranker_loop`: a listing of the sessions drawn per rollout) and the ``naive`` reward
    manager, unless the user's ``verl:`` sets those keys."""
    p = local_paths(config)
    loops = agent_loops(config, agent_names(config, remote))
    if train_files is None or val_files is None:
        tr, te = data_files(config)
        train_files = [f"{p['data']}/{f}" for f in tr]
        val_files = [f"{p['data']}/{f}" for f in te]
    s = settings(config, override_lines(config) if file_lines is None else file_lines)
    attn, remove_padding = attention(s)
    a, r = "actor_rollout_ref.actor", "actor_rollout_ref.rollout"
    final: dict = {"data": {"train_files": train_files, "val_files": val_files}}
    _merge(final, s.tree)
    # what the train config's own fields set (refused under verl:)
    for path, value in (
            ("actor_rollout_ref.model.path", model_path(config)),
            ("actor_rollout_ref.model.lora_adapter_path", adapter_local(config)),
            ("reward.custom_reward_function", {"path": "pkg://memsifter.training.rewards", "name": "compute_score",
                                               "reward_kwargs": reward_kwargs(config)}),
            ("trainer.nnodes", config.nnodes), ("trainer.n_gpus_per_node", config.n_gpus_per_node),
            ("trainer.project_name", config.project_name), ("trainer.experiment_name", config.experiment_name),
            ("trainer.logger", config.logger), ("trainer.default_local_dir", p["checkpoints"]),
            ("trainer.max_actor_ckpt_to_keep", config.keep_local_checkpoints),
            ("trainer.checkpoint_callback_class", "memsifter.training.checkpoints.S3CheckpointCallback"),
            (ATTN_KEY, attn)):
        _set(final, path, value)
    # derived from verl's values, unless the user set them
    tb = s.get("data.train_batch_size")
    gb = s.get("data.gen_batch_size") or tb
    prompt, response = s.get("data.max_prompt_length"), s.get("data.max_response_length")
    derived: list[tuple[str, Any]] = [
        ("algorithm.kl_ctrl.kl_coef", 0.001 if s.get("algorithm.use_kl_in_reward") else 0.0),
        ("actor_rollout_ref.model.use_remove_padding", remove_padding),
        (f"{a}.kl_loss_coef", 0.001 if s.get(f"{a}.use_kl_loss") else 0.0),
        (f"{a}.grad_clip", s.get(f"{a}.optim.clip_grad")),
        ("actor_rollout_ref.ref.fsdp_config.param_offload", s.get(f"{a}.fsdp_config.param_offload")),
        ("reward.reward_kwargs.max_resp_len", response),
    ]
    if isinstance(tb, int) and isinstance(gb, int):  # (not an interpolation verl resolves)
        derived.append(("algorithm.filter_groups.max_inflight_gen_batches", gb // tb))
    if isinstance(prompt, int) and isinstance(response, int):
        max_len = prompt + response  # one sequence of the longest prompt and response fits every budget
        derived += [(f"{a}.ppo_max_token_len_per_gpu", max_len),
                    ("actor_rollout_ref.ref.log_prob_max_token_len_per_gpu", max_len),
                    (f"{r}.max_model_len", max_len), (f"{r}.max_num_batched_tokens", max_len),
                    (f"{r}.log_prob_max_token_len_per_gpu", max_len)]
    # LoRA: the actor merges the adapter into its weights for each sync and sends whole weights (vLLM
    # runs without LoRA); only the adapter is trained and exported. verl 0.9.1's adapter-only sync
    # sends an EMPTY adapter under FSDP1 with peft >= 0.21 (peft derives key prefixes from module
    # names that keep FSDP's inner '_fsdp_wrapped_module.', so no state-dict key matches), and vLLM
    # 0.24 then stops in _create_merged_loras_inplace with StopIteration: seen on the H100
    # (benchmarks/gpu/results/2026-11-24-h100-m2), reproduced on CPU (tests/test_train_lora_sync.py).
    if (s.get("actor_rollout_ref.model.lora_rank") or 0) > 0:
        derived += [("actor_rollout_ref.model.lora.merge", True), (f"{r}.load_format", "safetensors")]
    for path, value in derived:
        if not _has(final, path):
            _set(final, path, value)
    if loops is not None:
        if s.get("trainer.use_v1") is False:
            raise ConfigError("train: agent rows need verl's v1 trainer (an agent loop returns one output per "
                              "trajectory): leave verl.trainer.use_v1 at true")
        agent_keys = [("actor_rollout_ref.rollout.agent.agent_loop_config_path", verl_names.config_path()),
                      ("trainer.use_v1", True),
                      ("reward.custom_reward_function.reward_kwargs.agent_metric", config.agent.metric),
                      ("reward.custom_reward_function.reward_kwargs.agent_format_score", config.agent.format_score),
                      ("reward.custom_reward_function.reward_kwargs.agent_evidence_score",
                       config.agent.evidence_score)]
        if not _has(expand(config.verl), "reward.reward_manager.name"):
            agent_keys.append(("reward.reward_manager.name", "naive"))
        for path, value in agent_keys:
            _set(final, path, value)
    if loops is None and config.reward.mode == "improvement":
        # the ranker's improvement reward scores each rollout against the listing IT was shown: the ranker's agent
        # loop draws that listing per rollout and hands it to the reward; verl's dapo reward manager would drop it
        from . import ranker_loop

        user = expand(config.verl)
        if get(user, "reward.reward_manager.name") not in (None, "naive"):
            raise ConfigError("train: reward.mode improvement needs verl's naive reward manager (the dapo manager "
                              "drops each rollout's listing, so the reward would score the row's fixed order): "
                              "leave verl.reward.reward_manager.name unset or 'naive'")
        for path, value in ranker_loop.verl_settings().items():
            if not _has(user, path):
                _set(final, path, value)
    # the Ray job's environment: the checkpoint URI, non-secret store settings, vLLM's, and the user's
    user_env = get(s.tree, ENV_KEY) or {}
    env: dict[str, Any] = {ENV_CHECKPOINT_URI: checkpoint_uri(config)}
    env.update({k: os.environ[k] for k in FORWARD_ENV if os.environ.get(k)})
    env.update(engine_env())  # verl's vLLM rollout servers run in these Ray actors
    if loops is not None and config.search_url:  # the search agent's memory service (a name, never a key)
        env[verl_names.SEARCH_URL_ENV] = config.search_url
        if config.search_api_key_env:
            env[verl_names.SEARCH_KEY_ENV] = config.search_api_key_env
    env.update(user_env)
    if config.fast_logprobs or attn == "flash_attention_4":  # imported by `import verl` in every Ray worker of the run
        from memsifter.training import verl_patches

        env["VERL_USE_EXTERNAL_MODULES"] = verl_patches.external_modules(
            user_env.get("VERL_USE_EXTERNAL_MODULES") or os.environ.get("VERL_USE_EXTERNAL_MODULES"))
        if not config.fast_logprobs:  # listed for FA4's int max_seqlen (install_fa4) only: log-probs stay verl's
            env[verl_patches.FAST_LOGPROBS_ENV] = "0"
    _set(final, ENV_KEY, dict(sorted(env.items())))
    schema = verl_schema()
    out = []
    for path, value in leaves(final):
        if _under(path, s.raw_keys):
            continue  # the user's line sets it, as written, after ours
        # '++' for the attention key: it adds or replaces, as before this setting was the user's
        prefix = "++" if path == ATTN_KEY else "" if _declared(path, schema) else "+"
        out.append(f"{prefix}{path}={_q(value)}")
    return out + s.raw


def compose(config: Any, overrides: list[str] | None = None, timeout: float = 300,
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


def dry_run(config: Any, validate: bool = True, in_process: bool = False,
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
            if config.agent.loops == "auto":
                unchecked.append("agent rows (an agent_name column): not looked for, composed as ranker rows; "
                                 "for prepare-agents data set agent.loops: on")
    else:
        try:
            train, test = data_files(config)
        except Exception as e:  # noqa: BLE001 - missing/unpublished input: still compose
            train, test = assumed
            if unchecked is not None:
                unchecked.append(f"data {config.data}: not read ({type(e).__name__}: "
                                 f"{str(e).splitlines()[0][:200]}); file names assumed: {train + test}")
    lines = None  # read the override file (a local one cannot stall)
    if config.verl_overrides_file and storage.is_s3(config.verl_overrides_file):
        lines = []
        if unchecked is not None:
            unchecked.append(f"verl_overrides_file {config.verl_overrides_file}: not read (a dry run makes no "
                             "object-store call); composed without its lines")
    p = local_paths(config)
    overrides = verl_overrides(config, [f"{p['data']}/{f}" for f in train], [f"{p['data']}/{f}" for f in test],
                               lines)
    text = compose(config, overrides, in_process=in_process)
    if validate:
        validate_composed(text)
    return text
