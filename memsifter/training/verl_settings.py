"""verl's settings for the train stage, in verl's own key names (:mod:`memsifter.stages.train` tells
the whole story).

The platform's DAPO recipe (``memsifter/configs/verl/dapo.yaml``) with the config's ``verl:`` block
merged over it (nested or dotted keys, :func:`expand`, :func:`merged`), then the user's Hydra override
lines (``verl_overrides_file``, ``extra_overrides``) folded in (:func:`settings`): each key checked
against verl's composed config (:func:`verl_schema`, :func:`check_key`: a typo is one line with a
suggestion), keys the train config's own fields set refused naming the field (:data:`OWNED`), and the
checks across keys on the merged values (:func:`check_settings`, :func:`attention`). The former
``dapo:`` section's names map to verl's by ``memsifter/configs/verl/legacy_dapo.yaml``
(:func:`from_dapo`). ``config`` arguments are train configs (:class:`memsifter.stages.train.TrainConfig`).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import os
from collections.abc import Iterator, Mapping
from typing import Any

from ..errors import ConfigError
from ..stage import suggest
from ..store import storage
from .checkpoints import ENV_CHECKPOINT_URI

log = logging.getLogger("memsifter.stages.train")   # the train stage's warnings

RECIPE = ("configs", "verl", "dapo.yaml")  # the platform's DAPO recipe, in verl's key names
LEGACY = ("configs", "verl", "legacy_dapo.yaml")  # the former `dapo:` names -> verl's (migration only)
ATTENTION = ("auto", "flash_attention_2", "flash_attention_4", "sdpa", "eager")
# varlen attentions (remove padding, Ulysses) -> the PyPI distribution that provides each (both install `flash_attn`)
VARLEN = {"flash_attention_2": "flash-attn", "flash_attention_4": "flash-attn-4"}
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


def override_lines(config: Any) -> list[str]:
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


def settings(config: Any, file_lines: list[str] | None = None) -> VerlSettings:
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


# Set in every memsifter image (images/base/Dockerfile): the environment is the one a stage's workers run in.
IMAGE_ENV = "MEMSIFTER_IMAGE"


def flash_packages() -> set[str]:
    """The varlen attentions (:data:`VARLEN`) whose package is installed here: flash-attn 2 (``flash-attn``) and
    FlashAttention-4 (``flash-attn-4``) both install the ``flash_attn`` package, so the distributions recorded tell
    them apart (as transformers does); an importable ``flash_attn`` without either record counts as flash-attn 2."""
    import importlib.util
    from importlib import metadata

    if importlib.util.find_spec("flash_attn") is None:
        return set()
    found = set()
    for impl, dist in VARLEN.items():
        try:
            metadata.distribution(dist)
        except metadata.PackageNotFoundError:
            continue
        found.add(impl)
    return found or {"flash_attention_2"}


def attention(s: VerlSettings) -> tuple[str, bool]:
    """(attn_implementation, use_remove_padding) for the FSDP actor and ref, from
    ``verl.actor_rollout_ref.model.override_config.attn_implementation`` (unset or ``auto``: chosen here).

    verl 0.9.1 loads the model with ``flash_attention_2`` unless ``model.override_config`` says
    otherwise, and transformers refuses that without the ``flash-attn`` package (seen on the first
    real run, an H100 without it). Remove-padding packs a micro-batch into one sequence, which we only
    trust to flash attention's varlen kernels: flash-attn 2 (``flash_attention_2``, PyPI ``flash-attn``) or
    FlashAttention-4 (``flash_attention_4``, PyPI ``flash-attn-4``, Hopper and Blackwell; transformers' calls reach it
    through :func:`memsifter.training.verl_patches.install_fa4`). ``auto`` takes flash-attn 2 where it is installed,
    else FA4 where that is (:func:`flash_packages`); without either the actor runs SDPA on padded batches (slower,
    same result). Ulysses sequence parallelism needs remove-padding, so ``auto`` keeps ``flash_attention_2`` when
    it is asked for (the pods' image must then carry flash-attn). A varlen attention whose package is missing is
    a ConfigError inside a memsifter image (``MEMSIFTER_IMAGE``: this environment is the actor's), else a warning.
    """
    key = "actor_rollout_ref.actor.ulysses_sequence_parallel_size"
    sp = s.get(key)
    sp = sp if isinstance(sp, int) and not isinstance(sp, bool) else 1
    impl = s.get(ATTN_KEY) or "auto"
    have = flash_packages()
    if impl == "auto":
        impl = ("flash_attention_2" if "flash_attention_2" in have else "flash_attention_4"
                if "flash_attention_4" in have else "flash_attention_2" if sp > 1 else "sdpa")
    if impl in VARLEN and impl not in have:
        pkg = VARLEN[impl]
        why = f"verl.{key}={sp}" if sp > 1 and impl == "flash_attention_2" else f"verl.{ATTN_KEY}={impl}"
        other = next((i for i in VARLEN if i != impl and i in have), None)
        hint = f" ({VARLEN[other]} is installed here: verl.{ATTN_KEY}={other} uses it)" if other else ""
        if os.environ.get(IMAGE_ENV):
            # inside a memsifter image (the RayJob's, or `docker run IMAGE memsifter run train --dry-run`): this
            # environment is the one the actor runs in, and it cannot run the recipe
            if impl == "flash_attention_2":
                raise ConfigError(f"train: {why} needs flash-attn (flash_attention_2, varlen kernels), which this "
                                  f"image does not carry: use the memsifter train image (images/train/Dockerfile "
                                  f"builds it) or set verl.{key}=1 (SDPA on padded rows){hint}")
            raise ConfigError(f"train: {why} needs flash-attn-4 (flash_attention_4, varlen kernels), which this image "
                              f"does not carry: install flash-attn-4 in the image or set verl.{ATTN_KEY} to auto or "
                              f"flash_attention_2{hint}")
        if impl == "flash_attention_2":
            log.warning("train: flash-attn is not installed here, but %s needs flash_attention_2: the GPU pods' "
                        "image must carry flash-attn (the memsifter train image does), or set verl.%s=1 for SDPA%s",
                        why, key, hint)
        else:
            log.warning("train: flash-attn-4 is not installed here, but %s needs flash_attention_4: the GPU pods' "
                        "image must carry flash-attn-4 (the memsifter train image carries flash-attn 2 only), or set "
                        "verl.%s to auto or flash_attention_2%s", why, ATTN_KEY, hint)
    if impl not in VARLEN and sp > 1:
        raise ConfigError(f"train: verl.{key}={sp} needs flash_attention_2 or flash_attention_4 (remove padding), "
                          f"not {impl!r} (verl.{ATTN_KEY})")
    remove_padding = s.get("actor_rollout_ref.model.use_remove_padding")
    if remove_padding is None:
        remove_padding = impl in VARLEN
    elif not remove_padding and sp > 1:
        raise ConfigError(f"train: verl.{key}={sp} needs verl.actor_rollout_ref.model.use_remove_padding: true")
    return impl, remove_padding
