"""Repository tooling is separate from what runs in a stage or driver image (issue 18, item 7).

``memsifter_dev`` (chart/jobs generation, the checkov policy, the helm/checkov binaries: a package of its
own, which the images do not install) is never imported on a runtime path: ``memsifter run <stage> --config FILE`` (every registered
stage's module is imported, the synth stage runs end to end), ``memsifter k8s drive`` and ``memsifter k8s
await-capacity``. Checked twice: the modules a real process has loaded after those paths, and the import
statements of the package (only ``memsifter.k8s.cli`` reaches it, inside the tooling commands), and the
images copy ``memsifter/`` alone.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import memsifter

PKG = Path(memsifter.__file__).resolve().parent
TOOLING = "memsifter_dev"

RUNTIME_PATHS = r"""
import contextlib, io, json, sys, tempfile
from memsifter import cli, stage as stg

sink = io.StringIO()
with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
    for name in stg.available_stages():
        stg.get_stage(name)                       # what `memsifter run <name>` imports
    d = tempfile.mkdtemp()
    with open(f"{d}/synth.yaml", "w") as f:
        f.write(f"output: {d}/out\nquestions: 2\nsessions_per_question: 3\n")
    rc = cli.main(["run", "synth", "--config", f"{d}/synth.yaml"])
    assert rc == 0, sink.getvalue()
    for argv in (["k8s", "drive", "--help"], ["k8s", "await-capacity", "--help"]):
        try:
            cli.main(argv)
        except SystemExit:
            pass
    import memsifter.k8s.capacity, memsifter.k8s.driver  # noqa: E401,F401 - what those commands run
print(json.dumps(sorted(m for m in sys.modules if m.startswith("memsifter"))))
"""


def test_runtime_paths_do_not_import_tooling(tmp_path):
    proc = subprocess.run([sys.executable, "-c", RUNTIME_PATHS], check=False, capture_output=True, text=True, timeout=600,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    loaded = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "memsifter.k8s.driver" in loaded and "memsifter.stage" in loaded
    assert [m for m in loaded if m == TOOLING or m.startswith(TOOLING + ".")] == []


def _imports(path: Path) -> list[tuple[str, int, bool]]:
    """(absolute module, line, at module level) of every import in a file of the package."""
    mod = ".".join(path.relative_to(PKG.parent).with_suffix("").parts)
    pkg = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
    tree = ast.parse(path.read_text())
    top = {id(n) for n in tree.body}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno, id(node) in top) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            out += [(base, node.lineno, id(node) in top)]
            out += [(f"{base}.{a.name}", node.lineno, id(node) in top) for a in node.names]
    return out


def test_only_the_k8s_cli_reaches_tooling():
    offenders = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG.parent).as_posix()
        for name, line, top in _imports(path):
            if name == TOOLING or name.startswith(TOOLING + "."):
                if rel == "memsifter/k8s/cli.py" and not top:
                    continue  # gen-chart / gen-jobs / validate import it when called
                offenders.append(f"{rel}:{line} imports {name}")
    assert offenders == []


def test_images_install_the_runtime_package_only():
    """The tooling is a package beside ``memsifter/``, not inside it: an image that copies ``memsifter/``
    (every family image builds on images/base/Dockerfile) cannot install it."""
    assert not (PKG / "k8s" / "dev").exists()
    assert (PKG.parent / "memsifter_dev" / "k8s" / "chart.py").is_file()
    base = (PKG.parent / "images" / "base" / "Dockerfile").read_text()
    copied = [line.split()[1] for line in base.splitlines() if line.startswith("COPY ")]
    assert "memsifter" in copied and not any(c.startswith("memsifter_dev") or c == "." for c in copied), copied
