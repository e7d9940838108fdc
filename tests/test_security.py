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


@pytest.fixture(scope="module")
def report(checkov):
    return policy.scan()


def test_checkov_findings_are_all_fixed_or_justified(report):
    print("\n" + report.text())
    assert report.ok, report.text()
    assert report.passed > 1000  # the scan really ran over the rendered pods, not over nothing
    # the chart's pods were scanned (not only the driver Job): RayJob heads/workers/submitters are in there
    scanned = {f.resource for f in report.findings}
    assert any(r.startswith("Pod.") and r.endswith("-head") for r in scanned)
    assert any(r.startswith("Job.") and r.endswith("-submitter") for r in scanned)
    assert any(f.framework == "dockerfile" for f in report.findings)
    # with the NetworkPolicy enabled every pod is covered: no justification needed there
    assert not [f for f in report.findings if f.check_id == "CKV2_K8S_6" and f.file.startswith("/netpol/")]


def test_checkov_gate_fails_on_a_regression(checkov, tmp_path):
    """A privileged, writable, root-capable Ray container is reported as unexplained findings."""
    docs = chart.render_docs([chart.CHART_DIR / "ci" / "minimal-cpu.yaml"],
                             ["driver.enabled=false", "containerSecurityContext.allowPrivilegeEscalation=true",
                              "containerSecurityContext.readOnlyRootFilesystem=false",
                              "podSecurityContext.runAsNonRoot=false", "podSecurityContext.runAsUser=0",
                              "containerSecurityContext.runAsNonRoot=false"])
    tree = policy.write_scan_tree(tmp_path, {"manifests/bad.yaml": policy.validate.workload_manifests(docs)},
                                  images_dir=tmp_path / "no-images")
    findings, passed = policy.run_checkov(tree)
    rep = policy.classify(findings, passed, policy.load_skips())
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
