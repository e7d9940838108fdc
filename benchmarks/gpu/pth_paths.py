#!/usr/bin/env python3
"""The sys.path entries that the ``.pth`` files of some folders add, joined by ':' (nothing: an empty line).

    python3 benchmarks/gpu/pth_paths.py "$SITE" "$SITE-extra"      # install.sh appends the result to PYTHONPATH

Python reads ``.pth`` files only in its site directories, not in ``PYTHONPATH`` entries, and ``install.sh`` installs
the staged wheels with ``pip --target`` into folders it puts on ``PYTHONPATH``. nvidia-cutlass-dsl (FlashAttention-4's
compiler, ``stage.py extra @fa4``) puts its ``cutlass`` package on sys.path through ``nvidia_cutlass_dsl_packages.pth``
(``import sys, os, nvidia_cutlass_dsl; sys.path.insert(0, ...dsl_packages)``), so without this ``import cutlass`` and
FA4 fail there. Each folder is read as a site directory (``site.addsitedir``: path lines and import lines alike);
the folders themselves and what was on sys.path before are left out. Never fails: a folder that is missing or
a line that raises adds nothing.
"""
from __future__ import annotations

import contextlib
import io
import os
import site
import sys


def pth_paths(dirs: list[str]) -> list[str]:
    before = list(sys.path)
    for d in dirs:
        if os.path.isdir(d):
            with contextlib.redirect_stderr(io.StringIO()):  # site reports a failing line and goes on
                try:
                    site.addsitedir(d)
                except Exception:  # noqa: BLE001 - a broken .pth adds nothing
                    pass
    skip = set(before) | {os.path.abspath(d) for d in dirs} | set(dirs)
    out: list[str] = []
    for p in sys.path:
        if p and p not in skip and os.path.abspath(p) not in skip and p not in out:
            out.append(p)
    return out


if __name__ == "__main__":
    print(":".join(pth_paths(sys.argv[1:])))
