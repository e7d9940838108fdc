"""The rendered RayJobs run for real on a local Ray cluster, against SeaweedFS.

The chart is rendered with `helm template` for every registered stage (tiny configs: test data, the
tiny local models, the vLLM CPU endpoint); the plan it puts in the driver's ConfigMap is then run by
the real driver (`memsifter.k8s.driver`) whose backend submits each RayJob's *exact* entrypoint (after
the round trip through KubeRay's submitter shell and `ray job submit`) and runtime env, plus the head
container's env, to a Ray head with JobSubmissionClient; the `--config` file the head pod mounts from the
stage's ConfigMap is the plan's copy of that document, written to a local file. Every job must SUCCEED and publish; a second
driver run skips everything (resume). The training stage runs its `--dry-run`-style config (verl
composes and validates its config; a real DAPO step needs GPUs), behind `await-capacity`, on a head
that advertises logical GPUs shaped like one chart worker pod, where verl's own resource pool creates
its placement group.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import subprocess
import sys
import tempfile
import time
import typing
import uuid
from pathlib import Path

import pytest

from memsifter import stage as stg
from memsifter.store import storage
from memsifter.k8s import registry
from memsifter.k8s import validate
from memsifter_dev.k8s import chart
from memsifter.k8s.driver import Driver, Plan, RayBackend
from memsifter.k8s.plan import chart_plan
from memsifter.testing.servers import RAY_ENV, _kill_matching, _wait_port, env_vars, free_port

pytestmark = pytest.mark.slow

GPUS, CPUS = 2, 6  # one "worker pod" of the chart for the training stage: GPUs and 3 CPUs per GPU
# A token in ~/.ray/auth_token (written by any earlier local ray.init) switches `ray start --head` to token
# auth, which job clients here do not send: this cluster runs without it.
LOCAL_RAY_ENV = {**RAY_ENV, "RAY_AUTH_MODE": "disabled"}


# where a pod's writable mounts are (read-only root filesystem): locations, not behaviour; the local
# head keeps this machine's own
CACHE_LOCATIONS = ("HOME", "HF_HOME", "XDG_CACHE_HOME", "TRITON_CACHE_DIR", "VLLM_CACHE_ROOT",
                   "TORCHINDUCTOR_CACHE_DIR", "MPLCONFIGDIR")


@pytest.fixture(scope="module")
def pod_env(s3_server, tmp_path_factory) -> dict[str, str]:
    """What the chart's head and worker containers get as process env (S3 settings and credentials,
    caches; offline here), for the Ray processes that stand in for the pods."""
    cache = tmp_path_factory.mktemp("podcache")
    return {**s3_server.env(), "HF_HOME": str(cache / "huggingface"), "XDG_CACHE_HOME": str(cache),
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
            "VLLM_CPU_KVCACHE_SPACE": "1", "RAY_USAGE_STATS_ENABLED": "0"}


@pytest.fixture(scope="module")
def ray_cluster(pod_env):
    """`ray start --head` on 127.0.0.1 with logical GPUs and the pods' env; yields the dashboard URL."""
    tmp = tempfile.mkdtemp(prefix="rk", dir="/tmp")
    gcs, dash = free_port(), free_port()
    # As in the stage images, `memsifter` is on the PATH of the Ray processes (also when the tests run
    # as `.venv/bin/python -m pytest` without an activated venv).
    bindir = os.path.dirname(sys.executable)
    env = {**os.environ, **pod_env, **LOCAL_RAY_ENV, "PATH": bindir + os.pathsep + os.environ.get("PATH", "")}
    ray_bin = os.path.join(bindir, "ray")
    cmd = [ray_bin, "start", "--head", "--node-ip-address=127.0.0.1", f"--port={gcs}", "--dashboard-host=127.0.0.1",
           f"--dashboard-port={dash}", f"--num-cpus={CPUS}", f"--num-gpus={GPUS}", f"--temp-dir={tmp}",
           "--disable-usage-stats", "--include-dashboard=true",
           # the agent's fixed default port (52365) is taken by any other Ray on the machine: the job API
           # then answers "No available agent to submit job"
           f"--dashboard-agent-listen-port={free_port()}"]
    try:
        subprocess.run(cmd, check=True, env=env, capture_output=True, timeout=180)
        _wait_port(dash, 120)
        with env_vars({**LOCAL_RAY_ENV, "RAY_ADDRESS": f"127.0.0.1:{gcs}"}):
            yield f"http://127.0.0.1:{dash}"
    finally:
        _kill_matching(tmp)


# --------------------------------------------------------------------------- tiny inputs and configs
def tiny_longmemeval(n_questions: int = 3, n_sessions: int = 4) -> list[dict]:
    topics = [("dog", "I adopted a puppy called Biscuit.", "Biscuit"), ("city", "I moved to Lisbon.", "Lisbon"),
              ("sister", "My sister Margot visits soon.", "Margot"), ("job", "I started at a bakery.", "bakery")]
    items = []
    for q in range(n_questions):
        topic, fact, answer = topics[q % len(topics)]
        sessions, ids, dates = [], [], []
        for s in range(n_sessions):
            gold = s == q % n_sessions
            sessions.append([{"role": "user", "content": fact if gold else f"Filler chat {q}-{s} about weather."},
                             {"role": "assistant", "content": "Noted, thanks for telling me."}])
            ids.append(f"s{q}_{s}")
            dates.append(f"2023/05/{10 + s:02d} (Wed) 10:00")
        items.append({"question_id": f"q{q}", "question_type": "single-session-user",
                      "question": f"What about my {topic}?", "answer": answer, "question_date": "2023/06/01 (Thu) 10:00",
                      "haystack_session_ids": ids, "haystack_dates": dates, "haystack_sessions": sessions,
                      "answer_session_ids": [ids[q % n_sessions]]})
    return items


def _endpoint_like(tp: typing.Any) -> type | None:
    from pydantic import BaseModel

    for cand in (tp, *typing.get_args(tp)):
        if isinstance(cand, type) and issubclass(cand, BaseModel) and {"base_url", "model"} <= set(cand.model_fields):
            return cand
    return None


def tiny_config(info: registry.StageInfo, ctx: dict) -> dict:
    """Small, offline settings for a stage: generic rules by field name/type, then per-stage test data."""
    cfg: dict = {}
    for name, f in info.fields.items():
        if name == "tokenizer":
            cfg[name] = ctx["tiny_model"]
        elif name == "model" and f.annotation is str:
            cfg[name] = "all-MiniLM-L6-v2" if info.family == "embed" else ctx["tiny_model"]
        elif _endpoint_like(f.annotation):
            cfg[name] = {"base_url": ctx["llm"], "model": "tiny", "temperature": 0.0, "max_tokens": 48}
    per_stage = {
        "import": {"format": "longmemeval", "source": ctx["lme"], "dataset_name": "lme"},
        "synth": {"questions": 2, "sessions_per_question": 3},
        "embed": {"gpus_per_worker": 0, "workers": 1, "max_batch_size": 16, "tokens_per_batch": 4096},
        "rank": {"engine": "endpoint", "context_limit": 1500, "max_tokens": 48, "top_k": 3},
        # the reading agent only (agent:search needs a memory service: the chart wires its RayService's URL)
        "agents": {"methods": ["agent:memory"], "max_questions": 1,
                   "agent_options": {"agent:memory": {"memory_tokens": 32, "answer_tokens": 16}}},
        "prepare-agents": {"recipe": {"train": {"lme": 2}, "test": {"lme": 1}}},
        "prepare-rl": {"recipe": {"train": {"lme": 2}, "test": {"lme": 1}},
                       "history_budget_tokens": 2048, "max_prompt_tokens": 4096},
        "train": {"dry_run": True, "nnodes": 1, "n_gpus_per_node": GPUS,
                  "reward": {"mode": "dcg"}, "local_dir": ctx["scratch"] + "/train"},
        "merge": {"steps": [1], "dtype": "float32"},
        "collect": {"steps": [1]},
    }
    cfg.update(per_stage.get(info.name, {}))
    return {k: v for k, v in cfg.items() if k in info.fields}


def write_fsdp_checkpoint(model_dir: str, ckpt_uri: str, step: int = 1) -> None:
    """A verl FSDP checkpoint of the tiny model (world size 1: plain tensors), marked complete."""
    import torch
    from transformers import AutoModelForCausalLM

    from memsifter.stages import train

    with tempfile.TemporaryDirectory() as d:
        actor = Path(d) / "actor"
        (actor / "huggingface").mkdir(parents=True)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        torch.save(model.state_dict(), actor / "model_world_size_1_rank_0.pt")
        (actor / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 1, "world_size": 1}))
        for p in Path(model_dir).iterdir():
            if p.is_file() and not p.name.endswith((".safetensors", ".bin")):
                (actor / "huggingface" / p.name).write_bytes(p.read_bytes())
        torch.save({"dataloader": None}, Path(d) / "data.pt")
        storage.upload_dir(d, storage.join(ckpt_uri, f"global_step_{step}"))
    train.mark_complete(ckpt_uri, step)


def _values(infos, ctx, bucket, endpoint) -> dict:
    """The plan (`memsifter k8s plan`) of every stage the pipeline runs together (the full scenario's: of two
    alternative producers of one input, such as import and synth, the preferred one; the pipeline refuses both),
    with the multi-node stage's Kubernetes settings in its block."""
    together = chart.scenario_sets(infos)["full"]
    run_id = "t" + uuid.uuid4().hex[:6]
    spec = {"run": f"s3://{bucket}/runs/{run_id}",
            "stages": {i.name: tiny_config(i, ctx) for i in infos if i.name in together}}
    blocks = {i.name: {"workers": {"gpus": GPUS}, "capacityTimeoutSeconds": 120}
              for i in infos if i.name in together and i.capacity}
    return {"run": {"id": run_id}, "s3": {"bucket": bucket, "endpoint": endpoint, "runPrefix": "runs"},
            "cacheVolume": {"mountPath": ctx["scratch"] + "/cache"}, "pipeline": chart_plan(spec), "stages": blocks}


def _dry_run_stages(infos) -> set[str]:
    return {i.name for i in infos if "dry_run" in i.fields}


def _job_logs(backend: RayBackend, name: str) -> str:
    with contextlib.suppress(Exception):
        return backend.logs(name)
    return ""


# --------------------------------------------------------------------------- the tests
def test_rendered_rayjobs_run_on_local_ray(ray_cluster, pod_env, s3_env, tiny_model_dir, vllm_endpoint, tmp_path):
    infos = registry.stage_infos()
    bucket = f"k8s-{uuid.uuid4().hex[:8]}"
    storage.ensure_bucket(f"s3://{bucket}/x")
    lme = f"s3://{bucket}/raw/lme_tiny.json.gz"
    storage.write_bytes(lme, gzip.compress(json.dumps(tiny_longmemeval()).encode()))
    ctx = {"tiny_model": tiny_model_dir, "llm": vllm_endpoint, "lme": lme, "scratch": str(tmp_path)}
    values = _values(infos, ctx, bucket, s3_env.endpoint)
    docs = chart.render_docs([], values=values)
    plan_doc = next(d for d in docs if d["kind"] == "ConfigMap" and "plan.json" in d["data"])
    full = Plan.from_dict(json.loads(plan_doc["data"]["plan.json"]))
    assert {s.name for s in full.stages} == chart.scenario_sets(infos)["full"]
    for st in full.stages:
        assert validate.kuberay_errors(st.rayjob) == [], st.name

    # collect reads the train stage's checkpoints: put a real FSDP checkpoint where train writes them
    by = {s.name: s for s in full.stages}
    if "collect" in by and "train" in by:
        write_fsdp_checkpoint(tiny_model_dir, storage.join(by["train"].output, "checkpoints"))

    # the pods' env: the cluster runs with it; what the chart puts in the head container must be covered
    head_env = full.stages[0].rayjob["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["env"]
    runtime_keys = {"MEMSIFTER_STAGE", "MEMSIFTER_RUN_ID"}
    for e in head_env:
        ref = (e.get("valueFrom") or {}).get("secretKeyRef") or {}
        assert e["name"] in pod_env or e["name"] in runtime_keys or ref.get("optional") or \
            e["name"] in ("AWS_REGION",) + CACHE_LOCATIONS, e
    backend = RayBackend(ray_cluster, configs=full.configs)  # the ConfigMaps' documents, as local files
    dry = _dry_run_stages(infos)
    main = Plan(full.run, [s for s in full.stages if s.name not in dry])
    d = Driver(main, backend, poll=0.5, stage_timeout=600)
    t0 = time.time()
    try:
        manifest = d.run()
    except Exception as e:
        failed = d.manifest.get("failed_stage")
        pytest.fail(f"{e}\n--- job logs ---\n"
                    f"{_job_logs(backend, by[failed].rayjob_name)[-6000:] if failed else ''}")
    took = time.time() - t0
    import datetime as dt

    span = {k: (dt.datetime.fromisoformat(v["ended_at"]) - dt.datetime.fromisoformat(v["started_at"])).seconds
            for k, v in manifest["stages"].items() if v.get("ended_at") and v.get("started_at")}
    print(f"seconds per stage: {span}")
    for st in main.stages:
        assert manifest["stages"][st.name]["state"] == "succeeded", st.name
        m = storage.read_manifest(st.output)
        assert m["stage"] == st.name
    saved = storage.read_json(main.manifest_uri)
    assert saved["state"] == "succeeded" and saved["order"] == manifest["order"]

    # resume: a second driver finds everything published and starts nothing
    again = Driver(main, backend, poll=1.0).run()
    assert {v["state"] for v in again["stages"].values()} == {"skipped"}

    # dry-run stages (train): the job runs and succeeds behind await-capacity, publishing nothing
    for st in full.stages:
        if st.name not in dry:
            continue
        backend.create(st.rayjob)
        deadline = time.time() + 600
        while True:
            s = backend.get(st.rayjob_name)["status"]
            if s["jobStatus"] in ("SUCCEEDED", "FAILED", "STOPPED") or time.time() > deadline:
                break
            time.sleep(0.5)
        logs = _job_logs(backend, st.rayjob_name)
        assert s["jobStatus"] == "SUCCEEDED", f"{st.name} dry run: {s}\n{logs[-3000:]}"
        assert "GPU node(s) alive" in logs, f"{st.name}: no capacity wait in the logs:\n{logs[:3000]}"
    print(f"pipeline of {len(main.stages)} RayJobs on local Ray: {took:.0f}s; dry runs: {time.time() - t0 - took:.0f}s")


def test_await_capacity_requests_and_waits(ray_cluster):
    """The capacity wait the training entrypoint runs first: records the node demand for the
    autoscaler (read back from the GCS), returns once the nodes are there, execs the command, and
    fails with a clear message when they never come."""
    from memsifter.k8s.capacity import node_bundles

    cli = [sys.executable, "-m", "memsifter.cli", "k8s", "await-capacity", "--gpus-per-node", str(GPUS),
           "--cpus-per-gpu", str(CPUS // GPUS), "--poll", "0.5"]
    ok = subprocess.run(cli + ["--nodes", "1", "--timeout", "60", "--", sys.executable, "-c", "print('ran after')"],
                        capture_output=True, text=True, timeout=180)
    assert ok.returncode == 0, ok.stderr
    assert "ran after" in ok.stdout
    import ray

    ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
    try:  # what the autoscaler reads (v1: internal KV; v2: the GCS cluster constraint)
        from ray.autoscaler.v2.utils import is_autoscaler_v2

        if is_autoscaler_v2():
            from ray.autoscaler.v2.sdk import get_cluster_status

            status = get_cluster_status(os.environ["RAY_ADDRESS"])
            demand = [dict(b.bundle) for r in status.resource_demands.cluster_constraint_demand
                      for b in r.bundles_by_count for _ in range(b.count)]
        else:
            from ray._private.ray_constants import AUTOSCALER_RESOURCE_REQUEST_CHANNEL
            from ray.experimental.internal_kv import _internal_kv_get

            demand = json.loads(_internal_kv_get(AUTOSCALER_RESOURCE_REQUEST_CHANNEL))
    finally:
        ray.shutdown()
    assert demand == node_bundles(1, GPUS, CPUS // GPUS)

    bad = subprocess.run(cli + ["--nodes", "2", "--timeout", "3", "--", "true"], capture_output=True, text=True,
                         timeout=180)
    assert bad.returncode == 1
    assert "only 1 of 2 GPU node(s)" in bad.stderr and "gpuPool" in bad.stderr


def test_verl_placement_groups_fit_one_chart_worker(ray_cluster):
    """verl's own resource pool creates its STRICT_PACK placement group (n_gpus_per_node bundles of
    CPU x3 + GPU) on a node shaped like one chart worker pod, and cannot on a smaller one."""
    import ray
    from verl.single_controller.ray.base import RayResourcePool

    ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
    try:
        pool = RayResourcePool(process_on_nodes=[GPUS], use_gpu=True, max_colocate_count=CPUS // GPUS,
                               name_prefix="k8stest")
        pgs = pool.get_placement_groups(device_name="cuda")
        assert len(pgs) == 1 and pgs[0].bundle_count == GPUS
        ray.util.remove_placement_group(pgs[0])
        too_big = ray.util.placement_group([{"CPU": CPUS // GPUS, "GPU": 1}] * (GPUS + 1), strategy="STRICT_PACK")
        assert not too_big.wait(timeout_seconds=2)  # pending: the demand the autoscaler scales up for
        ray.util.remove_placement_group(too_big)
    finally:
        ray.shutdown()


def test_pod_env_reads_the_stage_configmaps_s3_settings(ray_cluster):
    """`memsifter k8s drive --ray-address` (pod_env): a container's S3 settings come from the stage's ConfigMap
    (configMapKeyRef), resolved from the plan's run.settings, not from this process's environment."""
    values = {"run": {"id": "pe"}, "s3": {"bucket": "memsifter-ci", "endpoint": "http://s3.example.svc:8333",
                                          "region": "eu-west-3"},
              "pipeline": chart_plan({"run": "s3://memsifter-ci/runs/pe", "stages": {"synth": {}}})}
    (plan_doc,) = [d for d in chart.render_docs([], values=values, show_only="templates/driver.yaml")
                   if d["kind"] == "ConfigMap"]
    plan = Plan.from_dict(json.loads(plan_doc["data"]["plan.json"]))
    assert plan.run["settings"] == {"MEMSIFTER_S3_ENDPOINT": "http://s3.example.svc:8333", "AWS_REGION": "eu-west-3"}
    (st,) = plan.stages
    head = st.rayjob["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert {e["name"]: e["valueFrom"]["configMapKeyRef"]["key"] for e in head["env"]
            if "configMapKeyRef" in e.get("valueFrom", {})} == {"MEMSIFTER_S3_ENDPOINT": "MEMSIFTER_S3_ENDPOINT",
                                                                "AWS_REGION": "AWS_REGION"}
    env = RayBackend(ray_cluster, pod_env=True, settings=plan.run["settings"]).runtime_env(st.rayjob)["env_vars"]
    assert (env["MEMSIFTER_S3_ENDPOINT"], env["AWS_REGION"]) == ("http://s3.example.svc:8333", "eu-west-3")
