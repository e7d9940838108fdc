"""The offline RayJob checks themselves: each rule catches what it is for (memsifter.k8s.validate)."""

from __future__ import annotations

import copy

import pytest
import yaml

from memsifter.k8s import validate
from memsifter_dev.k8s import chart


@pytest.fixture(scope="module")
def crd(shared_dir):
    return validate.crd_schema(shared_dir / "crds" / "ray.io_rayjobs.yaml")


@pytest.fixture(scope="module")
def good() -> dict:
    """A rendered RayJob (the first stage of the registry, with the jobs/ example values)."""
    docs = [d for p in sorted(chart.JOBS_DIR.glob("*.yaml")) if p.stem != "values"
            for d in yaml.safe_load_all(p.read_text()) if d and d["kind"] == "RayJob"]
    assert docs, "jobs/ is empty: run `memsifter k8s gen-jobs`"
    return docs[0]


def mutated(rj: dict, fn) -> dict:
    out = copy.deepcopy(rj)
    fn(out)
    return out


def test_good_rayjob_passes(good, crd):
    assert validate.validate_rayjob(good, crd) == []


def test_every_cel_rule_is_understood(crd):
    rules = validate.cel_rules(crd)
    assert len(rules) >= 5
    for _, rule in rules:
        validate.translate_cel(rule["rule"])  # raises UnsupportedRule for anything new
    with pytest.raises(validate.UnsupportedRule):
        validate.translate_cel("self.size() > 2")


@pytest.mark.parametrize("change,expect", [
    (lambda r: r["spec"].update(entrypointt="x"), "entrypointt"),
    (lambda r: r["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
     .update(imagePullPolicyy="x"), "imagePullPolicyy"),
    (lambda r: r["spec"].update(backoffLimit="3"), "is not of type 'integer'"),
    (lambda r: r["spec"].update(managedBy="someone/else"), "managedBy field value must be"),
    (lambda r: r["spec"].update(deletionStrategy={"onSuccess": {"policy": "DeleteCluster"}}),
     "requires either BOTH onSuccess and onFailure"),
    (lambda r: r["spec"].update(deletionStrategy={"deletionRules": [{"policy": "DeleteCluster", "condition": {
        "jobStatus": "SUCCEEDED", "jobDeploymentStatus": "Complete"}}]}), "cannot be used together"),
])
def test_schema_and_cel_reject(good, crd, change, expect):
    errs = validate.validate_rayjob(mutated(good, change), crd)
    assert any(expect in e for e in errs), errs


@pytest.mark.parametrize("change,expect", [
    (lambda r: r["metadata"].update(name="x" * 48), "no more than 47"),
    (lambda r: r["metadata"].update(name="9-starts-with-digit"), "DNS1035"),
    (lambda r: r["metadata"]["labels"].update({"bad key!": "v"}), "invalid label"),
    (lambda r: r["spec"].update(shutdownAfterJobFinishes=False, ttlSecondsAfterFinished=60),
     "cannot have TTLSecondsAfterFinished"),
    (lambda r: r["spec"].update(suspend=True, shutdownAfterJobFinishes=False), "not allowed to be suspended"),
    (lambda r: r["spec"].update(activeDeadlineSeconds=0), "activeDeadlineSeconds must be a positive"),
    (lambda r: r["spec"].update(backoffLimit=-1), "backoffLimit must be"),
    (lambda r: r["spec"].update(runtimeEnvYAML="a: [unclosed"), "runtimeEnvYAML is not valid YAML"),
    (lambda r: r["spec"].pop("rayClusterSpec"), "one of RayClusterSpec or ClusterSelector"),
    (lambda r: r["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"].update(containers=[]),
     "at least one container"),
    (lambda r: r["spec"]["rayClusterSpec"]["headGroupSpec"].update(rayStartParams={"num-cpus": "1"},
                                                                    resources={"CPU": "1"}), "both rayStartParams"),
    (lambda r: r["spec"]["rayClusterSpec"]["headGroupSpec"].update(rayStartParams={"labels": "a=b"}),
     "rayStartParams['labels']"),
    (lambda r: r["spec"].update(entrypoint=r["spec"]["entrypoint"] + " && echo done"), "shell operators"),
    (lambda r: r["spec"].update(entrypoint=r["spec"]["entrypoint"] + " > /tmp/log"), "shell operators"),
    (lambda r: r["spec"].update(entrypoint="memsifter run $(cat x)"), "command substitution"),
    (lambda r: r["spec"].update(entrypoint="memsifter run a\nmemsifter run b"), "several lines"),
    (lambda r: r["spec"].update(submissionMode="InteractiveMode", backoffLimit=2), "InteractiveMode"),
])
def test_kuberay_admission_rules(good, change, expect):
    errs = validate.kuberay_errors(mutated(good, change))
    assert any(expect in e for e in errs), errs


def test_submitter_round_trip_keeps_arguments():
    ep = """memsifter run x --set 'a="it'\\''s a \\"quote\\" $HOME"' --set 'b={"k": [1, 2]}'"""
    import shlex

    assert validate.entrypoint_errors(ep) == []
    assert shlex.split(validate.submitted_entrypoint(ep)) == shlex.split(ep)
    assert shlex.split(ep)[4] == """a="it's a \\"quote\\" $HOME\""""


def test_strict_schema_keeps_free_form_maps(crd):
    strict = validate.strict_schema(crd)
    spec = strict["properties"]["spec"]
    assert spec["additionalProperties"] is False
    head = spec["properties"]["rayClusterSpec"]["properties"]["headGroupSpec"]
    assert head["additionalProperties"] is False
    assert head["properties"]["rayStartParams"]["additionalProperties"] == {"type": "string"}  # a map stays open


# --------------------------------------------------------------------------- the packaged CRDs (issue 41)
def test_packaged_crds_are_kuberay_v1_7_0(shared_dir):
    """The three CRDs ship inside the package (gzipped, in package-data) with their Apache-2.0 licence, and are
    byte-identical to the KubeRay v1.7.0 snapshots of the project's shared folder (sha256 in PROVENANCE.md)."""
    import fnmatch
    import gzip
    import hashlib
    import tomllib

    d = validate.CRD_DIR
    assert "Apache License" in (d / "LICENSE").read_text() and "Version 2.0" in (d / "LICENSE").read_text()
    provenance = (d / "PROVENANCE.md").read_text()
    globs = tomllib.loads((chart.REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["memsifter"]
    shipped = [str(p.relative_to(chart.REPO / "memsifter")) for p in d.iterdir()]
    assert all(any(fnmatch.fnmatch(f, g) for g in globs) for f in shipped), (shipped, globs)
    for kind in ("RayJob", "RayService", "RayCluster"):
        path = validate.packaged_crd(kind)
        raw = gzip.decompress(path.read_bytes())
        assert raw == (shared_dir / "crds" / path.name.removesuffix(".gz")).read_bytes()
        assert hashlib.sha256(raw).hexdigest() in provenance
        assert validate.crd_kind(validate.read_crd(path)) == kind
        assert validate.kind_schema(kind)["properties"]["spec"]


def _validate_cli(*args: str) -> tuple[int, str]:
    import contextlib
    import io

    from memsifter.k8s import cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main(["validate", *args])
    return rc, out.getvalue() + err.getvalue()


def test_validate_cli_checks_schema_with_the_packaged_crds(tmp_path, good):
    """`memsifter k8s validate FILE` with no --crd checks the CRD schema (a misspelt field fails), for RayJobs
    and the RayService of jobs/; --crd still takes a file (plain YAML) of its kind."""
    rc, out = _validate_cli(str(chart.JOBS_DIR / "embed.yaml"), str(chart.JOBS_DIR / "serve.yaml"))
    assert rc == 0 and "RayJob memsifter-example-embed: ok" in out and "RayService" in out, out
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(mutated(good, lambda r: r["spec"].update(entrypointt="x"))))
    rc, out = _validate_cli(str(bad))
    assert rc == 1 and "schema:" in out and "entrypointt" in out, out
    (rs,) = [d for d in yaml.safe_load_all((chart.JOBS_DIR / "serve.yaml").read_text()) if d]
    bad.write_text(yaml.safe_dump(mutated(rs, lambda r: r["spec"].update(serveConfigV3="x"))))
    rc, out = _validate_cli(str(bad))
    assert rc == 1 and "serveConfigV3" in out, out
    plain = tmp_path / "rayjobs.yaml"
    plain.write_bytes(__import__("gzip").decompress(validate.packaged_crd("RayJob").read_bytes()))
    rc, out = _validate_cli(str(chart.JOBS_DIR / "embed.yaml"), "--crd", str(plain))
    assert rc == 0, out
    rc, out = _validate_cli(str(chart.JOBS_DIR / "embed.yaml"), "--crd", str(tmp_path / "missing.yaml"))
    assert rc == 2 and "missing.yaml" in out


def test_validate_cli_checks_a_raycluster(good, tmp_path):
    rc_doc = {"apiVersion": "ray.io/v1", "kind": "RayCluster", "metadata": {"name": "c"},
              "spec": copy.deepcopy(good["spec"]["rayClusterSpec"])}
    f = tmp_path / "rc.yaml"
    f.write_text(yaml.safe_dump(rc_doc))
    assert _validate_cli(str(f))[0] == 0
    rc_doc["spec"]["headGroupSpec"]["rayStartParamz"] = {}
    f.write_text(yaml.safe_dump(rc_doc))
    rc, out = _validate_cli(str(f))
    assert rc == 1 and "rayStartParamz" in out, out
