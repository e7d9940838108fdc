"""The pipeline driver (`memsifter k8s drive`).

* Ordering, skipping, attaching, retrying and failure handling: plain unit tests on an in-memory backend.
* The Kubernetes side: the real ``kubernetes`` client against a local HTTP server that speaks the
  CustomObjects endpoints for rayjobs.ray.io (POST/GET/DELETE), checks the bearer token, and records
  every request, so the tests also prove the driver touches nothing but rayjobs in its namespace
  (what the chart's Role allows).
* Resume: the real storage layer on SeaweedFS decides what is published (config hash in _SUCCESS).
"""

from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from memsifter.store import storage
from memsifter.k8s.driver import (
    DriveError,
    Driver,
    KubernetesBackend,
    Plan,
    StagePlan,
    published_hash,
)

NS = "ms-test"
TOKEN = "test-token"


def rayjob(name: str) -> dict:
    return {"apiVersion": "ray.io/v1", "kind": "RayJob", "metadata": {"name": name, "labels": {"x": "y"}},
            "spec": {"entrypoint": f"memsifter run {name}", "shutdownAfterJobFinishes": True}}


def make_plan(stages: dict[str, list[str]], root: str = "s3://bucket/runs/r1") -> Plan:
    """A plan of ``stages`` in the order given (values: the stages each reads from, as a plan.json of an older
    chart carried them: the driver ignores them)."""
    return Plan.from_dict({"run": {"id": "r1", "root": root}, "stages": [
        {"name": n, "needs": needs, "config": {"output": f"{root}/{n}"}, "rayjob": rayjob(f"r1-{n}")}
        for n, needs in stages.items()]})


OK = {"jobDeploymentStatus": "Complete", "jobStatus": "SUCCEEDED"}
RUNNING = {"jobDeploymentStatus": "Running", "jobStatus": "RUNNING"}
FAILED = {"jobDeploymentStatus": "Failed", "jobStatus": "FAILED", "reason": "AppFailed",
          "message": "Job entrypoint command failed with exit code 2"}


class MemoryBackend:
    """RayJobs in a dict; each created job walks through a scripted status list."""

    def __init__(self, scripts: dict[str, list[dict]] | None = None, existing: dict[str, dict] | None = None):
        self.scripts = scripts or {}
        self.objects: dict[str, dict] = dict(existing or {})
        self.calls: list[tuple[str, str]] = []
        self.on_success = lambda name: None

    def get(self, name):
        self.calls.append(("get", name))
        obj = self.objects.get(name)
        if obj is None:
            return None
        script = self.scripts.get(name)
        if script and obj.get("_created"):
            obj["status"] = script.pop(0) if len(script) > 1 else script[0]
            if obj["status"] == OK:
                self.on_success(name)
        return obj

    def create(self, rj):
        self.calls.append(("create", rj["metadata"]["name"]))
        self.objects[rj["metadata"]["name"]] = {**rj, "_created": True, "status": {}}

    def delete(self, name):
        self.calls.append(("delete", name))
        self.objects.pop(name, None)

    def logs_hint(self, name):
        return f"logs of {name}"


def driver(plan, backend, published=()):
    done = set(published)
    backend.on_success = lambda name: done.add(name.split("-", 1)[1])
    return Driver(plan, backend, poll=0, write_manifest=False, check_configs=False, sleep=lambda s: None,
                  is_published=lambda st: (st.name in done, "published" if st.name in done else "not published"))


# --------------------------------------------------------------------------- ordering
def test_runs_the_plan_in_its_order():
    """The order is the plan's (memsifter.pipeline.plan's, computed once): the driver sorts nothing again, and a
    step's stage is the one it uses (an instance: rank-trained uses rank)."""
    plan = Plan.from_dict({"run": {"id": "r1", "root": "s3://b/r1"}, "stages": [
        {"name": n, "stage": st, "config": {"output": f"s3://b/r1/{n}"}, "rayjob": rayjob(f"r1-{n}")}
        for n, st in [("embed", "embed"), ("rank-trained", "rank"), ("rank", "rank"), ("chat", "chat")]]})
    assert [(s.name, s.stage) for s in plan.stages] == [("embed", "embed"), ("rank-trained", "rank"),
                                                        ("rank", "rank"), ("chat", "chat")]
    be = MemoryBackend({f"r1-{n}": [OK] for n in ("embed", "rank-trained", "rank", "chat")})
    m = driver(plan, be).run()
    assert [c[1] for c in be.calls if c[0] == "create"] == ["r1-embed", "r1-rank-trained", "r1-rank", "r1-chat"]
    assert m["stages"]["rank-trained"]["stage"] == "rank"
    # an older plan.json's needs are not read: its list order is run as it is
    assert [s.name for s in make_plan({"chat": ["rank"], "rank": []}).stages] == ["chat", "rank"]


def test_runs_in_order_and_succeeds():
    plan = make_plan({"embed": [], "rank": ["embed"], "chat": ["rank"]})
    be = MemoryBackend({f"r1-{n}": [RUNNING, RUNNING, OK] for n in ("embed", "rank", "chat")})
    m = driver(plan, be).run()
    assert [c[1] for c in be.calls if c[0] == "create"] == ["r1-embed", "r1-rank", "r1-chat"]
    assert m["state"] == "succeeded" and m["order"] == ["embed", "rank", "chat"]
    assert all(s["state"] == "succeeded" for s in m["stages"].values())


def test_stops_at_first_failure_with_clear_message():
    plan = make_plan({"embed": [], "rank": ["embed"], "chat": ["rank"]})
    be = MemoryBackend({"r1-embed": [OK], "r1-rank": [RUNNING, FAILED]})
    d = driver(plan, be)
    with pytest.raises(DriveError) as e:
        d.run()
    msg = str(e.value)
    assert "stage 'rank' failed" in msg and "AppFailed" in msg and "exit code 2" in msg
    assert "logs of r1-rank" in msg and "Later stages were not run" in msg
    assert ("create", "r1-chat") not in be.calls
    st = d.manifest["stages"]
    assert d.manifest["state"] == "failed" and d.manifest["failed_stage"] == "rank"
    assert (st["embed"]["state"], st["rank"]["state"], st["chat"]["state"]) == ("succeeded", "failed", "not-run")


def test_resume_skips_published_attaches_to_running_and_retries_failed():
    plan = make_plan({"embed": [], "rank": ["embed"], "chat": ["rank"], "evaluate": ["chat"]})
    existing = {
        "r1-rank": {**rayjob("r1-rank"), "status": RUNNING, "_created": True},   # a driver restart
        "r1-chat": {**rayjob("r1-chat"), "status": FAILED},                      # an earlier failure
    }
    be = MemoryBackend({"r1-rank": [RUNNING, OK], "r1-chat": [OK], "r1-evaluate": [OK]}, existing)
    m = driver(plan, be, published={"embed"}).run()
    assert m["stages"]["embed"]["state"] == "skipped"
    creates = [c[1] for c in be.calls if c[0] == "create"]
    assert creates == ["r1-chat", "r1-evaluate"]                     # rank: attached, not re-created
    assert be.calls.index(("delete", "r1-chat")) < be.calls.index(("create", "r1-chat"))
    assert not any(c[1] == "r1-embed" for c in be.calls)             # published: not even looked up
    assert m["state"] == "succeeded"


def test_success_without_published_output_is_a_failure():
    plan = make_plan({"embed": []})
    be = MemoryBackend({"r1-embed": [OK]})
    d = Driver(plan, be, poll=0, write_manifest=False, check_configs=False, sleep=lambda s: None,
               is_published=lambda st: (False, "not published"))
    with pytest.raises(DriveError, match="succeeded but .* is not published"):
        d.run()


def test_stage_timeout_and_vanished_rayjob():
    plan = make_plan({"embed": []})
    t = iter(range(0, 10_000, 10))
    d = Driver(plan, MemoryBackend({"r1-embed": [RUNNING]}), poll=0, stage_timeout=25, write_manifest=False, check_configs=False,
               sleep=lambda s: None, clock=lambda: next(t), is_published=lambda st: (False, "no"))
    with pytest.raises(DriveError, match="timed out after 25s"):
        d.run()
    be = MemoryBackend({"r1-embed": [RUNNING]})
    d = driver(plan, be)
    be.create = lambda rj: None  # created elsewhere and deleted before the driver saw it
    with pytest.raises(DriveError, match="disappeared"):
        d.run()


# --------------------------------------------------------------------------- fake Kubernetes API
class FakeKubeAPI(ThreadingHTTPServer):
    """rayjobs.ray.io CustomObjects endpoints; scripted status per RayJob name."""

    daemon_threads = True
    PATH = re.compile(r"^/apis/ray\.io/v1/namespaces/(?P<ns>[^/]+)/rayjobs(?:/(?P<name>[^/?]+))?(?:\?.*)?$")

    def __init__(self):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.objects: dict[str, dict] = {}
        self.scripts: dict[str, list[dict]] = {}
        self.requests: list[tuple[str, str]] = []
        self.bodies: list[dict] = []
        self.fail_next: list[int] = []        # HTTP status codes to answer before the real answer
        self.published: set[str] = set()
        self.created: set[str] = set()        # scripts apply to RayJobs created through the API


class _Handler(BaseHTTPRequestHandler):
    server: FakeKubeAPI

    def log_message(self, *a):  # quiet
        pass

    def _send(self, code: int, obj: dict) -> None:
        body = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _status(self, code: int, reason: str, message: str) -> None:
        self._send(code, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": reason,
                          "message": message, "code": code})

    def _handle(self, method: str) -> None:
        srv = self.server
        srv.requests.append((method, self.path))
        if self.headers.get("Authorization") != f"Bearer {TOKEN}":
            return self._status(401, "Unauthorized", "Unauthorized")
        m = srv.PATH.match(self.path)
        if not m:
            return self._status(404, "NotFound", "the server could not find the requested resource")
        if m["ns"] != NS:
            return self._status(403, "Forbidden", f"rayjobs.ray.io is forbidden in namespace {m['ns']}")
        if srv.fail_next:
            code = srv.fail_next.pop(0)
            return self._status(code, "Forbidden" if code == 403 else "InternalError", f"injected {code}")
        name = m["name"]
        if method == "POST":
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            srv.bodies.append(body)
            n = body["metadata"]["name"]
            if n in srv.objects:
                return self._status(409, "AlreadyExists", f'rayjobs.ray.io "{n}" already exists')
            body["metadata"].update(uid=f"uid-{n}", resourceVersion="1")
            srv.objects[n] = body
            srv.created.add(n)
            return self._send(201, body)
        if name is None:
            return self._status(405, "MethodNotAllowed", "list not used")
        obj = srv.objects.get(name)
        if obj is None:
            return self._status(404, "NotFound", f'rayjobs.ray.io "{name}" not found')
        if method == "DELETE":
            del srv.objects[name]
            return self._send(200, {"kind": "Status", "status": "Success"})
        script = srv.scripts.get(name)
        if script and name in srv.created:
            obj["status"] = script.pop(0) if len(script) > 1 else script[0]
            if obj["status"] == OK:
                srv.published.add(name)
        return self._send(200, obj)

    def do_GET(self):
        self._handle("GET")

    def do_POST(self):
        self._handle("POST")

    def do_DELETE(self):
        self._handle("DELETE")


@pytest.fixture
def kube():
    srv = FakeKubeAPI()
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    from kubernetes import client

    cfg = client.Configuration()
    cfg.host = f"http://127.0.0.1:{srv.server_address[1]}"
    cfg.api_key = {"authorization": TOKEN}
    cfg.api_key_prefix = {"authorization": "Bearer"}
    backend = KubernetesBackend(NS, client.ApiClient(cfg), retries=3, backoff=0.01)
    yield srv, backend
    srv.shutdown()
    srv.server_close()


def _only_rayjobs_in_namespace(srv: FakeKubeAPI) -> None:
    for method, path in srv.requests:
        assert path.startswith(f"/apis/ray.io/v1/namespaces/{NS}/rayjobs"), path
        assert method in ("GET", "POST", "DELETE")


def test_kubernetes_backend_runs_plan_through_real_client(kube):
    srv, backend = kube
    plan = make_plan({"embed": [], "rank": ["embed"]})
    srv.scripts = {"r1-embed": [{}, {"jobDeploymentStatus": "Initializing"}, RUNNING, OK],
                   "r1-rank": [RUNNING, OK]}
    srv.fail_next = [503]  # one transient API error: retried
    d = Driver(plan, backend, poll=0, write_manifest=False, check_configs=False, sleep=lambda s: None,
               is_published=lambda st: (f"r1-{st.name}" in srv.published, "?"))
    m = d.run()
    assert m["state"] == "succeeded"
    assert [b["metadata"]["name"] for b in srv.bodies] == ["r1-embed", "r1-rank"]
    # the body is the plan's RayJob, in the driver's namespace
    assert srv.bodies[0]["spec"] == plan.stages[0].rayjob["spec"]
    assert srv.bodies[0]["metadata"]["namespace"] == NS and srv.bodies[0]["metadata"]["labels"] == {"x": "y"}
    _only_rayjobs_in_namespace(srv)


def test_kubernetes_backend_failure_retry_and_rbac(kube):
    srv, backend = kube
    plan = make_plan({"embed": [], "rank": ["embed"]})
    # an earlier attempt left a failed RayJob for rank; embed is published
    srv.objects["r1-rank"] = {**rayjob("r1-rank"), "status": FAILED}
    srv.scripts = {"r1-rank": [RUNNING, {**FAILED, "message": "ValueError: bad prompt"}]}
    d = Driver(plan, backend, poll=0, write_manifest=False, check_configs=False, sleep=lambda s: None,
               is_published=lambda st: (st.name == "embed", "?"))
    with pytest.raises(DriveError, match="stage 'rank' failed.*ValueError: bad prompt.*kubectl -n ms-test"):
        d.run()
    methods = [(m, p.split("?")[0].rsplit("/", 1)[-1]) for m, p in srv.requests]
    assert ("DELETE", "r1-rank") in methods
    assert methods.index(("DELETE", "r1-rank")) < methods.index(("POST", "rayjobs"))
    _only_rayjobs_in_namespace(srv)
    # RBAC refusal: a clear message naming what the Role must grant
    srv.objects.clear()
    srv.fail_next = [403]
    with pytest.raises(DriveError, match="get/create/delete on rayjobs.ray.io"):
        backend.get("r1-embed")
    # an attach after 409 (created concurrently) is not an error
    backend.create(rayjob("r1-x"))
    backend.create(rayjob("r1-x"))
    assert "r1-x" in srv.objects


def test_missing_crd_is_reported(kube):
    srv, backend = kube
    backend.namespace = NS
    srv.PATH = re.compile(r"^$")  # nothing is served: like a cluster without the KubeRay CRDs
    try:
        with pytest.raises(DriveError, match="RayJob CRD is not installed"):
            backend.create(rayjob("r1-embed"))
    finally:
        srv.PATH = FakeKubeAPI.PATH


# --------------------------------------------------------------------------- resume on real storage
def test_published_hash_and_run_manifest_on_s3(s3_root, kube):
    """The driver skips a stage published with the same config (runtime fields ignored), re-runs it for
    another config, and writes the run manifest to S3 as it goes."""
    from memsifter import stage as stg

    srv, backend = kube
    cfg = {"output": storage.join(s3_root, "synth"), "questions": 2, "sessions_per_question": 3}
    stg.get_stage("synth").run(cfg)
    st = StagePlan("synth", "synth", cfg, rayjob("r1-synth"))
    assert published_hash(st)[0]
    other = StagePlan("synth", "synth", {**cfg, "seed": 7}, rayjob("r1-synth"))
    ok, why = published_hash(other)
    assert not ok and "another config" in why
    assert not published_hash(StagePlan("synth", "synth", {**cfg, "output": cfg["output"] + "x"}, rayjob("r")))[0]

    plan = Plan.from_dict({"run": {"id": "r1", "root": s3_root},
                           "stages": [{"name": "synth", "needs": [], "config": cfg, "rayjob": rayjob("r1-synth")}]})
    m = Driver(plan, backend, poll=0, sleep=lambda s: None).run()
    assert m["stages"]["synth"]["state"] == "skipped"
    assert srv.requests == []  # nothing to create
    saved = storage.read_json(storage.join(s3_root, "_run", "manifest.json"))
    assert saved["state"] == "succeeded" and saved["stages"]["synth"]["state"] == "skipped"
    assert saved["run"]["id"] == "r1"


def test_preflight_rejects_bad_configs_before_starting_anything():
    plan = Plan.from_dict({"run": {"id": "r1", "root": "s3://b/r"}, "stages": [
        {"name": "synth", "needs": [], "config": {"output": "s3://b/r/synth", "questions": 0}, "rayjob": rayjob("r1-synth")},
    ]})
    be = MemoryBackend()
    with pytest.raises(DriveError, match="(?s)nothing was started.*questions"):
        Driver(plan, be, poll=0, write_manifest=False, sleep=lambda s: None).run()
    assert be.calls == []


def test_local_config_entrypoint_replaces_the_mounted_config(tmp_path):
    """RayBackend's stand-in for the ConfigMap the head pod mounts: the document goes to a local file and the
    entrypoint's --config points there; everything else (await-capacity, the stage) is kept."""
    import shlex

    import yaml

    from memsifter.k8s.driver import local_config_entrypoint

    ep = ("memsifter k8s await-capacity --nodes 1 --gpus-per-node 8 --timeout 60 -- "
          "memsifter run train --config /etc/memsifter/train.yaml")
    path = tmp_path / "rj.yaml"
    words = shlex.split(local_config_entrypoint(ep, {"output": "s3://b/r/train", "nnodes": 1}, str(path)))
    assert words[:10] == shlex.split(ep)[:10] and words[-2:] == ["--config", str(path)]
    assert yaml.safe_load(path.read_text()) == {"output": "s3://b/r/train", "nnodes": 1}
    assert local_config_entrypoint(ep, None, str(tmp_path / "x.yaml")) == shlex.join(shlex.split(ep))
