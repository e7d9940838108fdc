"""checkov over everything memsifter ships to a cluster, against a reviewed allow-list.

What is scanned (one checkov run, frameworks ``kubernetes`` and ``dockerfile``):

* ``manifests/``: every chart scenario (``charts/memsifter/ci/*.yaml``) rendered by ``helm template`` with the
  driver (RayJobs inside the plan ConfigMap) and without it (RayJobs as objects), the chart's defaults,
  ``jobs/*.yaml`` and the cluster prerequisites ``k8s/*.yaml``;
* ``netpol/``: the full scenario with ``networkPolicy.enabled=true`` (pods must then be covered by a policy);
* ``images/``: the Dockerfiles.

checkov does not look inside custom resources, so the pods KubeRay creates from each RayJob (head with its
autoscaler sidecar, workers, the submitter Job) are added as core kinds
(:func:`memsifter.k8s.validate.workload_manifests`). checkov's helm framework would render the chart with its
default values only (no plan, so no pod at all): rendering every scenario here covers more.

Every failed check must be fixed or justified in ``k8s/policy/checkov-skips.yaml`` (check id, the resources and
files it applies to, the reason; mirrored in ``k8s/SECURITY.md``). Offline, checkov reports no severities, so
every failed check counts. A skip that no longer matches any finding is reported as stale.

``python -m memsifter_dev.k8s.policy`` prints the report and exits 1 on an unexplained finding or a stale skip.
"""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import yaml

from memsifter.k8s import validate

from . import chart
from .tools import ToolError, checkov_binary

SKIPS_FILE = chart.REPO / "k8s" / "policy" / "checkov-skips.yaml"
FRAMEWORKS = ("kubernetes", "dockerfile")


@dataclass(frozen=True)
class Finding:
    check_id: str
    check_name: str
    resource: str
    file: str          # path inside the scan tree, e.g. /manifests/full.yaml
    framework: str


@dataclass
class Skip:
    check: str
    reason: str
    resources: list[str]
    files: list[str]

    def matches(self, f: Finding) -> bool:
        return (f.check_id == self.check and any(fnmatch.fnmatchcase(f.resource, p) for p in self.resources)
                and any(fnmatch.fnmatchcase(f.file, p) for p in self.files))


def load_skips(path: Path = SKIPS_FILE) -> list[Skip]:
    data = yaml.safe_load(path.read_text()) or {}
    out = []
    for i, s in enumerate(data.get("skips") or []):
        missing = [k for k in ("check", "reason") if not s.get(k)]
        unknown = set(s) - {"check", "reason", "resources", "files"}
        if missing or unknown:
            raise ValueError(f"{path}: skips[{i}]: missing {missing} / unknown keys {sorted(unknown)}")
        out.append(Skip(s["check"], " ".join(str(s["reason"]).split()), list(s.get("resources") or ["*"]),
                        list(s.get("files") or ["*"])))
    return out


# --------------------------------------------------------------------------- what we ship
def _dump_all(docs: list[dict]) -> str:
    return "".join("---\n" + yaml.safe_dump(d, sort_keys=False) for d in docs)


def shipped_manifests() -> dict[str, list[dict]]:
    """Scan-tree path -> documents (pods inside RayJobs expanded)."""
    out: dict[str, list[dict]] = {}
    for f in sorted((chart.CHART_DIR / "ci").glob("*.yaml")):
        out[f"manifests/{f.stem}.yaml"] = chart.render_docs([f])
        out[f"manifests/{f.stem}-nodriver.yaml"] = chart.render_docs([f], ["driver.enabled=false"])
    out["manifests/defaults.yaml"] = chart.render_docs([])
    # another release name: checkov links policies to pods by labels across all files of the scan
    full = chart.CHART_DIR / "ci" / "full.yaml"
    out["netpol/full.yaml"] = chart.render_docs([full], ["networkPolicy.enabled=true"], release="netpol")
    out["netpol/full-nodriver.yaml"] = chart.render_docs([full], ["networkPolicy.enabled=true", "driver.enabled=false"],
                                                         release="netpol")
    for p in sorted(chart.JOBS_DIR.glob("*.yaml")):
        if p.stem != "values":
            out[f"manifests/jobs-{p.stem}.yaml"] = [d for d in yaml.safe_load_all(p.read_text()) if d]
    for p in sorted((chart.REPO / "k8s").glob("*.yaml")):  # the cluster prerequisites
        out[f"manifests/k8s-{p.stem}.yaml"] = [d for d in yaml.safe_load_all(p.read_text()) if d]
    return {k: validate.workload_manifests(v) for k, v in out.items()}


def write_scan_tree(dest: Path, manifests: dict[str, list[dict]] | None = None,
                    images_dir: Path = chart.IMAGES_DIR) -> Path:
    manifests = shipped_manifests() if manifests is None else manifests
    for rel, docs in manifests.items():
        p = dest / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(_dump_all(docs))
    for df in sorted(images_dir.glob("*/Dockerfile")):
        p = dest / "images" / df.parent.name / "Dockerfile"
        p.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(df, p)
    return dest


# --------------------------------------------------------------------------- checkov
def run_checkov(tree: Path, timeout: float = 600) -> tuple[list[Finding], int]:
    """(failed checks, number of passed checks) of one offline checkov run over ``tree``."""
    exe = checkov_binary()
    env = {**os.environ, "BC_SKIP_MAPPING": "TRUE", "CHECKOV_RUN_SCA_PACKAGE_SCAN_V2": "false",
           "LOG_LEVEL": "ERROR"}
    cmd = [exe, "-d", str(tree), "--framework", *FRAMEWORKS, "--output", "json", "--quiet", "--compact",
           "--skip-download", "--soft-fail"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=tree)
    try:
        data = json.loads(proc.stdout)
    except json.JSONDecodeError as e:
        raise ToolError(f"checkov printed no JSON ({proc.returncode}): {proc.stderr.strip()[-2000:]}") from e
    reports = data if isinstance(data, list) else [data]
    findings, passed = [], 0
    for r in reports:
        if "results" not in r:  # a framework with nothing to scan reports only a summary
            continue
        passed += int(r["summary"].get("passed", 0))
        if r["summary"].get("parsing_errors"):
            raise ToolError(f"checkov could not parse: {r['results'].get('parsing_errors')}")
        for c in r["results"].get("failed_checks") or []:
            findings.append(Finding(c["check_id"], c.get("check_name", ""), c.get("resource", ""),
                                    c.get("file_path", ""), r.get("check_type", "")))
    return sorted(set(findings), key=lambda f: (f.check_id, f.file, f.resource)), passed


@dataclass
class Report:
    findings: list[Finding]
    passed: int
    justified: dict[str, list[Finding]]     # check id -> findings covered by a skip
    unexplained: list[Finding]
    stale: list[Skip]

    @property
    def ok(self) -> bool:
        return not self.unexplained and not self.stale

    def text(self) -> str:
        lines = [f"checkov {FRAMEWORKS}: {self.passed} passed, {len(self.findings)} failed "
                 f"({len(self.findings) - len(self.unexplained)} justified in k8s/policy/checkov-skips.yaml, "
                 f"{len(self.unexplained)} unexplained), {len(self.stale)} stale skips"]
        for cid, fs in sorted(self.justified.items()):
            lines.append(f"  justified {cid:<12} x{len(fs):<4} {fs[0].check_name}")
        for f in self.unexplained:
            lines.append(f"  UNEXPLAINED {f.check_id} {f.check_name}: {f.resource} in {f.file}")
        for s in self.stale:
            lines.append(f"  STALE skip {s.check} (resources {s.resources}, files {s.files}): matches nothing")
        return "\n".join(lines)


def classify(findings: list[Finding], passed: int, skips: list[Skip]) -> Report:
    justified: dict[str, list[Finding]] = {}
    unexplained, used = [], set()
    for f in findings:
        hit = next((i for i, s in enumerate(skips) if s.matches(f)), None)
        if hit is None:
            unexplained.append(f)
        else:
            used.add(hit)
            justified.setdefault(f.check_id, []).append(f)
    stale = [s for i, s in enumerate(skips) if i not in used]
    return Report(findings, passed, justified, unexplained, stale)


def scan(skips_file: Path = SKIPS_FILE) -> Report:
    with tempfile.TemporaryDirectory(prefix="memsifter-checkov-") as d:
        findings, passed = run_checkov(write_scan_tree(Path(d)))
    return classify(findings, passed, load_skips(skips_file))


def main(argv: list[str] | None = None) -> int:
    report = scan()
    print(report.text())
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
