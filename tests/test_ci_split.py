""".ci/split.py, which deals the test files to CI's pytest processes and prints their seconds."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def split():
    spec = importlib.util.spec_from_file_location("ci_split", ROOT / ".ci" / "split.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_files_of_one_session_server_stay_in_one_group(split, tmp_path):
    (tmp_path / "tests").mkdir()
    for name, body in {"a": "def test(vllm_endpoint): pass", "b": "def test(vllm_endpoint): pass",
                       "c": "def test(smollm2_vllm): pass", "d": "def test(smollm2_vllm): pass",
                       "e": "def test(): pass", "f": "def test(): pass"}.items():
        (tmp_path / "tests" / f"test_{name}.py").write_text(body)
    files = [f"tests/test_{n}.py" for n in "abcdef"]
    units = split.units(files, root=tmp_path)
    assert ["tests/test_a.py", "tests/test_b.py"] in units and ["tests/test_c.py", "tests/test_d.py"] in units
    seconds = {"tests/test_a.py": 100, "tests/test_b.py": 100, "tests/test_c.py": 160, "tests/test_d.py": 50,
               "tests/test_e.py": 30, "tests/test_f.py": 10}
    groups = split.split(files, 2, seconds, root=tmp_path)
    # heaviest unit first (c+d 210) to one side, a+b (200) to the other, then e (30) and f (10) each to the lighter
    assert groups == [["tests/test_c.py", "tests/test_d.py", "tests/test_f.py"],
                      ["tests/test_a.py", "tests/test_b.py", "tests/test_e.py"]], groups
    assert sorted(f for g in groups for f in g) == files


def test_table_lists_every_file_heaviest_first(split, tmp_path, capsys):
    log = tmp_path / "pytest.log"
    log.write_text("120.50s setup    tests/test_rank.py::test_x\n3.00s call     tests/test_rank.py::test_x\n"
                   "7.20s call     tests/test_chat.py::test_y[a]\n0.40s teardown tests/test_tiny.py::test_z\n"
                   "== 3 passed in 131s ==\n")
    assert split.main(["--table", str(log)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == ["ci: seconds per file: rank 124, chat 7"]
