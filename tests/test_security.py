"""checkov (the real scanner, pinned, in its own venv) over everything memsifter ships to a cluster.

Every rendered chart scenario (with and without the driver, and with the NetworkPolicy on), the pods KubeRay
builds from each RayJob, jobs/, k8s/*.yaml and images/*/Dockerfile: every failed check must be justified in
k8s/policy/checkov-skips.yaml (and k8s/SECURITY.md); a new finding or a stale justification fails. Needs PyPI
once to install checkov into the cache (skipped, with the reason, only if that install fails).

Run on its own: ``python -m memsifter_dev.k8s.policy`` prints the same report.
"""

from __future__ import annotations

import re

import pytest
import yaml

from memsifter_dev.k8s import chart, policy
from memsifter_dev.k8s.tools import ToolError, checkov_binary


@pytest.fixture(scope="session")
def checkov() -> str:
    try:
        return checkov_binary()
    except ToolError as e:
        pytest.skip(f"checkov could not be installed (needs PyPI once): {e}")


BAD = "/manifests/bad.yaml"   # the regression's file in the scan tree (no shipped file has that name)


@pytest.fixture(scope="module")
def scans(checkov, tmp_path_factory):
    """One checkov run (its start-up is much of a scan's time) over the tree ``python -m memsifter_dev.k8s.policy``
    scans and, beside it, a chart rendered with a privileged, writable, root-capable Ray container: the report
    on what memsifter ships and the report on that regression, each classified against the skips on its own."""
    docs = chart.render_docs([chart.CHART_DIR / "ci" / "minimal-cpu.yaml"],
                             ["driver.enabled=false", "containerSecurityContext.allowPrivilegeEscalation=true",
                              "containerSecurityContext.readOnlyRootFilesystem=false",
                              "podSecurityContext.runAsNonRoot=false", "podSecurityContext.runAsUser=0",
                              "containerSecurityContext.runAsNonRoot=false"])
    manifests = policy.shipped_manifests()
    assert BAD not in {"/" + k for k in manifests}
    manifests[BAD.lstrip("/")] = policy.validate.workload_manifests(docs)
    findings, passed = policy.run_checkov(policy.write_scan_tree(tmp_path_factory.mktemp("checkov"), manifests))
    skips = policy.load_skips()
    shipped = policy.classify([f for f in findings if f.file != BAD], passed, skips)
    regression = policy.classify([f for f in findings if f.file == BAD], passed, skips)
    return shipped, regression


def test_checkov_findings_are_all_fixed_or_justified(scans):
    report = scans[0]
    print("\n" + report.text())
    assert report.ok, report.text()
    # the scan really ran over the rendered pods, not over nothing (what ships passes tens of thousands of checks;
    # the regression's file alone passes over a thousand, and checkov counts both in one total)
    assert report.passed > 10000
    # the chart's pods were scanned (not only the driver Job): RayJob heads/workers/submitters are in there
    scanned = {f.resource for f in report.findings}
    assert any(r.startswith("Pod.") and r.endswith("-head") for r in scanned)
    assert any(r.startswith("Job.") and r.endswith("-submitter") for r in scanned)
    assert any(f.framework == "dockerfile" for f in report.findings)
    # with the NetworkPolicy enabled every pod is covered: no justification needed there
    assert not [f for f in report.findings if f.check_id == "CKV2_K8S_6" and f.file.startswith("/netpol/")]


def test_checkov_gate_fails_on_a_regression(scans):
    """A privileged, writable, root-capable Ray container is reported as unexplained findings."""
    rep = scans[1]
    bad = {f.check_id for f in rep.unexplained}
    assert {"CKV_K8S_20", "CKV_K8S_22", "CKV_K8S_23"} <= bad, rep.text()
    assert not rep.ok


def test_every_justification_is_documented():
    skips = policy.load_skips()
    doc = (chart.REPO / "k8s" / "SECURITY.md").read_text()
    assert skips
    for s in skips:
        assert re.search(rf"\b{re.escape(s.check)}\b", doc), f"{s.check} is justified but not in k8s/SECURITY.md"
        assert len(s.reason) > 40, s.check
    pinned = yaml.safe_load(policy.SKIPS_FILE.read_text())["checkov"]
    from memsifter_dev.k8s.tools import CHECKOV_VERSION

    assert pinned == CHECKOV_VERSION  # the list was reviewed against this checkov


def test_skips_file_is_checked(tmp_path):
    p = tmp_path / "s.yaml"
    p.write_text("skips:\n  - check: CKV_K8S_1\n    resoruces: ['*']\n    reason: typo in a key\n")
    with pytest.raises(ValueError, match=r"skips\[0\].*resoruces"):
        policy.load_skips(p)
    p.write_text("skips:\n  - check: CKV_K8S_1\n")
    with pytest.raises(ValueError, match="reason"):
        policy.load_skips(p)
