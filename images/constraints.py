#!/usr/bin/env python3
"""Effective pip constraints for an image: requirements/constraints.txt with the overrides of a
family (e.g. images/gpu-overrides.txt: the GPU vLLM wheel pins a few packages differently from the
CPU build the repository's constraints were resolved with). Usage:

    python3 images/constraints.py requirements/constraints.txt images/gpu-overrides.txt > /tmp/c.txt
"""
import re
import sys


def name(line: str) -> str:
    return re.split(r"[=<>!~;\[ ]", line.strip(), maxsplit=1)[0].lower().replace("_", "-").replace(".", "-")


def merge(base: list[str], overrides: list[str]) -> list[str]:
    over = [l.strip() for l in overrides if l.strip() and not l.lstrip().startswith("#")]
    names = {name(l) for l in over}
    kept = [l.rstrip("\n") for l in base if not l.strip() or l.lstrip().startswith("#") or name(l) not in names]
    return kept + over


if __name__ == "__main__":
    base = open(sys.argv[1]).read().splitlines()
    extra = open(sys.argv[2]).read().splitlines() if len(sys.argv) > 2 else []
    print("\n".join(merge(base, extra)))
