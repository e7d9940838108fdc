"""Real benchmark samples shipped with the package (licences in README.md beside this file)."""

from __future__ import annotations

from importlib import resources

LONGMEMEVAL = "longmemeval_s_dev30.json.gz"   # MIT
LOCOMO = "locomo_dev2.json.gz"                # CC BY-NC 4.0


def path(name: str) -> str:
    return str(resources.files(__name__).joinpath(name))
