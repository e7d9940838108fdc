"""The chart renders the same workloads as before issue 18's redesign, for every ci/ scenario and jobs/ file.

``tests/golden/`` holds the normalized renders taken from the chart before the redesign (``tests/k8s_golden.py``:
how, and what is left out: only the form in which a stage's config travels — ``--set`` pairs then, a mounted
config document now). Every object there must come out identical: head/worker/submitter pod templates,
autoscaler options, group sizes, deadlines, the driver Job, RBAC, NetworkPolicy. Stages registered since
(no golden render) may add their own RayJobs; nothing else may appear.

Regenerate only on purpose, after reviewing the diff this test prints: ``python tests/k8s_golden.py``.
"""

from __future__ import annotations

import difflib

import k8s_golden as golden
import pytest


@pytest.fixture(scope="module")
def renders() -> dict[str, list[dict]]:
    return golden.renders()


def _stages(norm: dict) -> set[str]:
    return {v["metadata"]["labels"]["memsifter.io/stage"] for k, v in norm.items()
            if k.startswith(("RayJob/", "PlanStage/"))}


@pytest.mark.parametrize("name", golden.names())
def test_rendered_pods_unchanged(name, renders):
    try:
        want = golden.expected(name)
    except FileNotFoundError:
        pytest.skip(f"{name}: no golden render (a stage registered after the redesign)")
    got = golden.normalize(renders[name])
    known = _stages(want)
    for key in sorted(set(want) | set(got)):
        if key not in want:
            obj = got[key]
            stage = obj.get("metadata", {}).get("labels", {}).get("memsifter.io/stage")
            assert key.startswith(("RayJob/", "PlanStage/")) and stage not in known, f"{name}: new object {key}"
            continue
        assert key in got, f"{name}: {key} is no longer rendered"
        a, b = want[key], got[key]
        if key.startswith("ConfigMap/"):  # the plan: new stages may join its list
            pa, pb = a["data"]["plan.json"], b["data"]["plan.json"]
            assert [s for s in pb["stages"] if s in pa["stages"]] == pa["stages"], name
            a = {**a, "data": {"plan.json": {**pa, "stages": None}}}
            b = {**b, "data": {"plan.json": {**pb, "stages": None}}}
        if a != b:
            diff = "\n".join(difflib.unified_diff(golden.dump(a).splitlines(), golden.dump(b).splitlines(),
                                                  "golden", "now", lineterm="", n=2))
            pytest.fail(f"{name}: {key} differs from the golden render:\n{diff}")
