"""Stages are leaves: no stage module imports another stage module, and the shared parts they use
(prompts, checkpoint layout, the Ray pool, reward settings, fault hooks) live outside memsifter/stages.
Read from the source with ast (imports inside functions count too)."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

from memsifter import stage as stg

ROOT = Path(__file__).resolve().parents[1]
STAGES_DIR = ROOT / "memsifter" / "stages"


def _module_of(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imported_modules(path: Path, mod: str | None = None) -> set[str]:
    """Absolute names of every module an ``import``/``from ... import`` in the file (module ``mod``) may
    load: for ``from pkg import name``, both ``pkg`` and ``pkg.name`` (name may be a submodule)."""
    mod = mod or _module_of(path)
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = importlib.util.resolve_name("." * node.level + (node.module or ""), package) \
                if node.level else node.module
            out.add(base)
            out |= {f"{base}.{a.name}" for a in node.names}
    return out


def stage_modules() -> dict[str, Path]:
    """Every module that registers a stage (memsifter/stages/*, memsifter/data importers and synth)."""
    out = {}
    for st in stg.available().values():
        spec = importlib.util.find_spec(st.module)
        out[st.module] = Path(spec.origin)
    return out


def test_every_module_in_stages_registers_a_stage():
    mods = set(stage_modules())
    for p in STAGES_DIR.glob("*.py"):
        if p.name != "__init__.py":
            assert _module_of(p) in mods, f"{p.name}: a module of memsifter/stages that registers no stage"


def test_no_stage_module_imports_another():
    mods = stage_modules()
    bad = []
    for name, path in sorted(mods.items()):
        for imp in sorted(imported_modules(path)):
            if imp in mods and imp != name:
                bad.append(f"{path.relative_to(ROOT)} imports {imp}")
    assert not bad, "stage modules must not import each other (move what they share out of stages/):\n" + \
        "\n".join(bad)


# The front doors that run stages by name: the CLI, the pipeline and the k8s entrypoint (the driver a RayJob
# starts). Everything else (the memory service, the demo, prepare-*, the agents, the rewards) shares the
# library in memsifter/retrieval, never a stage module's internals (issue 45).
STAGE_RUNNERS = {"memsifter.cli", "memsifter.pipeline", "memsifter.k8s.driver"}


def test_only_the_stage_runners_reach_into_stage_modules():
    """No module outside memsifter/stages imports a stage module, except :data:`STAGE_RUNNERS`."""
    mods = stage_modules()
    bad = []
    for path in sorted((ROOT / "memsifter").rglob("*.py")):
        name = _module_of(path)
        if name in mods or name in STAGE_RUNNERS:
            continue
        hits = sorted(imported_modules(path) & set(mods))
        if hits:
            bad.append(f"{path.relative_to(ROOT)} imports {', '.join(hits)}")
    assert not bad, "use memsifter.retrieval (or the stage registry), not a stage module:\n" + "\n".join(bad)


def test_the_check_sees_relative_and_nested_imports(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from .rank import fill\n    from . import chat\n    from ..stages import embed\n")
    got = imported_modules(probe, "memsifter.stages.probe")
    assert {"memsifter.stages.rank", "memsifter.stages.chat", "memsifter.stages.embed"} <= got
