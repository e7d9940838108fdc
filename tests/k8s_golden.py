"""Golden copies of what the chart renders: the pods and RayJob settings of every ci/ scenario and jobs/ file.

``python tests/k8s_golden.py`` renders the chart (``helm template``) for every ``charts/memsifter/ci/*.yaml``
scenario with the driver (RayJobs inside the plan ConfigMap) and without it, the default values, the full
scenario with the NetworkPolicy on, and reads every ``jobs/<stage>.yaml``; it writes their *normalized*
form to ``tests/golden/<render>.yaml``. ``tests/test_k8s_golden.py`` renders again and diffs.

Normalized = what a cluster runs, minus how a stage's config travels (issue 18, item 3: from
``--set k=<json>`` pairs in the entrypoint to a mounted config document):

* a RayJob's ``spec.entrypoint`` is reduced to its command (``memsifter run <stage>``, behind ``memsifter k8s
  await-capacity ...`` for multi-node stages): the config arguments (``--set``/``--config``) are dropped;
* the config volume and its mount (``/etc/memsifter``) of the head pod, the stage-config ConfigMaps, the
  ``memsifter.io/output``/``needs``/``uses`` annotations and the driver pod's ``checksum/plan`` are left
  out; the plan ConfigMap keeps only each stage's name and (normalized) RayJob.

Everything else (head/worker/submitter pod templates, autoscaler options, group sizes, deadlines, the driver
Job, RBAC, NetworkPolicy) must stay byte-for-byte the same object.
"""

from __future__ import annotations

import copy
import json
import shlex
import sys
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "charts" / "memsifter"
JOBS = REPO / "jobs"
GOLDEN = Path(__file__).resolve().parent / "golden"
CONFIG_MOUNT = "/etc/memsifter"
DROPPED_ANNOTATIONS = ("memsifter.io/output", "memsifter.io/needs", "memsifter.io/uses", "checksum/plan")


def _render(values: list[Path], sets: list[str]) -> list[dict]:
    from memsifter_dev.k8s.tools import helm

    args = ["template", "memsifter", str(CHART), "--namespace", "memsifter"]
    for v in values:
        args += ["-f", str(v)]
    for s in sets:
        args += ["--set", s]
    return [d for d in yaml.safe_load_all(helm(*args).stdout) if d]


def names() -> list[str]:
    """The names of :func:`renders`, without rendering."""
    out = ["defaults", "full+netpol"]
    for f in sorted((CHART / "ci").glob("*.yaml")):
        out += [f.stem, f.stem + "+nodriver"]
    return out + ["jobs-" + p.stem for p in sorted(JOBS.glob("*.yaml")) if p.stem != "values"]


def renders() -> dict[str, list[dict]]:
    """Render name -> manifests (the same set the chart tests check)."""
    out: dict[str, list[dict]] = {"defaults": _render([], [])}
    for f in sorted((CHART / "ci").glob("*.yaml")):
        out[f.stem] = _render([f], [])
        out[f.stem + "+nodriver"] = _render([f], ["driver.enabled=false"])
    out["full+netpol"] = _render([CHART / "ci" / "full.yaml"], ["networkPolicy.enabled=true"])
    for p in sorted(JOBS.glob("*.yaml")):
        if p.stem != "values":
            out["jobs-" + p.stem] = [d for d in yaml.safe_load_all(p.read_text()) if d]
    return out


def command(entrypoint: str) -> list[str]:
    """The entrypoint's words up to and including ``memsifter run <stage>`` (config arguments dropped)."""
    words = shlex.split(entrypoint)
    i = words.index("run", words.index("--") + 1 if "--" in words else 0)
    return words[:i + 2]


def _drop_annotations(meta: dict) -> None:
    ann = meta.get("annotations") or {}
    for k in DROPPED_ANNOTATIONS:
        ann.pop(k, None)
    if "annotations" in meta and not ann:
        meta.pop("annotations")


def _drop_config_mount(pod: dict) -> None:
    spec = pod["spec"]
    names = set()
    for c in spec.get("containers") or []:
        mounts = c.get("volumeMounts") or []
        names |= {m["name"] for m in mounts if m["mountPath"] == CONFIG_MOUNT}
        c["volumeMounts"] = [m for m in mounts if m["mountPath"] != CONFIG_MOUNT]
    spec["volumes"] = [v for v in spec.get("volumes") or [] if v["name"] not in names]


def rayjob(rj: dict) -> dict:
    rj = copy.deepcopy(rj)
    _drop_annotations(rj["metadata"])
    rj["spec"]["entrypoint"] = command(rj["spec"]["entrypoint"])
    rcs = rj["spec"]["rayClusterSpec"]
    _drop_config_mount(rcs["headGroupSpec"]["template"])
    return rj


def normalize(docs: list[dict]) -> dict[str, Any]:
    """``{"<kind>/<name>": object}`` of a render, normalized (see the module docstring)."""
    out: dict[str, Any] = {}
    for d in docs:
        kind, name = d["kind"], d["metadata"]["name"]
        if kind == "ConfigMap":
            data = d.get("data") or {}
            if "plan.json" not in data:
                continue  # a stage's config document: the config form, not compared
            plan = json.loads(data["plan.json"])
            for s in plan["stages"]:
                out[f"PlanStage/{s['name']}"] = rayjob(s["rayjob"])
            d = copy.deepcopy(d)
            d["data"] = {"plan.json": {"run": plan["run"], "stages": [s["name"] for s in plan["stages"]]}}
        elif kind == "RayJob":
            d = rayjob(d)
        else:
            d = copy.deepcopy(d)
            if kind == "Job":
                _drop_annotations(d["spec"]["template"]["metadata"])
        out[f"{kind}/{name}"] = d
    return out


def dump(obj: Any) -> str:
    return yaml.safe_dump(obj, sort_keys=True, default_flow_style=None, width=200)


def stored(name: str) -> bool:
    """Renders kept as files; the others are derived from them (:func:`expected`)."""
    return not name.endswith("+nodriver") and name != "full+netpol"


def load(name: str, src: Path = GOLDEN) -> dict[str, Any]:
    return yaml.safe_load((src / f"{name}.yaml").read_text())


def expected(name: str, src: Path = GOLDEN) -> dict[str, Any]:
    """The golden normalized render ``name``. Without the driver, the RayJobs are the plan's, created by helm
    directly, and nothing else is rendered but the memory service's RayService (helm creates it either way);
    with the NetworkPolicy on, the full render plus the policy."""
    if name.endswith("+nodriver"):
        base = load(name[:-len("+nodriver")], src)
        return {**{f"RayJob/{rj['metadata']['name']}": rj for k, rj in base.items() if k.startswith("PlanStage/")},
                **{k: v for k, v in base.items() if k.startswith("RayService/")}}
    if name == "full+netpol":
        return {**load("full", src), **load("netpol", src)}
    return load(name, src)


def write(dest: Path = GOLDEN) -> list[Path]:
    dest.mkdir(parents=True, exist_ok=True)
    written = []
    for name, docs in renders().items():
        norm = normalize(docs)
        if name == "full+netpol":
            name, norm = "netpol", {k: v for k, v in norm.items() if k.startswith("NetworkPolicy/")}
        elif not stored(name):
            continue
        p = dest / f"{name}.yaml"
        p.write_text("# tests/k8s_golden.py: normalized render (see its docstring); regenerate only on purpose.\n"
                     + dump(norm))
        written.append(p)
    return written


if __name__ == "__main__":
    for p in write():
        print(p.relative_to(REPO))
    sys.exit(0)
