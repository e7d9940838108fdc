"""YAML that helm and kubectl read back as it was written.

helm and kubectl parse YAML 1.1 (Go's yaml.v2 through sigs.k8s.io/yaml), where the plain scalars ``y``, ``Y``,
``n`` and ``N`` are booleans, besides ``yes``/``no``/``on``/``off``/``true``/``false`` in their three spellings.
PyYAML's safe dumper quotes all of those but the one-letter ones, so verl's ``actor_rollout_ref.rollout.n: 4`` in a
values file written by PyYAML reached the pod's config document as ``false: 4``. :func:`dump` quotes every one.
"""

from __future__ import annotations

from typing import Any

import yaml

GO_YAML_BOOLS = frozenset(w for base in ("y", "yes", "n", "no", "true", "false", "on", "off")
                          for w in (base, base.capitalize(), base.upper()))


class Dumper(yaml.SafeDumper):
    """PyYAML's safe dumper, quoting the strings Go's YAML 1.1 would read as booleans."""


def represent_str(dumper: yaml.SafeDumper, s: str) -> yaml.ScalarNode:
    if s in GO_YAML_BOOLS:
        return dumper.represent_scalar("tag:yaml.org,2002:str", s, style="'")
    return dumper.represent_str(s)


Dumper.add_representer(str, represent_str)


def dump(obj: Any, stream: Any = None, **kw: Any) -> Any:
    """``yaml.safe_dump`` for files helm or kubectl read (values files, manifests)."""
    return yaml.dump(obj, stream, Dumper=Dumper, **kw)
