"""``memsifter k8s drive``: run a pipeline's stage RayJobs in the plan's order.

The plan (``plan.json``, rendered by the chart into a ConfigMap) lists the steps of
:func:`memsifter.pipeline.plan` (``memsifter k8s plan``) in its order: each section's name, the stage it
runs, its config document (what the section sets, with output and wired inputs filled: the same document
the chart mounts into the head pod of its RayJob, whose entrypoint reads it with ``memsifter run <stage>
--config``) and its RayJob. The order is the plan's: nothing is sorted again here. For each step the
driver:

1. skips it when its output is already published with the same config hash (``_SUCCESS`` manifest,
   :func:`memsifter.stage.config_hash`);
2. otherwise attaches to its RayJob if one is running (a restarted driver), deletes and re-creates it if
   an earlier attempt failed, or creates it;
3. waits for ``status.jobDeploymentStatus`` / ``status.jobStatus``: ``Complete`` + ``SUCCEEDED`` is
   success (and the output must then be published); ``Failed``/``ValidationFailed``, a failed or
   stopped job, a vanished RayJob or the stage timeout stop the run with a message naming the RayJob
   and how to read its logs.

After every transition the run manifest (``<run root>/_run/manifest.json``) is rewritten, so progress
is visible in S3 while the run goes on; at the start the driver also writes ``<run root>/_run/plan.json``,
the record ``memsifter status`` reads (as ``memsifter pipeline`` does). Exit status: 0 when every stage
succeeded or was skipped, 1 when a stage failed.

Backends: :class:`KubernetesBackend` (the ``kubernetes`` client, CustomObjects API, only ``rayjobs``
in one namespace: what the chart's Role grants; the config ConfigMaps are created by helm) and
:class:`RayBackend` (submits the same entrypoint and runtime env to a Ray cluster's job API, with the
config document written to a local file in place of the mounted one: a local dry run of a plan).
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import yaml

from ..store import storage
from ..errors import MemsifterError

log = logging.getLogger(__name__)

GROUP, VERSION, PLURAL = "ray.io", "v1", "rayjobs"
FAILED_DEPLOYMENT = {"Failed", "ValidationFailed"}
FAILED_JOB = {"FAILED", "STOPPED"}


class DriveError(MemsifterError):
    """A stage failed or the run cannot proceed (exit code 1)."""

    exit_code = 1


@dataclass
class StagePlan:
    name: str              # the pipeline section (a stage's name, or a named instance's)
    stage: str             # the stage it runs
    config: dict
    rayjob: dict

    @property
    def rayjob_name(self) -> str:
        return self.rayjob["metadata"]["name"]

    @property
    def output(self) -> str:
        return self.config["output"]


@dataclass
class Plan:
    run: dict
    stages: list[StagePlan]

    @classmethod
    def load(cls, path_or_uri: str) -> "Plan":
        data = json.loads(storage.read_text(path_or_uri))
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: dict) -> "Plan":
        stages = [StagePlan(s["name"], s.get("stage") or s["name"], dict(s["config"]), s["rayjob"])
                  for s in data.get("stages") or []]
        return cls(dict(data.get("run") or {}), stages)

    @property
    def manifest_uri(self) -> str:
        return storage.join(self.run["root"], "_run", "manifest.json")

    @property
    def configs(self) -> dict[str, dict]:
        """RayJob name -> the stage's config document (what its entrypoint's ``--config`` file holds)."""
        return {s.rayjob_name: s.config for s in self.stages}


def submitted_entrypoint(entrypoint: str) -> str:
    """What the Ray job runs: the submitter shell splits the entrypoint; ``ray job submit`` re-joins
    the words with ``shlex.join`` (ray/dashboard/modules/job/cli.py)."""
    return shlex.join(shlex.split(entrypoint))


def local_config_entrypoint(entrypoint: str, config: dict | None, path: str) -> str:
    """:func:`submitted_entrypoint` with its ``--config`` file replaced by ``config`` written to ``path``
    (unchanged when ``config`` is None or there is no ``--config``)."""
    words = shlex.split(submitted_entrypoint(entrypoint))
    if config is None or "--config" not in words:
        return shlex.join(words)
    with open(path, "w") as f:
        yaml.safe_dump(config, f, sort_keys=True)
    words[words.index("--config") + 1] = path
    return shlex.join(words)


# --------------------------------------------------------------------------- backends
class Backend(Protocol):
    def get(self, name: str) -> dict | None: ...
    def create(self, rayjob: dict) -> None: ...
    def delete(self, name: str) -> None: ...
    def logs_hint(self, name: str) -> str: ...


class KubernetesBackend:
    """RayJobs through the Kubernetes API (CustomObjectsApi), in one namespace."""

    def __init__(self, namespace: str, api_client: Any = None, retries: int = 5, backoff: float = 1.0):
        from kubernetes import client

        self.namespace = namespace
        self.api = client.CustomObjectsApi(api_client)
        self.retries, self.backoff = retries, backoff

    @classmethod
    def from_environment(cls, namespace: str | None = None) -> "KubernetesBackend":
        from kubernetes import config

        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
        ns = namespace or os.environ.get("POD_NAMESPACE") or _incluster_namespace() or "default"
        return cls(ns)

    def _call(self, what: str, fn: Callable[[], Any], ok: tuple[int, ...] = ()) -> Any:
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        for i in range(self.retries):
            try:
                return fn()
            except ApiException as e:
                if e.status in ok:
                    return e
                if e.status in (401, 403):
                    raise DriveError(f"{what}: the Kubernetes API refused ({e.status} {e.reason}): the driver's "
                                     f"ServiceAccount needs get/create/delete on rayjobs.ray.io in namespace "
                                     f"{self.namespace} (the chart's Role grants exactly that)") from e
                if e.status == 404 and "the server could not find the requested resource" in str(e.body or ""):
                    raise DriveError(f"{what}: the RayJob CRD is not installed: install the KubeRay operator "
                                     f"(>= 1.4) first") from e
                if e.status and e.status < 500 and e.status != 429:
                    msg = _api_message(e)
                    raise DriveError(f"{what}: the Kubernetes API rejected the request ({e.status}): {msg}") from e
                err: Exception = e
            except (HTTPError, OSError) as e:
                err = e
            if i + 1 == self.retries:
                raise DriveError(f"{what}: Kubernetes API unavailable after {self.retries} attempts: {err}")
            time.sleep(self.backoff * 2 ** i)
        raise AssertionError("unreachable")

    def get(self, name: str) -> dict | None:
        from kubernetes.client.exceptions import ApiException

        r = self._call(f"get rayjob {name}", lambda: self.api.get_namespaced_custom_object(
            GROUP, VERSION, self.namespace, PLURAL, name), ok=(404,))
        return None if isinstance(r, ApiException) else r

    def create(self, rayjob: dict) -> None:
        from kubernetes.client.exceptions import ApiException

        body = {**rayjob, "metadata": {**rayjob["metadata"], "namespace": self.namespace}}
        r = self._call(f"create rayjob {rayjob['metadata']['name']}", lambda: self.api.create_namespaced_custom_object(
            GROUP, VERSION, self.namespace, PLURAL, body), ok=(409,))
        if isinstance(r, ApiException):
            log.info("rayjob %s already exists: attaching to it", rayjob["metadata"]["name"])

    def delete(self, name: str) -> None:
        self._call(f"delete rayjob {name}", lambda: self.api.delete_namespaced_custom_object(
            GROUP, VERSION, self.namespace, PLURAL, name, propagation_policy="Foreground"), ok=(404,))

    def logs_hint(self, name: str) -> str:
        return (f"kubectl -n {self.namespace} describe rayjob {name}; "
                f"kubectl -n {self.namespace} logs job/{name}  (the submitter, which follows the Ray job's logs)")


def _api_message(e: Any) -> str:
    try:
        return json.loads(e.body).get("message") or str(e.reason)
    except Exception:
        return str(e.reason)


def _incluster_namespace() -> str | None:
    p = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
    if os.path.exists(p):
        with open(p) as f:
            return f.read().strip()
    return None


class RayBackend:
    """Runs each RayJob's entrypoint and runtime env on an existing Ray cluster (job API).

    Like KubeRay, only ``runtimeEnvYAML`` becomes the job's runtime env: the head container's env is
    the *process* env of a pod, so the Ray cluster should be started with it (S3 settings, secrets,
    caches). ``pod_env=True`` instead copies the head container's env into the runtime env (plain
    values; ``configMapKeyRef`` entries, the stage ConfigMap's S3 settings, from ``settings`` (the plan's
    ``run.settings``); ``secretKeyRef``/``fieldRef`` entries from this process's environment, same name), for a
    cluster started without it; stages that call ``ray.init(runtime_env=...)`` with the same keys then
    conflict, as they would on Kubernetes if those keys were in runtimeEnvYAML. The status is reported
    in KubeRay's vocabulary so the driver logic is the same.

    On Kubernetes the entrypoint's ``--config <path>`` names the stage's ConfigMap, mounted into the head
    pod; here ``configs`` (RayJob name -> config document, :attr:`Plan.configs`) supplies it: the
    document is written to a local file (the Ray head must see this machine's filesystem) and the path
    in the entrypoint replaced.
    """

    def __init__(self, address: str, env_overrides: dict[str, str] | None = None, submit_timeout: float = 180,
                 pod_env: bool = False, configs: dict[str, dict] | None = None, settings: dict | None = None):
        from ray.job_submission import JobSubmissionClient

        self.client = JobSubmissionClient(address)
        self.submit_timeout = submit_timeout
        self.pod_env = pod_env
        self.env_overrides = dict(env_overrides or {})
        self.configs = dict(configs or {})
        self.settings = {k: str(v) for k, v in (settings or {}).items()}
        self.jobs: dict[str, str] = {}  # rayjob name -> submission id
        self._config_dir: str | None = None

    def entrypoint(self, rayjob: dict) -> str:
        """The command the Ray job runs, its ``--config`` pointing at a local copy of the config document."""
        name = rayjob["metadata"]["name"]
        if name in self.configs and self._config_dir is None:
            self._config_dir = tempfile.mkdtemp(prefix="memsifter-configs-")
        return local_config_entrypoint(rayjob["spec"]["entrypoint"], self.configs.get(name),
                                       os.path.join(self._config_dir or "", f"{name}.yaml"))

    def runtime_env(self, rayjob: dict) -> dict:
        spec = rayjob["spec"]
        rte = yaml.safe_load(spec.get("runtimeEnvYAML") or "") or {}
        env_vars: dict[str, str] = {}
        if self.pod_env:
            head = spec["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
            for e in head.get("env") or []:
                ref = (e.get("valueFrom") or {}).get("configMapKeyRef") or {}
                if "value" in e:
                    env_vars[e["name"]] = str(e["value"])
                elif ref.get("key") in self.settings:
                    if self.settings[ref["key"]]:   # '' (no endpoint): unset, as storage reads it
                        env_vars[e["name"]] = self.settings[ref["key"]]
                elif e["name"] in os.environ:
                    env_vars[e["name"]] = os.environ[e["name"]]
        env_vars.update(rte.get("env_vars") or {})
        env_vars.update(self.env_overrides)
        return {**rte, "env_vars": env_vars} if env_vars else rte

    def create(self, rayjob: dict) -> None:
        name = rayjob["metadata"]["name"]
        sid = f"{name}-{uuid.uuid4().hex[:6]}"
        deadline = time.time() + self.submit_timeout
        while True:
            try:
                self.client.submit_job(entrypoint=self.entrypoint(rayjob),
                                       runtime_env=self.runtime_env(rayjob), submission_id=sid)
                break
            except RuntimeError as e:  # a head that just started: its job agent is not up yet
                if "No available agent" not in str(e) or time.time() > deadline:
                    raise
                time.sleep(2)
        self.jobs[name] = sid

    def get(self, name: str) -> dict | None:
        sid = self.jobs.get(name)
        if sid is None:
            return None
        info = self.client.get_job_info(sid)
        st = str(info.status.value if hasattr(info.status, "value") else info.status)
        dep = {"PENDING": "Initializing", "RUNNING": "Running", "SUCCEEDED": "Complete",
               "FAILED": "Failed", "STOPPED": "Failed"}.get(st, "Running")
        return {"metadata": {"name": name}, "status": {"jobDeploymentStatus": dep, "jobStatus": st,
                                                       "jobId": sid, "message": info.message or ""}}

    def delete(self, name: str) -> None:
        self.jobs.pop(name, None)

    def logs(self, name: str) -> str:
        sid = self.jobs.get(name)
        return self.client.get_job_logs(sid) if sid else ""

    def logs_hint(self, name: str) -> str:
        return f"ray job logs {self.jobs.get(name, name)}"


# --------------------------------------------------------------------------- published outputs
def published_hash(stage: StagePlan) -> tuple[bool, str]:
    """Whether the stage's output is published for this config and the current content of its inputs
    (:meth:`memsifter.stage.Stage.published`: config hash and input fingerprints); (answer, reason)."""
    manifest = storage.try_manifest(stage.output)
    if not manifest:
        return False, "not published"
    if manifest.get("stage") != stage.stage:
        return False, f"{stage.output} holds output of stage {manifest.get('stage')!r}"
    try:
        from .. import stage as stg

        st = stg.get_stage(stage.stage)
        cfg = stg.validate_config(stage.stage, stage.config, source="plan")
        want = stg.config_hash(cfg)
        if st.published(cfg):
            return True, f"published with the same config (hash {want}) and inputs"
    except Exception as e:  # noqa: BLE001 - the stage module needs packages this image lacks
        return False, f"cannot compute the config hash here ({type(e).__name__}: {e}); the stage will check itself"
    if manifest.get("config_hash") == want:
        return False, "published with the same config, but an input changed since (or a file was damaged)"
    return False, f"published with another config (hash {manifest.get('config_hash')} != {want})"


# --------------------------------------------------------------------------- the driver
@dataclass
class Driver:
    plan: Plan
    backend: Backend
    poll: float = 15.0
    stage_timeout: float = 0.0          # 0: no limit beyond the RayJob's activeDeadlineSeconds
    write_manifest: bool = True
    check_configs: bool = True
    is_published: Callable[[StagePlan], tuple[bool, str]] = published_hash
    steal_lease: bool = False           # take over the run lease of a dead driver at once
    lease_wait: float | None = None     # seconds to wait for a (dead) holder's lease to expire; None:
                                        # MEMSIFTER_LEASE_WAIT, else one lease TTL + 15 s (a restarted
                                        # driver pod takes over from the one it replaces)
    sleep: Callable[[float], None] = time.sleep
    clock: Callable[[], float] = time.time
    manifest: dict = field(default_factory=dict)

    def _save(self) -> None:
        self.manifest["updated_at"] = storage.utcnow()
        if not self.write_manifest:
            return
        try:
            storage.ensure_bucket(self.plan.manifest_uri)
            storage.write_bytes(self.plan.manifest_uri,
                                json.dumps(self.manifest, indent=2, sort_keys=True, default=str).encode())
        except MemsifterError as e:
            log.warning("could not write the run manifest %s: %s", self.plan.manifest_uri, e)

    def _set(self, name: str, **kw: Any) -> None:
        self.manifest["stages"][name].update(kw)
        self._save()

    def preflight(self) -> list[str]:
        """Config errors of every stage, before any cluster starts (stages whose module cannot be
        imported here are checked by the stage itself when it runs)."""
        from .. import stage as stg
        from ..errors import ConfigError

        errors = []
        for st in self.plan.stages:
            try:
                stg.get_stage(st.stage)
            except Exception as e:  # noqa: BLE001 - the image lacks the stage's packages
                log.info("%s: config not checked here (%s: %s)", st.name, type(e).__name__, e)
                continue
            try:
                stg.validate_config(st.stage, st.config, source=f"pipeline stage '{st.name}'")
            except ConfigError as e:
                errors.append(str(e))
        return errors

    def run(self) -> dict:
        """Drive the run. One driver per run: the run lease ``<root>/_run/_LEASE`` (the one ``memsifter
        pipeline`` takes too) is taken before any RayJob is created; a second driver of the run is
        refused with the holder's name (:class:`memsifter.store.lease.LeaseHeldError`). A driver that does
        not write to the store (``write_manifest=False``) takes no lease."""
        if not self.write_manifest:
            return self._run()
        from ..store import lease

        storage.ensure_bucket(self.plan.manifest_uri)
        wait = self.lease_wait
        if wait is None:
            wait = (storage.setting("MEMSIFTER_LEASE_WAIT") if os.environ.get("MEMSIFTER_LEASE_WAIT")
                    else storage.setting("MEMSIFTER_LEASE_TTL") + 15)
        with lease.hold(storage.join(self.plan.run["root"], "_run"), steal=self.steal_lease, wait=wait,
                        purpose=f"driver of run {self.plan.run.get('id', '?')}") as held:
            self._lease = held
            self._write_status_plan()
            return self._run()

    def _write_status_plan(self) -> None:
        """``<root>/_run/plan.json``: the run record ``memsifter status`` reads (every stage of the plan with
        its output, so that the stages that have not started are listed), in the shape ``memsifter pipeline``
        writes when it starts (:func:`memsifter.pipeline.run_pipeline`); the driver's own progress stays in
        ``manifest.json``. Not writing it only costs ``status`` that list: a warning."""
        from ..pipeline import write_plan

        root = self.plan.run["root"].rstrip("/")
        try:
            write_plan(root, [(s.name, s.output, s.stage) for s in self.plan.stages])
        except MemsifterError as e:
            log.warning("could not write the run plan of %s: %s", root, e)

    def _run(self) -> dict:
        order = self.plan.stages
        errors = self.preflight() if self.check_configs else []
        if errors:
            raise DriveError("invalid stage config(s); nothing was started:\n" + "\n".join(errors))
        self.manifest = {
            "run": self.plan.run, "state": "running", "started_at": storage.utcnow(),
            "order": [s.name for s in order],
            "stages": {s.name: {"state": "pending", "rayjob": s.rayjob_name, "output": s.output,
                                "stage": s.stage} for s in order},
        }
        self._save()
        if not order:
            log.warning("the plan has no step: nothing to do")
        for i, st in enumerate(order):
            try:
                self._run_stage(st)
            except DriveError as e:
                for later in order[i + 1:]:
                    self.manifest["stages"][later.name]["state"] = "not-run"
                self.manifest.update(state="failed", failed_stage=st.name, error=str(e), ended_at=storage.utcnow())
                self._save()
                raise
        self.manifest.update(state="succeeded", ended_at=storage.utcnow())
        self._save()
        return self.manifest

    def _run_stage(self, st: StagePlan) -> None:
        done, why = self.is_published(st)
        if done:
            log.info("%s: skipped: %s", st.name, why)
            self._set(st.name, state="skipped", reason=why)
            return
        log.info("%s: %s; running RayJob %s", st.name, why, st.rayjob_name)
        existing = self.backend.get(st.rayjob_name)
        if existing is not None:
            state = _classify(existing)
            if state == "failed":
                log.info("%s: RayJob %s failed in an earlier attempt: deleting and re-creating it",
                         st.name, st.rayjob_name)
                self.backend.delete(st.rayjob_name)
                self._wait_gone(st.rayjob_name)
                existing = None
            else:
                log.info("%s: RayJob %s exists (%s): attaching", st.name, st.rayjob_name, state)
        if existing is None:
            held = getattr(self, "_lease", None)
            if held is not None:
                held.check()   # robbed of the run while we waited: the new driver creates the jobs
            self.backend.create(st.rayjob)
        self._set(st.name, state="running", started_at=storage.utcnow())
        status = self._wait(st)
        done, why = self.is_published(st)
        if not done and not why.startswith("cannot compute"):
            raise self._fail(st, f"RayJob {st.rayjob_name} succeeded but {st.output} is not published ({why})",
                             status)
        self._set(st.name, state="succeeded", ended_at=storage.utcnow(), status=status)
        log.info("%s: succeeded", st.name)

    def _wait_gone(self, name: str, timeout: float = 600) -> None:
        deadline = self.clock() + timeout
        while self.backend.get(name) is not None:
            if self.clock() > deadline:
                raise DriveError(f"RayJob {name} was not deleted within {timeout:.0f}s")
            self.sleep(min(self.poll, 5))

    def _wait(self, st: StagePlan) -> dict:
        start = self.clock()
        last = None
        while True:
            obj = self.backend.get(st.rayjob_name)
            if obj is None:
                raise self._fail(st, f"RayJob {st.rayjob_name} disappeared while the driver waited for it "
                                     f"(deleted by someone else?)", {})
            status = dict(obj.get("status") or {})
            state = _classify(obj)
            brief = (status.get("jobDeploymentStatus"), status.get("jobStatus"))
            if brief != last:
                log.info("%s: %s / %s", st.name, brief[0] or "-", brief[1] or "-")
                last = brief
                self.manifest["stages"][st.name]["status"] = _brief(status)
                self._save()
            if state == "succeeded":
                return _brief(status)
            if state == "failed":
                raise self._fail(st, "RayJob failed", status)
            if self.stage_timeout and self.clock() - start > self.stage_timeout:
                raise self._fail(st, f"timed out after {self.stage_timeout:.0f}s (driver.stageTimeoutSeconds)",
                                 status)
            self.sleep(self.poll)

    def _fail(self, st: StagePlan, what: str, status: dict) -> DriveError:
        detail = "; ".join(f"{k}={status[k]}" for k in ("jobDeploymentStatus", "jobStatus", "reason", "message")
                           if status.get(k))
        msg = (f"stage '{st.name}' failed: {what}" + (f" ({detail})" if detail else "")
               + f". Logs: {self.backend.logs_hint(st.rayjob_name)}. Later stages were not run; fix the cause "
               f"and restart the driver (published stages are skipped).")
        self._set(st.name, state="failed", ended_at=storage.utcnow(), status=_brief(status), error=msg)
        return DriveError(msg)


def _classify(obj: dict) -> str:
    status = obj.get("status") or {}
    dep, job = status.get("jobDeploymentStatus") or "", status.get("jobStatus") or ""
    if dep in FAILED_DEPLOYMENT:
        return "failed"
    if dep == "Complete":
        return "succeeded" if job == "SUCCEEDED" else "failed"
    return "running"


def _brief(status: dict) -> dict:
    return {k: status[k] for k in ("jobDeploymentStatus", "jobStatus", "reason", "message", "jobId",
                                   "rayClusterName", "startTime", "endTime", "failed", "succeeded")
            if status.get(k) not in (None, "")}
