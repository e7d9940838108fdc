"""benchmarks/bench_owner_copy.py --profile: the shares of a py-spy raw profile, plain or gzipped."""

from __future__ import annotations

import gzip
import subprocess
import sys

from conftest import REPO


def test_profile_shares_from_a_plain_and_a_gzipped_raw_profile(tmp_path):
    raw = ("main (s.py:1);read_log (m.py:2);Owner.copy (m.py:3) 3\n"
           "main (s.py:1);Encoder.encode (i.py:4) 1\n")
    plain, packed = tmp_path / "p.txt", tmp_path / "p.txt.gz"
    plain.write_text(raw)
    with gzip.open(packed, "wt") as f:
        f.write(raw)
    for path in (plain, packed):
        p = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_owner_copy.py"), "--profile", str(path)],
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr
        assert f"4 samples of {path}" in p.stdout
        assert "Owner.copy: 75.0%" in p.stdout and "read_log: 75.0%" in p.stdout and "Encoder.encode: 25.0%" in p.stdout
