"""Stage ``train``: DAPO training of the ranker with verl ``main_ppo`` (MEMSIFTER.md §6).

A pydantic config (:class:`TrainConfig`) becomes a list of Hydra overrides for
``python -m verl.trainer.main_ppo`` (:func:`verl_overrides`). verl's settings keep verl's own names:
the DAPO settings of §6 are a recipe in verl's key names (``memsifter/configs/verl/dapo.yaml``), the
config's ``verl:`` block is merged over it (nested as in verl's ``ppo_trainer.yaml``, or dotted keys),
then come the lines of ``verl_overrides_file`` (a file of Hydra overrides, exactly what one passes to
verl on its command line) and ``extra_overrides``, passed to verl as written. What a user sets is
checked when the config is read: each key against verl's composed config (a typo is one line with a
suggestion), keys that the config's own fields set (model, data, nnodes, ...) are refused naming the
field, and the platform's checks across keys run on the merged values (gen batch a multiple of the
train batch, Ulysses needs flash attention, ranges); the token budgets, KL coefficients and a few
more are derived from verl's values unless set (:func:`verl_overrides`).

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

Memory agents (issue 33): when the data's rows carry ``agent_name`` (a prepare-agents output; ``agent.loops``
decides, :func:`agent_names`), verl runs the agents' own episodes as agent loops
(:mod:`memsifter.agents.verl_loop`): ``actor_rollout_ref.rollout.agent.agent_loop_config_path`` is the shipped
``memsifter/configs/verl/agent_loops.yaml``, ``trainer.use_v1`` stays true (its worker takes a list of
outputs per episode, scores the last and copies the reward; GRPO's advantage is copied likewise), the reward
manager is ``naive`` unless ``verl:`` names one (it passes the last output's ``extra_fields``, the episode's
parsed answer, to the reward function; ``dapo``'s overlong penalty does not apply), the reward kwargs carry
``agent_metric`` / ``agent_format_score`` (``agent:``), and ``search_url`` / ``search_api_key_env`` (the
variable's name) go into the Ray job's environment for the search agent. Size ``verl.data.max_prompt_length``
and ``max_response_length`` for the agents (a trajectory's prompt and its response with observations must fit;
the loop stops an episode that would not, as a format failure).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
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
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..store import storage
from ..training.checkpoints import CHECKPOINTS, COMPLETE_MARKER, TRACKER, complete_steps
from ..errors import ConfigError, InputError
from ..training.reward_settings import RewardSettings
from ..stage import StageConfig, runtime_field, stage, suggest, uri_field
from ..models.vllm_env import engine_env
from ..agents import verl_names

log = logging.getLogger(__name__)

ENV_CHECKPOINT_URI = "MEMSIFTER_CHECKPOINT_URI"
# Non-secret settings forwarded to verl's Ray actors (credentials stay in the pods' environment).
FORWARD_ENV = ("MEMSIFTER_S3_ENDPOINT", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_REGION",
               "AWS_DEFAULT_REGION", "HF_HUB_OFFLINE")


class AgentTraining(BaseModel):
    """How memory-agent rows (prepare-agents: a column ``agent_name``) are trained: verl runs the agents'
    own episodes as agent loops (:mod:`memsifter.agents.verl_loop`, ``memsifter/configs/verl/agent_loops.yaml``;
    the search agent against the memory service at the train config's ``search_url``); the reward is the
    episode's answer against the gold answer (``metric``) plus a format term (``format_score``;
    :func:`memsifter.training.rewards.agent_reward`)."""

    model_config = ConfigDict(extra="forbid")

    loops: Literal["auto", "on", "off"] = Field("auto", description="auto: agent loops when the data's rows carry "
                                                "agent_name (read from the data; a dry run of s3:// data reads "
                                                "nothing: set on); on: always; off: never (ranker rows)")
    @field_validator("loops", mode="before")
    @classmethod
    def _yaml_on_off(cls, v: Any) -> Any:
        """YAML reads a bare ``on`` / ``off`` (``--set agent.loops=on``) as true / false: take them as meant."""
        return {True: "on", False: "off"}.get(v, v) if isinstance(v, bool) else v

    metric: Literal["f1", "em"] = Field("f1", description="answer score against the gold answer: token F1 or "
                                        "exact match")
    format_score: float = Field(0.1, ge=0, le=1, description="weight f of the format term: reward = (1 - f) x "
                                "metric + f x (every reply well formed and an answer given)")


class TrainConfig(StageConfig):
    model: str = Field("Qwen/Qwen3-4B-Thinking-2507", description="base model: hub id, local dir, s3:// URI or a name of `memsifter models list`")
    data: str = uri_field("prepare-rl output (train_*.parquet + test.parquet)", stage="prepare-rl")
    init_adapter: str | None = uri_field("a LoRA adapter to start from (the sft stage's output, its adapter/ "
                                         "directory is used); needs verl.actor_rollout_ref.model.lora_rank > 0",
                                         None, stage=("sft", "collect"), wire="none")
    nnodes: int = Field(1, ge=1, description="GPU nodes (trainer.nnodes)")
    n_gpus_per_node: int = Field(8, ge=1, description="GPUs per node (trainer.n_gpus_per_node)")
    project_name: str = "memsifter"
    experiment_name: str = "dapo-ranker"
    verl: dict[str, Any] = Field(default_factory=dict, description=(
        "verl main_ppo settings in verl's own key names (nested as in verl's ppo_trainer.yaml, or dotted keys), "
        "merged over the platform's DAPO recipe memsifter/configs/verl/dapo.yaml; every key is checked against "
        "verl's config"))
    verl_overrides_file: str | None = uri_field(
        "a file of Hydra overrides for verl main_ppo, one a line as on verl's command line (key=value, "
        "+key=value, ++key=value, ~key; # comment lines): applied after verl:, passed to verl as written", None)
    fast_logprobs: bool = Field(True, description="compute the actor's token log-probs in blocks instead of "
                                "verl's row-by-row fallback (used without flash-attn; memsifter.training.verl_patches)")
    reward: RewardSettings = Field(default_factory=RewardSettings)
    agent: AgentTraining = Field(default_factory=AgentTraining, description=(
        "memory-agent rows (prepare-agents): agent loops and the answer reward"))
    search_url: str | None = Field(
        None, description="base URL of the memory service (memsifter serve) the search agent searches during "
        "rollouts (corpus = each row's corpus_id), e.g. http://127.0.0.1:8000; needed for memsifter_search rows "
        "(prepare-agents); passed to verl's Ray workers as $MEMSIFTER_AGENT_SEARCH_URL. On Kubernetes the chart "
        "sets it to its RayService's URL when serve.enabled", json_schema_extra={"runtime": True, "serve_url": True})
    search_api_key_env: str | None = runtime_field(
        None, "name of the env var (in the pods) holding the memory service's API key (null: anonymous access); "
        "the workers get the name, never the key")
    logger: list[str] = Field(default_factory=lambda: ["console"], description="trainer.logger backends")
    keep_local_checkpoints: int = Field(2, ge=1, description="checkpoints kept on local disk "
                                        "(trainer.max_actor_ckpt_to_keep); S3 keeps every one")
    extra_overrides: list[str] = Field(default_factory=list, description=(
        "more Hydra overrides for verl main_ppo, as on its command line (after verl_overrides_file; "
        "passed to verl as written)"))
    local_dir: str = runtime_field("/tmp/memsifter-train", "local scratch on every node (data, model, checkpoints)")
    dry_run: bool = runtime_field(False, "print the composed verl config and exit; start and publish nothing")
    node_wait_s: float = runtime_field(600.0, "how long to wait for nnodes GPU nodes to join the Ray cluster")

    @model_validator(mode="before")
    @classmethod
    def _former_dapo(cls, data: Any) -> Any:
        if isinstance(data, Mapping) and "dapo" in data:
            block, fields = from_dapo(data["dapo"])
            say = ([f"verl: {_flow(block)}"] if block else []) + [f"{k}: {_flow(v)}" for k, v in fields.items()]
            raise ConfigError("train.dapo: the DAPO settings are verl's own keys under `verl:` now (merged over "
                              "memsifter/configs/verl/dapo.yaml); write instead: " + "; ".join(say or ["nothing"]))
        return data

    @model_validator(mode="after")
    def _checks(self) -> "TrainConfig":
        # A task reward calls the working LLM for every rollout: without an explicit endpoint the calls
        # would go to $OPENAI_BASE_URL or api.openai.com. Say so before anything starts.
        if self.reward.mode == "task" and not self.reward.base_url:
            raise ValueError("reward.mode 'task' needs reward.base_url (the working LLM's OpenAI-compatible "
                             "URL) and reward.model; or use reward.mode 'dcg' (no LLM calls)")
        if self.search_url:
            from ..agents.search import check_search_url

            check_search_url(self.search_url)
        # the verl: block and extra_overrides, checked (the override file is read when verl is started)
        s = settings(self)
        if self.init_adapter and not (s.get("actor_rollout_ref.model.lora_rank") or 0) > 0:
            raise ValueError("init_adapter needs verl.actor_rollout_ref.model.lora_rank > 0 (the adapter is "
                             "trained further as LoRA)")
        return self

    def preflight(self) -> None:
        """What a run (not a dry run) refuses before it touches anything: a logger whose package is
        missing, and, when verl will start its own Ray here (no ``RAY_ADDRESS``) and load the model on
        this machine, a base model reference it could not load (one line instead of verl's traceback; on
        a cluster the GPU nodes load it from their own disks and caches, which this driver cannot see)."""
        check_loggers(self)
        if not os.environ.get("RAY_ADDRESS") and not storage.is_s3(self.model):
            from ..models.embedding import check_model_ref

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


# --------------------------------------------------------------------------- verl's settings
RECIPE = ("configs", "verl", "dapo.yaml")  # the platform's DAPO recipe, in verl's key names
LEGACY = ("configs", "verl", "legacy_dapo.yaml")  # the former `dapo:` names -> verl's (migration only)
ATTENTION = ("auto", "flash_attention_2", "sdpa", "eager")
ATTN_KEY = "actor_rollout_ref.model.override_config.attn_implementation"
ENV_KEY = "ray_kwargs.ray_init.runtime_env.env_vars"
# What the train config's own fields set: refused under `verl:` (and in override lines), naming the field.
OWNED = {
    "data.train_files": "data", "data.val_files": "data", "actor_rollout_ref.model.path": "model",
    "actor_rollout_ref.model.lora_adapter_path": "init_adapter", "reward.custom_reward_function": "reward",
    "trainer.nnodes": "nnodes", "trainer.n_gpus_per_node": "n_gpus_per_node", "trainer.project_name": "project_name",
    "trainer.experiment_name": "experiment_name", "trainer.logger": "logger", "trainer.default_local_dir": "local_dir",
    "trainer.max_actor_ckpt_to_keep": "keep_local_checkpoints", "trainer.checkpoint_callback_class": "output",
    f"{ENV_KEY}.{ENV_CHECKPOINT_URI}": "output",
}
OWNED_WHY = {"data": " (a prepare-rl output; its files are staged to local_dir)",
             "output": " (checkpoints go to <output>/checkpoints through the stage's own callback)",
             "reward": " (memsifter's reward function and its settings)"}
# Mappings verl reads without declaring them in its config: keys under them are added with '+'.
UNDECLARED = ("reward.reward_kwargs", "reward.custom_reward_function.reward_kwargs", ENV_KEY)


def _under(path: str, prefixes: tuple[str, ...] | list[str]) -> bool:
    return any(path == p or path.startswith(p + ".") for p in prefixes)


def get(tree: Mapping, path: str, default: Any = None) -> Any:
    """The value at a dotted verl path of a nested mapping, else ``default``."""
    cur: Any = tree
    for part in path.split("."):
        if not isinstance(cur, Mapping) or part not in cur:
            return default
        cur = cur[part]
    return cur


def _has(tree: Mapping, path: str) -> bool:
    return get(tree, path, _MISSING) is not _MISSING


_MISSING = object()


def _set(tree: dict, path: str, value: Any) -> None:
    *head, last = path.split(".")
    cur = tree
    for part in head:
        if not isinstance(cur.get(part), dict):
            cur[part] = {}
        cur = cur[part]
    cur[last] = value


def _delete(tree: dict, path: str) -> None:
    *head, last = path.split(".")
    parent = get(tree, ".".join(head)) if head else tree
    if isinstance(parent, dict):
        parent.pop(last, None)


def _merge(base: dict, over: Mapping) -> dict:
    """``over`` merged into ``base`` (in place): mappings merge key by key, anything else replaces."""
    for k, v in over.items():
        if isinstance(v, Mapping) and v and isinstance(base.get(k), dict):
            _merge(base[k], v)
        else:
            base[k] = copy.deepcopy(dict(v) if isinstance(v, Mapping) else v)
    return base


def expand(block: Mapping, where: str = "train.verl") -> dict:
    """A ``verl:`` block as nested mappings: a dotted key (``actor_rollout_ref.rollout.n: 8``) is split."""
    out: dict = {}
    for k, v in block.items():
        if not isinstance(k, str) or not k or any(not p for p in k.split(".")):
            raise ConfigError(f"{where}: key {k!r}: expected a verl key name (a.b.c)")
        if isinstance(v, Mapping) and v:
            v = expand(v, f"{where}.{k}")
        nested: dict = {}
        _set(nested, k, v)
        _merge(out, nested)
    return out


def leaves(tree: Mapping, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted path, value) of every leaf; an empty mapping is a leaf."""
    for k, v in tree.items():
        path = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, Mapping) and v:
            yield from leaves(v, path)
        else:
            yield path, v


@functools.lru_cache(maxsize=None)
def _yaml_resource(parts: tuple[str, ...]) -> Any:
    import yaml
    from importlib import resources

    return yaml.safe_load(resources.files("memsifter").joinpath(*parts).read_text(encoding="utf-8"))


def merged(block: Mapping | None = None) -> dict:
    """The platform's DAPO recipe with ``block`` (verl's names, nested or dotted) merged over it; unchecked."""
    return _merge(copy.deepcopy(_yaml_resource(RECIPE)), expand(block or {}))


@functools.lru_cache(maxsize=1)
def verl_schema() -> dict | None:
    """verl's ``ppo_trainer`` config composed with Hydra (every key ``main_ppo`` declares, with its default;
    interpolations unresolved); None where verl or Hydra is not installed (verl then checks the keys when it
    composes). Reads verl's config directory without importing verl (~0.5 s, once per process)."""
    import importlib.util

    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.origin:
        return None
    try:
        from hydra import compose as hydra_compose
        from hydra import initialize_config_dir
        from hydra.core.global_hydra import GlobalHydra
        from omegaconf import OmegaConf
    except ImportError:
        return None
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=os.path.join(os.path.dirname(spec.origin), "trainer", "config"),
                                   version_base=None):
            cfg = hydra_compose(config_name="ppo_trainer")
    finally:
        GlobalHydra.instance().clear()
    return OmegaConf.to_container(cfg, resolve=False)  # type: ignore[return-value]


def _declared(path: str, schema: dict | None) -> bool:
    """Whether verl's config declares ``path`` (a plain override) or not (added with '+')."""
    if schema is None:
        return not _under(path, UNDECLARED)
    return get(schema, path, _MISSING) is not _MISSING


def _owned(path: str, where: str, ancestors: bool = False) -> None:
    """Refuse a key the train config's own fields set (``ancestors``: or a mapping holding one)."""
    for key, field in OWNED.items():
        if _under(path, (key,)) or (ancestors and _under(key, (path,))):
            raise ConfigError(f"{where}: set by the train config's `{field}`{OWNED_WHY.get(field, '')}, "
                              "not under verl")


def check_key(path: str, value: Any, where: str) -> None:
    """A verl key a user set: not one the platform sets, a key of verl's composed config (or under a mapping
    verl leaves open), and a value of the default's kind. One ConfigError line naming ``where``."""
    _owned(path, where)
    schema = verl_schema()
    if schema is None:
        return
    cur: Any = schema
    parts = path.split(".")
    for i, part in enumerate(parts):
        here = ".".join(parts[:i])
        if isinstance(cur, dict) and part in cur:
            cur = cur[part]
            continue
        if _under(".".join(parts[:i + 1]), UNDECLARED) or (isinstance(cur, dict) and not cur):
            return  # a mapping verl reads without declaring its keys (engine_kwargs, override_config, ...)
        if not isinstance(cur, dict):
            raise ConfigError(f"{where}: verl's {here} is a single value ({cur!r}), not a mapping")
        raise ConfigError(f"{where}: verl has no key '{part}' under {here or 'the top level'}"
                          f"{suggest(part, cur)}; a key verl reads without declaring it goes in "
                          f"extra_overrides as '+{path}=...'")
    _check_kind(value, cur, where)


def _check_kind(value: Any, default: Any, where: str) -> None:
    if value is None or (isinstance(value, str) and "${" in value):
        return
    if isinstance(default, bool):
        ok, want = isinstance(value, bool), "true or false"
    elif isinstance(default, (int, float)):
        ok, want = isinstance(value, (int, float)) and not isinstance(value, bool), "a number"
    elif isinstance(default, dict) and default:
        ok, want = isinstance(value, Mapping), "a mapping"
    else:
        return  # strings, lists, nulls and interpolations: verl's own validation decides
    if not ok:
        said = "" if isinstance(default, dict) else f" (verl's default is {default!r})"
        raise ConfigError(f"{where}: expected {want}{said}, got {value!r}")


@dataclasses.dataclass
class VerlSettings:
    """What verl gets, in verl's names: ``tree``, the recipe with the ``verl:`` block and the user's
    override lines merged over it (what the platform checks and derives from); ``raw``, those override
    lines, passed to verl verbatim after everything else; ``raw_keys``, the keys they set or delete."""

    tree: dict
    raw: list[str]
    raw_keys: list[str]

    def get(self, path: str, default: Any = None) -> Any:
        return get(self.tree, path, default)


def override_lines(config: "TrainConfig") -> list[str]:
    """The lines of ``verl_overrides_file`` ([] when unset)."""
    if not config.verl_overrides_file:
        return []
    return storage.read_text(config.verl_overrides_file).splitlines()


def _fold(tree: dict, raw: list[str], raw_keys: list[str], where: str, text: str) -> None:
    """One Hydra override a user wrote: kept verbatim for verl; its value merged into ``tree`` so the
    checks and the derived values see it."""
    try:
        from hydra.core.override_parser.overrides_parser import OverridesParser
    except ImportError:  # no verl here: verl reads the line itself
        raw.append(text)
        return
    try:
        o = OverridesParser.create().parse_override(text)
    except Exception as e:  # noqa: BLE001 - Hydra's grammar errors
        raise ConfigError(f"{where}: {text!r} is not a Hydra override ({str(e).splitlines()[0][:200]})") from None
    key = o.key_or_group
    if o.is_sweep_override():
        raise ConfigError(f"{where}: {text!r} is a sweep; verl runs one job: give one value")
    raw.append(text)
    if o.package is not None or "/" in key:
        return  # a config group choice (e.g. actor@actor_rollout_ref.actor=...): verl composes it
    if o.is_delete():
        _owned(key, f"{where}: {key}", ancestors=True)
        _delete(tree, key)
    else:
        value = o.value()
        for path, v in leaves({key: value}) if isinstance(value, dict) and value else [(key, value)]:
            if o.is_add() or o.is_force_add():
                _owned(path, f"{where}: {path}")  # '+'/'++': the user says verl reads a key it does not declare
            else:
                check_key(path, v, f"{where}: {path}")
        if isinstance(value, dict) and isinstance(get(tree, key), dict):
            _merge(get(tree, key), value)
        else:
            _set(tree, key, copy.deepcopy(value))
    raw_keys.append(key)


def settings(config: "TrainConfig", file_lines: list[str] | None = None) -> VerlSettings:
    """The verl settings of a train config: the recipe, its ``verl:`` block, then the lines of its
    ``verl_overrides_file`` (``file_lines``; None: not read) and its ``extra_overrides``; checked."""
    tree = merged()
    block = expand(config.verl)
    for path, value in leaves(block):
        check_key(path, value, f"train.verl.{path}")
    _merge(tree, block)
    raw: list[str] = []
    raw_keys: list[str] = []
    lines = [(f"{config.verl_overrides_file}: line {n}", t) for n, t in enumerate(file_lines or [], 1)]
    lines += [(f"train.extra_overrides[{i}]", t) for i, t in enumerate(config.extra_overrides)]
    for where, text in lines:
        text = text.strip()
        if text and not text.startswith("#"):
            _fold(tree, raw, raw_keys, where, text)
    s = VerlSettings(tree, raw, raw_keys)
    check_settings(s)
    return s


def _number(s: VerlSettings, path: str, *, minimum: float, strict: bool = False, integer: bool = False) -> Any:
    """The merged value at ``path``, checked: a number (an integer) >= ``minimum`` (> when ``strict``)."""
    v = s.get(path)
    if v is None or (isinstance(v, str) and "${" in v):
        return v
    if isinstance(v, bool) or not isinstance(v, int if integer else (int, float)):
        raise ConfigError(f"train: verl.{path} must be {'an integer' if integer else 'a number'}, got {v!r}")
    if v <= minimum if strict else v < minimum:
        what = "a positive integer" if integer and strict and minimum == 0 else \
            f"{'>' if strict else '>='} {minimum:g}"
        raise ConfigError(f"train: verl.{path} must be {what}, got {v!r}")
    return v


def check_settings(s: VerlSettings) -> None:
    """The platform's checks across verl's keys (what verl itself would only find at start, or not at all)."""
    tb = _number(s, "data.train_batch_size", minimum=0, strict=True, integer=True)
    gb = _number(s, "data.gen_batch_size", minimum=0, strict=True, integer=True)
    if isinstance(tb, int) and isinstance(gb, int) and gb % tb:
        raise ConfigError(f"train: verl.data.gen_batch_size ({gb}) must be a multiple of "
                          f"verl.data.train_batch_size ({tb})")
    for path in ("data.max_prompt_length", "data.max_response_length"):
        _number(s, path, minimum=0, strict=True, integer=True)
    _number(s, "algorithm.filter_groups.max_num_gen_batches", minimum=0, integer=True)
    _number(s, "actor_rollout_ref.model.lora_rank", minimum=0, integer=True)
    _number(s, "actor_rollout_ref.model.lora_alpha", minimum=0, strict=True)
    _number(s, "actor_rollout_ref.actor.entropy_coeff", minimum=0)
    _number(s, "actor_rollout_ref.actor.ulysses_sequence_parallel_size", minimum=1, integer=True)
    attn = s.get(ATTN_KEY)
    if attn is not None and attn not in ATTENTION:
        raise ConfigError(f"train: verl.{ATTN_KEY}: expected one of {', '.join(ATTENTION)}, got {attn!r}")
    if attn not in (None, "auto"):
        attention(s)  # an explicit choice is checked now; auto depends on the machine that runs verl


def from_dapo(old: Any, where: str = "train.dapo") -> tuple[dict, dict]:
    """A former ``dapo:`` section -> (its ``verl:`` block, fields of the train config), by
    memsifter/configs/verl/legacy_dapo.yaml."""
    table = _yaml_resource(LEGACY)
    if not isinstance(old, Mapping):
        raise ConfigError(f"{where}: expected a mapping of settings")
    block: dict = {}
    fields: dict = {}
    for k, v in old.items():
        if k not in table:
            raise ConfigError(f"{where}.{k}: no such former setting{suggest(k, table)}")
        target = table[k]
        if isinstance(target, dict):
            fields[target["field"]] = v
        else:
            for path in [target] if isinstance(target, str) else target:
                _set(block, path, v)
    return block, fields


def _flow(data: Any) -> str:
    import yaml

    text = yaml.safe_dump(data, default_flow_style=True, sort_keys=False, width=10**6).strip()
    return text.removesuffix("...").strip()  # a scalar's document end marker


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
    if isinstance(v, Mapping):
        return "{" + ",".join(f"{k}:{_q(x)}" for k, x in v.items()) + "}"
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


AGENT_COLUMN = "agent_name"


def agent_names(config: TrainConfig, remote: bool = False) -> set[str] | None:
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


def agent_loops(config: TrainConfig, names: set[str] | None) -> set[str] | None:
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


def model_path(config: TrainConfig) -> str:
    """Where verl loads the base model: the staged copy of an ``s3://`` model, the local directory of a
    ``memsifter models`` name (e.g. smollm2-135m-instruct, materialized on first use), else as given."""
    if storage.is_s3(config.model):
        return local_paths(config)["model"]
    from ..models import registry as models

    return models.resolve(config.model) if models.lookup(config.model) else config.model


def reward_kwargs(config: TrainConfig) -> dict:
    r = config.reward.model_dump()
    if not r.get("cache_uri"):
        r["cache_uri"] = storage.join(config.output, storage.WORK, "reward_cache")
    return {k: v for k, v in r.items() if v is not None}


def attention(s: VerlSettings) -> tuple[str, bool]:
    """(attn_implementation, use_remove_padding) for the FSDP actor and ref, from
    ``verl.actor_rollout_ref.model.override_config.attn_implementation`` (unset or ``auto``: chosen here).

    verl 0.9.1 loads the model with ``flash_attention_2`` unless ``model.override_config`` says
    otherwise, and transformers refuses that without the ``flash-attn`` package (seen on the first
    real run, an H100 without it). Remove-padding packs a micro-batch into one sequence, which we only
    trust to flash attention's varlen kernels; without them the actor runs SDPA on padded batches
    (slower, same result). Ulysses sequence parallelism needs remove-padding, so ``auto`` keeps flash
    attention when it is asked for (the pods' image must then carry flash-attn).
    """
    import importlib.util

    key = "actor_rollout_ref.actor.ulysses_sequence_parallel_size"
    sp = s.get(key)
    sp = sp if isinstance(sp, int) and not isinstance(sp, bool) else 1
    impl = s.get(ATTN_KEY) or "auto"
    if impl == "auto":
        have = importlib.util.find_spec("flash_attn") is not None
        impl = "flash_attention_2" if have or sp > 1 else "sdpa"
        if not have and impl == "flash_attention_2":
            log.warning("train: flash-attn is not installed here, but verl.%s=%d needs flash_attention_2: the GPU "
                        "pods' image must carry flash-attn (or set verl.%s=1 for SDPA)", key, sp, key)
    if impl != "flash_attention_2" and sp > 1:
        raise ConfigError(f"train: verl.{key}={sp} needs flash_attention_2 (remove padding), not {impl!r} "
                          f"(verl.{ATTN_KEY})")
    remove_padding = s.get("actor_rollout_ref.model.use_remove_padding")
    if remove_padding is None:
        remove_padding = impl == "flash_attention_2"
    elif not remove_padding and sp > 1:
        raise ConfigError(f"train: verl.{key}={sp} needs verl.actor_rollout_ref.model.use_remove_padding: true")
    return impl, remove_padding


def verl_overrides(config: TrainConfig, train_files: list[str] | None = None,
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
    environment."""
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
            ("trainer.checkpoint_callback_class", "memsifter.stages.train.S3CheckpointCallback"),
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
                      ("reward.custom_reward_function.reward_kwargs.agent_format_score", config.agent.format_score)]
        if not _has(expand(config.verl), "reward.reward_manager.name"):
            agent_keys.append(("reward.reward_manager.name", "naive"))
        for path, value in agent_keys:
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
    if config.fast_logprobs:  # imported by `import verl` in every Ray worker of the run
        from memsifter.training import verl_patches

        env["VERL_USE_EXTERNAL_MODULES"] = verl_patches.external_modules(
            user_env.get("VERL_USE_EXTERNAL_MODULES") or os.environ.get("VERL_USE_EXTERNAL_MODULES"))
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


def checkpoint_world_size(ckpt_uri: str, step: int) -> int | None:
    """How many GPU processes wrote ``global_step_<step>`` (from its ``_COMPLETE.json`` file list)."""
    marker = storage.join(ckpt_uri, f"global_step_{step}", COMPLETE_MARKER)
    try:
        files = json.loads(storage.read_bytes(marker)).get("files") or {}
    except Exception:  # noqa: BLE001 - an unreadable marker: verl finds out
        return None
    sizes = {int(m.group(1)) for f in files if (m := re.fullmatch(r"actor/model_world_size_(\d+)_rank_\d+\.pt", f))}
    return sizes.pop() if len(sizes) == 1 else None


def check_resume_world_size(config: TrainConfig, ckpt_uri: str, step: int) -> None:
    """verl 0.9.1 reloads an FSDP checkpoint only on the world size that wrote it (every rank opens
    ``model_world_size_<W>_rank_<r>.pt``; another W dies in a Ray worker with FileNotFoundError after
    minutes of start-up). Refuse before anything starts, in one line, with the ways on."""
    written = checkpoint_world_size(ckpt_uri, step)
    now = config.nnodes * config.n_gpus_per_node
    if written is not None and written != now:
        raise ConfigError(
            f"train: the checkpoint to resume ({storage.join(ckpt_uri, f'global_step_{step}')}) was written by "
            f"{written} GPU processes and this run has nnodes x n_gpus_per_node = {now}; verl resumes an FSDP "
            f"checkpoint only on the same count: run on {written} GPUs, or `memsifter run collect` + `run merge` "
            f"that step and start a new run from the merged model (model: <merged>, another output), or set "
            f"verl.trainer.resume_mode: disable to start over")


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


def collapse_guard(tree: Mapping) -> Callable[[dict], str | None] | None:
    """The bound verl's V1 trainer does not apply (``algorithm.filter_groups.max_num_gen_batches``), from
    the verl settings ``tree`` (verl's names, e.g. :attr:`VerlSettings.tree`): given one step's metrics,
    the reason to stop when dynamic sampling went through more than ``max_num_gen_batches x
    gen_batch_size`` prompts to fill the step's ``train_batch_size`` groups, else None.

    When almost every prompt's samples score the same, the policy has collapsed (measured on an H100,
    2026-11-24 machine 10: LoRA lr 2e-4, discarded groups per step 2, 4, 32, 55, 192, 501, 706, 3,561
    while the token entropy fell 0.18 -> 0.04 and the step grew from 21 s to 306 s)."""
    fg = "algorithm.filter_groups"
    most = get(tree, f"{fg}.max_num_gen_batches") or 0
    train_bs = get(tree, "data.train_batch_size")
    gen_bs = get(tree, "data.gen_batch_size") or train_bs
    if not all(isinstance(x, int) for x in (most, train_bs, gen_bs)):
        log.warning("train: the collapse guard needs the batch sizes and max_num_gen_batches as numbers; off")
        return None
    if not get(tree, f"{fg}.enable") or most <= 0:
        return None
    n = get(tree, "actor_rollout_ref.rollout.n")
    limit = most * gen_bs

    def check(rec: dict) -> str | None:
        evicted = rec.get(EVICTED_KEY)
        if evicted is None or evicted + train_bs <= limit:
            return None
        entropy = rec.get("actor/entropy")
        return (f"step {rec['step']}: dynamic sampling discarded {int(evicted)} prompt groups whose "
                f"{n} samples all scored the same to fill {train_bs}, more than "
                f"max_num_gen_batches x gen_batch_size = {most} x {gen_bs} = {limit} "
                f"prompts: the policy has collapsed"
                + (f" (actor/entropy {entropy:.3f})" if entropy is not None else "")
                + ". Training stops here; the checkpoints saved so far are kept. To go on: lower "
                  "verl.actor_rollout_ref.actor.optim.lr, raise verl.actor_rollout_ref.actor.entropy_coeff, or "
                  f"set verl.{fg}.max_num_gen_batches=0 (no limit)")
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
    metric line goes to ``sink`` (:class:`memsifter.training.trainmetrics.MetricsSink`). ``guard`` sees each
    step's metrics; when it gives a reason, verl is stopped after that step and the reason returned
    (None: verl ran to its end). ``cmd`` replaces verl's command line (tests)."""
    from ..training.trainmetrics import parse_line

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
    from ..training import trainmetrics

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
    lines = override_lines(config)
    overrides = verl_overrides(config, [f"{p['data']}/{f}" for f in train], [f"{p['data']}/{f}" for f in test],
                               lines, remote=True)
    verl = settings(config, lines)
    composed = compose(config, overrides)
    ckpt_uri = checkpoint_uri(config)
    steps = complete_steps(ckpt_uri)
    resume = steps[-1] if steps and verl.get("trainer.resume_mode") == "auto" else None
    if resume is not None:
        check_resume_world_size(config, ckpt_uri, resume)
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
    from ..training.trainmetrics import MetricsSink

    # verl's per-step metrics, kept under the output as they come (they outlive the pod; a resumed
    # run continues the curves)
    sink = MetricsSink(storage.join(out.work, "metrics.jsonl"))
    stopped = _run_verl(overrides, sink, collapse_guard(verl.tree))
    steps = complete_steps(ckpt_uri)
    out.write_text("verl_config.yaml", composed)
    out.write_text("overrides.txt", "\n".join(overrides) + "\n")
    out.write_json("checkpoints.json", {"uri": ckpt_uri, "steps": steps})
    metrics = publish_metrics(out, sink, f"{config.experiment_name}: {config.model}, reward {config.reward.mode}")
    return {"checkpoint_uri": ckpt_uri, "complete_steps": steps, "resumed_from": resume, "nodes": len(staged),
            "placement": placement_request(config), "metrics": metrics,
            **({"stopped_early": {"reason": stopped, "last_complete_step": steps[-1] if steps else None}}
               if stopped else {})}
