"""Deal the test files into N groups of about equal time, for N pytest processes side by side (.ci/run).

A file stays whole in one group (its module fixtures are built once), and the files that use one of the
costly session fixtures of tests/conftest.py (:data:`SHARED`: a vLLM server) stay together, so that each is
started in one group only (and the files using the demo CI ran, which they extend one after the other). Those units are taken heaviest first, each to the group with the least time so far,
by .ci/test-seconds (a file's seconds in a CI run: its tests'
setup, call and teardown from ``pytest --durations=0``); a file not listed there counts DEFAULT seconds.
Prints one line per group: its files, space-separated. Usage: ``python .ci/split.py N``.

``python .ci/split.py --table LOG...`` prints the same seconds heaviest first, several files a line (.ci/run
prints it last, so that the tail of a CI log keeps every file's time).

``python .ci/split.py --durations LOG...`` prints the seconds of every test file in pytest logs run with
``--durations=0`` (the CI log has them: .ci/run passes it, with ``--durations-min=1``; a file none of whose
tests took a second counts 0): the content of .ci/test-seconds.
"""

from __future__ import annotations

import re
import sys
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT = 20.0
# what files share, so that they stay in one group: session servers worth starting once, and the demo CI ran
# before pytest (test_demo re-runs it, test_demo_agents adds --agents to it: one after the other)
SHARED = ("vllm_endpoint", "smollm2_vllm", "_ci_demo")


def weights(path: Path = HERE / "test-seconds") -> dict[str, float]:
    out: dict[str, float] = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, _, secs = line.rpartition(" ")
        try:
            out[name.strip()] = float(secs)
        except ValueError:
            sys.exit(f"{path}:{n}: expected 'tests/test_x.py SECONDS', got {line!r}")
    return out


def units(files: list[str], root: Path = HERE.parent) -> list[list[str]]:
    """The files, one unit each, but those naming a fixture of :data:`SHARED`: one unit per fixture."""
    out: list[list[str]] = []
    for name in SHARED:
        users = [f for f in files if name in (root / f).read_text()]
        if users:
            out.append(users)
            files = [f for f in files if f not in users]
    return out + [[f] for f in files]


def split(files: list[str], n: int, seconds: dict[str, float], root: Path = HERE.parent) -> list[list[str]]:
    def cost(unit: list[str]) -> float:
        return sum(seconds.get(f, DEFAULT) for f in unit)

    groups: list[list[str]] = [[] for _ in range(n)]
    load = [0.0] * n
    for unit in sorted(units(files, root), key=lambda u: (-cost(u), u)):
        i = load.index(min(load))
        groups[i].extend(unit)
        load[i] += cost(unit)
    return [sorted(g) for g in groups]


def durations(logs: list[str]) -> Counter:
    """Seconds per test file of ``pytest --durations=0`` logs (setup, call and teardown summed)."""
    per: Counter = Counter()
    for log in logs:
        for m in re.finditer(r"^([\d.]+)s (?:setup|call|teardown) +(tests/[\w.-]+\.py)::", Path(log).read_text(),
                             re.MULTILINE):
            per[m.group(2)] += float(m.group(1))
    return per


def test_files() -> list[str]:
    root = HERE.parent
    return sorted(str(p.relative_to(root)) for p in (root / "tests").glob("test_*.py"))


def main(argv: list[str]) -> int:
    files = test_files()
    if argv[:1] == ["--durations"]:
        per = durations(argv[1:])
        for f in sorted(set(files) | set(per)):
            print(f"{f} {per.get(f, 0):.0f}")
        return 0
    if argv[:1] == ["--table"]:
        per = durations(argv[1:])
        cells = [f"{f.removeprefix('tests/test_').removesuffix('.py')} {s:.0f}"
                 for f, s in sorted(per.items(), key=lambda kv: (-kv[1], kv[0])) if s >= 1]
        for i in range(0, len(cells), 6):
            print("ci: seconds per file: " + ", ".join(cells[i:i + 6]))
        return 0
    n = int(argv[0]) if argv else 2
    for group in split(files, n, weights()):
        print(" ".join(group))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
