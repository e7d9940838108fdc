"""Issue 35, what the CPUs allow: multi-GPU training shaped for 2 nodes x 4 GPUs, without GPUs.

* verl 0.9.1's config, composed with its own Hydra (``ppo_trainer``) from the train stage's real override
  list (``verl_overrides``), for rollout tensor parallel 1 and 2, LoRA and full fine-tuning, passes verl's
  own checks that run without GPUs (``validate_config`` with the actor's dataclass ``validate(n_gpus=8)``,
  and the rollout / FSDP engine dataclasses' ``__post_init__``).
* The placement groups verl's resource pool makes for 2 x 4 GPUs (one STRICT_PACK group per node of 4
  ``{"CPU": 3, "GPU": 1}`` bundles, the train stage's ``placement_request``) become ready on a local
  two-node Ray cluster with fake GPUs, one group per node; with one of the nodes gone, the entrypoint's
  capacity wait (``memsifter k8s await-capacity``) refuses in one line and verl's own resource check
  refuses before creating any group.
* The chart rendered for 2 x 4 GPUs (real helm): the GPU worker group, autoscaled from 0 (the default) or
  fixed at 2 replicas, has 4 ``nvidia.com/gpu`` per pod, validates against the KubeRay RayJob CRD
  (``../shared/crds``; skipped without it), and the entrypoint's config document carries nnodes 2 and
  n_gpus_per_node 4 through to verl's overrides.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import tempfile
import time
from functools import partial

import pytest

from memsifter import stage as stg
from memsifter.k8s import capacity, registry
from memsifter.k8s import validate
from memsifter.k8s.plan import chart_plan
from memsifter_dev.k8s import chart
from memsifter.stages import train
from memsifter.stages.train import TrainConfig, placement_request, verl_overrides
from memsifter.testing.servers import RAY_ENV, env_vars

NODES, GPN = 2, 4
WORLD = NODES * GPN
TRAIN_FILES, VAL_FILES = ["/scratch/data/train_00000.parquet"], ["/scratch/data/test.parquet"]


def config_2x4(tp: int, lora_rank: int) -> TrainConfig:
    return TrainConfig(output="s3://b/runs/r/train", data="s3://b/runs/r/prepare-rl", nnodes=NODES,
                       n_gpus_per_node=GPN, model="/models/base", local_dir="/scratch", reward={"mode": "dcg"},
                       verl={"actor_rollout_ref": {"rollout": {"tensor_model_parallel_size": tp},
                                                   "model": {"lora_rank": lora_rank}}})


# --------------------------------------------------------------------------- 1. verl's config for 2 x 4
@pytest.mark.parametrize("lora_rank", [0, 16], ids=["full", "lora"])
@pytest.mark.parametrize("tp", [1, 2])
def test_verl_config_composed_for_two_nodes_of_four_gpus(tp, lora_rank):
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import FSDPActorConfig, FSDPEngineConfig, RolloutConfig

    cfg = config_2x4(tp, lora_rank)
    overrides = verl_overrides(cfg, TRAIN_FILES, VAL_FILES)
    assert f"trainer.nnodes={NODES}" in overrides and f"trainer.n_gpus_per_node={GPN}" in overrides
    text = train.compose(cfg, overrides, in_process=True)   # verl's Hydra: an unknown key fails here
    c = train.validate_composed(text)                       # verl's validate_config (n_gpus = 8)
    t, arr = c.trainer, c.actor_rollout_ref
    a, ref, r, m = arr.actor, arr.ref, arr.rollout, arr.model
    assert (t.nnodes, t.n_gpus_per_node) == (NODES, GPN)

    # FSDP: verl's FSDP1 actor sharded over every rank (fsdp_size -1 = the whole world of 8), offloaded;
    # Ulysses 2 splits the 8 ranks into 4 data-parallel groups; the reference model follows the actor
    assert a.strategy == "fsdp" and ref.strategy == "fsdp"
    assert a.fsdp_config.fsdp_size == -1 and a.fsdp_config.param_offload and a.fsdp_config.optimizer_offload
    assert ref.fsdp_config.param_offload is True
    assert a.ulysses_sequence_parallel_size == ref.ulysses_sequence_parallel_size == 2
    assert WORLD % a.ulysses_sequence_parallel_size == 0 and m.use_remove_padding is True
    actor = omega_conf_to_dataclass(a)  # verl's FSDPActorConfig and its FSDPEngineConfig (__post_init__ checks)
    assert isinstance(actor, FSDPActorConfig) and isinstance(actor.fsdp_config, FSDPEngineConfig)
    assert actor.fsdp_config.strategy == "fsdp" and actor.fsdp_config.fsdp_size == -1

    # rollout: vLLM async servers of TP `tp` inside each node; verl's LLM server manager starts
    # world // (tp * dp * pp) replicas (workers/rollout/llm_server.py) and each replica's world must fit
    # its node (RolloutReplica.__init__)
    rc = omega_conf_to_dataclass(r, RolloutConfig)
    assert isinstance(rc, RolloutConfig) and rc.name == "vllm" and rc.mode == "async"
    assert rc.tensor_model_parallel_size == tp and rc.data_parallel_size == 1 and rc.pipeline_model_parallel_size == 1
    assert rc.n_gpus_per_node == GPN
    replica_world = rc.tensor_model_parallel_size * rc.data_parallel_size * rc.pipeline_model_parallel_size
    assert WORLD % replica_world == 0 and replica_world % min(GPN, replica_world) == 0
    assert WORLD // replica_world == {1: 8, 2: 4}[tp]

    # LoRA: only the adapter trains; the actor sends merged weights to vLLM (safetensors load format)
    if lora_rank:
        assert m.lora_rank == lora_rank and m.lora.merge is True and r.load_format == "safetensors"
    else:  # verl's own defaults: whole weights, no merge step
        set_keys = {o.split("=", 1)[0].lstrip("+") for o in overrides}
        assert m.lora_rank == 0 and not {"actor_rollout_ref.model.lora.merge",
                                         "actor_rollout_ref.rollout.load_format"} & set_keys
    # the batch reaches every rank: 16 prompts x 6 samples over 8 GPUs, minibatch 16 >= world / Ulysses
    assert (c.data.train_batch_size * r.n) % WORLD == 0


# --------------------------------------------------------------------------- 2. placement on Ray
@pytest.fixture(scope="module")
def two_gpu_nodes():
    """A local Ray cluster of two nodes, each with 4 fake GPUs and 12 CPUs (3 per GPU: verl's
    max_colocate_count), as two chart worker pods of 4 GPUs; the driver is connected to it."""
    import ray
    from ray.cluster_utils import Cluster

    # no idle worker processes (this machine's cores are shared); small object stores
    node = {"num_cpus": 3 * GPN, "num_gpus": GPN, "object_store_memory": 80 * 1024 ** 2}
    system = {"enable_worker_prestart": False, "prestart_worker_first_driver": False}
    tmp = tempfile.mkdtemp(prefix="mg", dir="/tmp")
    # Cluster records its address in the default temp root (RAY_TMPDIR/ray), whatever the nodes' temp_dir: under
    # a fresh RAY_TMPDIR (CI gives each pytest process one) nothing has created that folder yet
    from ray._private.utils import get_ray_address_file

    os.makedirs(os.path.dirname(get_ray_address_file(None)), exist_ok=True)
    with env_vars(RAY_ENV):
        cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False,
                                                                 "_system_config": system, "temp_dir": tmp})
        try:
            second = cluster.add_node(**node)
            cluster.wait_for_nodes()
            ray.init(address=cluster.address, log_to_driver=False)
            yield cluster, second
        finally:
            with contextlib.suppress(Exception):
                ray.shutdown()
            cluster.shutdown()
            shutil.rmtree(tmp, ignore_errors=True)


def _pg_nodes(pg) -> set[str]:
    import ray

    return set(ray.util.placement_group_table(pg)["bundles_to_node_id"].values())


def test_placement_groups_for_two_nodes_of_four_gpus_schedule_then_a_missing_node_is_refused(two_gpu_nodes, capsys):
    import ray
    from verl.single_controller.ray.base import ResourcePoolManager

    cluster, second = two_gpu_nodes
    req = placement_request(config_2x4(1, 0))
    assert req["total_gpus"] == WORLD and len(req["placement_groups"]) == NODES

    # verl's own resource pool, as its trainer builds it ({"global_pool": [n_gpus_per_node] * nnodes},
    # max_colocate_count 3): its resource check passes, then its placement groups become ready
    mgr = ResourcePoolManager(resource_pool_spec={"global_pool": [GPN] * NODES}, mapping={})
    assert mgr.max_colocate_count == 3 and mgr.get_n_gpus() == WORLD
    mgr.create_resource_pool()
    pgs = mgr.resource_pool_dict["global_pool"].get_placement_groups(device_name="cuda")
    try:
        assert len(pgs) == NODES
        for pg, want in zip(pgs, req["placement_groups"]):
            table = ray.util.placement_group_table(pg)
            assert table["state"] == "CREATED" and table["strategy"] == want["strategy"] == "STRICT_PACK"
            assert [dict(b) for b in table["bundles"].values()] == [{k: float(v) for k, v in b.items()}
                                                                   for b in want["bundles"]]
        # STRICT_PACK: each group on one node; the two groups on the two nodes
        homes = [_pg_nodes(pg) for pg in pgs]
        assert all(len(h) == 1 for h in homes) and len(set.union(*homes)) == NODES
        # both nodes' GPUs are all taken; a third group of a node's shape cannot be placed
        assert ray.available_resources().get("GPU", 0) == 0
        extra = ray.util.placement_group([{"CPU": 3, "GPU": 1}] * GPN, strategy="STRICT_PACK")
        assert not extra.wait(timeout_seconds=2)
        ray.util.remove_placement_group(extra)
    finally:
        for pg in pgs:
            ray.util.remove_placement_group(pg)

    # the same request with one node of 4 GPUs left (2 x 4 asked, 1 x 4 present)
    cluster.remove_node(second)
    deadline = time.time() + 60
    while capacity.gpu_nodes(GPN, 3 * GPN) != 1 and time.time() < deadline:
        time.sleep(0.5)
    assert capacity.gpu_nodes(GPN, 3 * GPN) == 1
    # the RayJob entrypoint's capacity wait: exit 1, one line, before the stage (and verl) starts
    capsys.readouterr()
    rc = capacity.main(["--nodes", str(NODES), "--gpus-per-node", str(GPN), "--timeout", "1", "--poll", "0.2",
                        "--", "false"])
    # (log records, when an earlier test configured logging to stderr, are not the message)
    err = "\n".join(ln for ln in capsys.readouterr().err.strip().splitlines() if " INFO " not in ln)
    assert rc == 1 and len(err.splitlines()) == 1
    assert err.startswith(f"error: only 1 of {NODES} GPU node(s) with {GPN} GPUs joined")
    # the train stage's own wait reports 1 node (it logs a warning and goes on: verl's check refuses)
    assert train.wait_for_gpu_nodes(NODES, GPN, timeout=0) == 1
    small = ResourcePoolManager(resource_pool_spec={"global_pool": [GPN] * NODES}, mapping={})
    with pytest.raises(ValueError, match=f"Total available GPUs {GPN}.* less than total desired GPUs {WORLD}"):
        small.create_resource_pool()
    assert all(v["state"] == "REMOVED" for v in ray.util.placement_group_table().values())  # none created


# --------------------------------------------------------------------------- 3. the chart for 2 x 4
@pytest.fixture(scope="module")
def crd(shared_dir):
    return validate.crd_schema(shared_dir / "crds" / "ray.io_rayjobs.yaml")


def _render_train(*more: str) -> tuple[dict, dict]:
    """The train stage's RayJob and config document, rendered with the jobs/ example values for 2 x 4."""
    info = next(i for i in registry.stage_infos() if i.name == "train")
    assert info.capacity == {"nodes": "nnodes", "gpusPerNode": "n_gpus_per_node"}
    plan = chart_plan({"run": "s3://my-bucket/runs/example", "stages": {"train": {
        "nnodes": NODES, "n_gpus_per_node": GPN, "data": "s3://my-bucket/runs/earlier/prepare-rl"}}})
    docs = chart.render_docs([chart.JOBS_DIR / "values.yaml"], [f"stages.train.workers.gpus={GPN}", *more],
                             values={"pipeline": plan},
                             show_only=["templates/configmaps.yaml", "templates/rayjobs.yaml"])
    (rj,) = [d for d in docs if d["kind"] == "RayJob"]
    return rj, chart.stage_config(docs, rj)


@pytest.mark.parametrize("mode", ["autoscaled", "fixed"])
def test_chart_worker_groups_for_two_nodes_of_four_gpus(mode, crd):
    fixed = ["stages.train.workers.autoscaling=false", f"stages.train.workers.replicas={NODES}",
             f"stages.train.workers.minReplicas={NODES}", f"stages.train.workers.maxReplicas={NODES}"]
    rj, doc = _render_train(*(fixed if mode == "fixed" else []))
    assert validate.validate_rayjob(rj, crd) == []
    rcs = rj["spec"]["rayClusterSpec"]
    (wg,) = rcs["workerGroupSpecs"]
    sizes = (wg["replicas"], wg["minReplicas"], wg["maxReplicas"])
    if mode == "fixed":  # two worker pods from the start, no autoscaler
        assert sizes == (NODES, NODES, NODES) and rcs["enableInTreeAutoscaling"] is False
    else:  # scales from 0 to the nodes the stage asks for (the chart's default for multi-node stages)
        assert sizes == (0, 0, NODES) and rcs["enableInTreeAutoscaling"] is True
    assert wg["groupName"] == "gpu"
    (ctr,) = wg["template"]["spec"]["containers"]
    assert ctr["resources"]["limits"]["nvidia.com/gpu"] == GPN
    # one pod holds one node's placement group: 4 GPUs and 3 CPUs per GPU
    req = placement_request(stg.validate_config("train", doc))
    assert float(ctr["resources"]["requests"]["cpu"]) >= req["per_gpu_node"]["CPU"] == 3 * GPN

    # the entrypoint: await-capacity for 2 nodes of 4 GPUs, then the stage on the mounted config document,
    # which carries the same nnodes / n_gpus_per_node into verl's overrides
    words = shlex.split(validate.submitted_entrypoint(rj["spec"]["entrypoint"]))
    assert words[:7] == ["memsifter", "k8s", "await-capacity", "--nodes", str(NODES), "--gpus-per-node", str(GPN)]
    assert words[words.index("--") + 1:] == ["memsifter", "run", "train", "--config", "/etc/memsifter/train.yaml"]
    assert (doc["nnodes"], doc["n_gpus_per_node"]) == (NODES, GPN)
    cfg = stg.validate_config("train", doc)
    assert (cfg.nnodes, cfg.n_gpus_per_node) == (NODES, GPN)
    ov = verl_overrides(cfg, TRAIN_FILES, VAL_FILES)
    assert f"trainer.nnodes={NODES}" in ov and f"trainer.n_gpus_per_node={GPN}" in ov


def test_chart_gpu_group_fits_the_placement_groups_per_ray_autoscaler():
    """Ray's own KubeRay conversion and resource-demand scheduler: the two STRICT_PACK groups of the
    rendered 2 x 4 job need exactly two GPU worker pods, from zero."""
    from ray.autoscaler._private.kuberay.autoscaling_config import _derive_autoscaling_config_from_ray_cr
    from ray.autoscaler._private.node_provider_availability_tracker import NodeAvailabilitySummary
    from ray.autoscaler._private.resource_demand_scheduler import _default_utilization_scorer, get_nodes_for

    rj, doc = _render_train()
    auto = _derive_autoscaling_config_from_ray_cr({"metadata": {"name": "c", "namespace": "ns"},
                                                   "spec": rj["spec"]["rayClusterSpec"]})
    types = auto["available_node_types"]
    assert types["gpu"]["resources"]["GPU"] == GPN and types["gpu"]["min_workers"] == 0
    req = placement_request(stg.validate_config("train", doc))
    demands = [{k: float(sum(b[k] for b in pg["bundles"])) for k in pg["bundles"][0]} for pg in req["placement_groups"]]
    scorer = partial(_default_utilization_scorer, node_availability_summary=NodeAvailabilitySummary({}))
    to_add, residual = get_nodes_for(types, {"headgroup": 1}, "headgroup", auto["max_workers"], demands, scorer)
    assert residual == [] and dict(to_add) == {"gpu": NODES}


@pytest.mark.parametrize("name", sorted(p.name for p in (chart.REPO / "memsifter" / "configs").glob("train_4b_*.yaml")))
def test_chart_renders_each_committed_4b_train_config_as_a_valid_rayjob(name, crd):
    """Issue 43 item 7: each committed 4B train config, given to the chart as the train section of a plan, renders a
    RayJob valid against the KubeRay CRD; its GPU worker pods and the entrypoint's await-capacity ask for the
    config's nodes and GPUs, and the mounted config document is the file's (its verl block included)."""
    import yaml

    doc_in = yaml.safe_load(open(chart.REPO / "memsifter" / "configs" / name))
    nodes, gpn = doc_in.get("nnodes", 1), doc_in["n_gpus_per_node"]
    section = {k: v for k, v in doc_in.items() if k not in ("output",)}
    plan = chart_plan({"run": "s3://my-bucket/runs/example", "stages": {"train": section}})
    docs = chart.render_docs([chart.JOBS_DIR / "values.yaml"], [f"stages.train.workers.gpus={gpn}"],
                             values={"pipeline": plan},
                             show_only=["templates/configmaps.yaml", "templates/rayjobs.yaml"])
    (rj,) = [d for d in docs if d["kind"] == "RayJob"]
    assert validate.validate_rayjob(rj, crd) == []
    (wg,) = rj["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    (ctr,) = wg["template"]["spec"]["containers"]
    assert ctr["resources"]["limits"]["nvidia.com/gpu"] == gpn and wg["maxReplicas"] == nodes
    words = shlex.split(validate.submitted_entrypoint(rj["spec"]["entrypoint"]))
    assert words[:7] == ["memsifter", "k8s", "await-capacity", "--nodes", str(nodes), "--gpus-per-node", str(gpn)]
    doc = chart.stage_config(docs, rj)
    assert (doc["nnodes"], doc["n_gpus_per_node"]) == (nodes, gpn) and doc["verl"] == doc_in["verl"]
    stg.validate_config("train", doc)


def test_values_helm_reads_keep_one_letter_keys_and_exponent_floats():
    """helm reads values as YAML 1.1 in Go: a plain `n` key is the boolean false there, and it writes a float as
    `2e-05`, which PyYAML alone reads as a string. The plan's values file quotes such words (helmyaml), and a stage
    reads `2e-05` as a float (stage.ConfigLoader); the chart test above renders through real helm."""
    import yaml

    from memsifter.k8s import helmyaml
    from memsifter.k8s.plan import values_text

    text = values_text({"run": "s3://b/r", "steps": [{"name": "train", "stage": "train", "config": {
        "verl": {"actor_rollout_ref": {"rollout": {"n": 4}}}, "y": "n", "on": True, "note": "no"}}]})
    assert "'n': 4" in text and "'y': 'n'" in text and "note: 'no'" in text
    assert yaml.safe_load(text)["pipeline"]["steps"][0]["config"]["verl"]["actor_rollout_ref"]["rollout"] == {"n": 4}
    assert helmyaml.GO_YAML_BOOLS >= {"y", "Y", "n", "N", "yes", "NO", "On", "off"}
    assert yaml.load("lr: 2e-05\nx: 1.5e3\nid: 2e5x\n", Loader=stg.ConfigLoader) == {"lr": 2e-05, "x": 1500.0, "id": "2e5x"}
