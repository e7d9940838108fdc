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

Where the code is: this module holds the config and the run; verl's settings engine is
:mod:`memsifter.training.verl_settings`, the config as verl's overrides and the dry-run compose
:mod:`memsifter.training.verl_config`, the checkpoints in S3 :mod:`memsifter.training.checkpoints` and
the Ray nodes :mod:`memsifter.training.placement`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..errors import ConfigError
from ..stage import StageConfig, runtime_field, stage, uri_field
from ..store import storage
from ..training.checkpoints import (ENV_STEP_OFFSET, check_resume_world_size, checkpoint_world_size, complete_steps,
                                    record_base, restore_step)
from ..training.placement import _ray_connected, on_every_node, placement_request, wait_for_gpu_nodes
from ..training.reward_settings import RewardSettings
from ..training.verl_config import (adapter_source, check_loggers, checkpoint_uri, compose, data_files, dry_run,
                                    local_paths, verl_overrides)
from ..training.verl_settings import _flow, from_dapo, get, override_lines, settings
# Names tests and benchmarks outside the stage's area import from here (they live in memsifter/training)
from ..training.checkpoints import COMPLETE_MARKER, TRACKER, mark_complete, sync_checkpoint  # noqa: F401
from ..training.verl_config import agent_names, validate_composed  # noqa: F401
from ..training.verl_settings import merged  # noqa: F401

log = logging.getLogger(__name__)


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
    evidence_score: float = Field(0.0, ge=0, le=1, description="weight g of the evidence term: reward = "
                                  "(1 - f - g) x metric + f x format + g x (a gold session was among the sessions "
                                  "the episode was shown: search hits, chunks); 0: off")

    @model_validator(mode="after")
    def _weights(self) -> "AgentTraining":
        if self.format_score + self.evidence_score > 1:
            raise ValueError(f"format_score + evidence_score = {self.format_score + self.evidence_score:g}: at most 1 "
                             "(the answer's weight is 1 - format_score - evidence_score)")
        return self


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
    resume_other_size: Literal["weights", "refuse"] = Field(
        "weights", description="when the newest checkpoint was written by another GPU count (an autoscaled pool "
        "that shrank or grew; verl 0.9.1 reloads FSDP shards only at the size that wrote them): weights = collect "
        "that step's weights and go on from them for the steps left (a fresh optimizer; the step count continues; "
        "recorded as `resized` in the run's report); refuse = stop in one line", json_schema_extra={"runtime": True})
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


def resize_start(config: TrainConfig, ckpt_uri: str, step: int, written: int, work: str) -> tuple[TrainConfig, dict]:
    """Go on from checkpoint ``step``, written by ``written`` GPU processes, on this config's GPU count: its weights
    (``collect``: the model, or a LoRA run's adapter) become the run's start, verl starts without resuming
    (``resume_mode: disable``: a fresh optimizer and data order) for the steps left, and its steps and checkpoints
    are numbered on from ``step`` (``MEMSIFTER_STEP_OFFSET``: the checkpoint callback uploads step k as
    ``step + k``; the metrics continue the curves). A later resume at this size is an ordinary one."""
    verl = settings(config, override_lines(config))
    total = verl.get("trainer.total_training_steps")
    now = config.nnodes * config.n_gpus_per_node
    if not isinstance(total, int) or isinstance(total, bool) or total <= step:
        raise ConfigError(f"train: resuming step {step} (written by {written} GPU processes) on {now} needs "
                          f"verl.trainer.total_training_steps set above {step} (the run goes on for the steps left; "
                          f"it is {total!r}), or resume_other_size: refuse")
    dest = storage.join(work, f"resized-from-{step}")
    if not storage.exists(storage.join(dest, storage.MANIFEST)):
        cmd = [sys.executable, "-m", "memsifter.cli", "run", "collect", "--checkpoints", ckpt_uri, "--steps",
               str(step), "--output", dest, "-q"]
        log.info("train: step %d was written by %d GPU processes and this run has %d: collecting its weights -> %s",
                 step, written, now, dest)
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            tail = (r.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise RuntimeError(f"train: collecting step {step} to go on at another size failed: {tail}")
    weights = storage.join(dest, f"global_step_{step}")
    adapter = storage.join(weights, "adapter")
    lora = storage.exists(storage.join(adapter, "adapter_config.json"))
    update: dict[str, Any] = {"init_adapter": adapter} if lora else {"model": weights}
    extra = {"trainer.resume_mode": "disable", "trainer.total_training_steps": total - step,
             f"ray_kwargs.ray_init.runtime_env.env_vars.{ENV_STEP_OFFSET}": str(step)}
    resized = TrainConfig(**{**config.model_dump(), **update,
                             "verl": _merge_verl(config.verl, extra)})
    record = {"from_step": step, "written_by_gpus": written, "gpus": now, "start": adapter if lora else weights,
              "what": "adapter" if lora else "model", "steps_left": total - step,
              "optimizer": "fresh: verl 0.9.1 reloads optimizer shards only at the size that wrote them",
              "data": "a fresh data order from the first batch (verl's dataloader state is not carried)"}
    return resized, record


def _merge_verl(block: dict, extra: dict) -> dict:
    from ..training.verl_settings import _merge, expand

    return _merge(expand(block or {}), expand(extra))


@stage("train", TrainConfig, family="train", gpus=8, preview=preview,
       help="DAPO training of the ranker with verl (checkpoints to S3, resume from S3; --dry-run composes only)")
def run(config: TrainConfig, out: storage.Publication) -> dict:
    ckpt_uri = checkpoint_uri(config)
    steps = complete_steps(ckpt_uri)
    verl = settings(config, override_lines(config))
    resume = steps[-1] if steps and verl.get("trainer.resume_mode") == "auto" else None
    resized = None
    if resume is not None:
        written = checkpoint_world_size(ckpt_uri, resume)
        if written is not None and written != config.nnodes * config.n_gpus_per_node \
                and config.resume_other_size == "weights":
            config, resized = resize_start(config, ckpt_uri, resume, written, out.work)
            resume = None
        else:
            check_resume_world_size(config, ckpt_uri, resume)
    train, test = data_files(config)
    p = local_paths(config)
    lines = override_lines(config)
    overrides = verl_overrides(config, [f"{p['data']}/{f}" for f in train], [f"{p['data']}/{f}" for f in test],
                               lines, remote=True)
    verl = settings(config, lines)
    composed = compose(config, overrides)
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
    if resized:
        log.info("staged on %d node(s); going on from step %d's %s (written by %d GPU processes, now %d) for %d "
                 "step(s), a fresh optimizer", len(staged), resized["from_step"], resized["what"],
                 resized["written_by_gpus"], resized["gpus"], resized["steps_left"])
    else:
        log.info("staged on %d node(s); resuming from step %s", len(staged), resume)
    from ..training.trainmetrics import MetricsSink

    # verl's per-step metrics, kept under the output as they come (they outlive the pod; a resumed
    # run continues the curves)
    sink = MetricsSink(storage.join(out.work, "metrics.jsonl"), offset=resized["from_step"] if resized else 0)
    record_base(ckpt_uri, config.model, config.init_adapter)
    stopped = _run_verl(overrides, sink, collapse_guard(verl.tree))
    steps = complete_steps(ckpt_uri)
    out.write_text("verl_config.yaml", composed)
    out.write_text("overrides.txt", "\n".join(overrides) + "\n")
    out.write_json("checkpoints.json", {"uri": ckpt_uri, "steps": steps})
    metrics = publish_metrics(out, sink, f"{config.experiment_name}: {config.model}, reward {config.reward.mode}")
    return {"checkpoint_uri": ckpt_uri, "complete_steps": steps, "resumed_from": resume, "nodes": len(staged),
            **({"resized": resized} if resized else {}),
            "placement": placement_request(config), "metrics": metrics,
            **({"stopped_early": {"reason": stopped, "last_complete_step": steps[-1] if steps else None}}
               if stopped else {})}
