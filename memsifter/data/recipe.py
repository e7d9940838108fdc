"""A training-data recipe: per split, how many questions of each dataset (prepare-rl, prepare-agents).

Given inline (``{split: {dataset: count}}``) or as the URI of a YAML/JSON file holding that mapping (or
``{recipe: ...}``). :func:`load_datasets` is the union of the recipe's input datasets."""

from __future__ import annotations

from typing import Any

import yaml

from ..errors import InputError
from ..store import storage
from .model import Dataset, Question, read_dataset


def load_recipe(value: Any) -> dict[str, dict[str, int]]:
    if isinstance(value, str):
        text = storage.read_text(value)
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ValueError(f"recipe {value}: not valid YAML/JSON: {e}") from e
        if isinstance(value, dict) and "recipe" in value and len(value) == 1:
            value = value["recipe"]
    if not isinstance(value, dict) or not value:
        raise ValueError("recipe must map split -> {dataset: count}")
    out: dict[str, dict[str, int]] = {}
    for split, entries in value.items():
        if not isinstance(entries, dict) or not entries:
            raise ValueError(f"recipe split '{split}': expected a mapping dataset -> count")
        out[str(split)] = {}
        for ds, n in entries.items():
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise ValueError(f"recipe {split}.{ds}: count must be a non-negative integer, got {n!r}")
            out[str(split)][str(ds)] = n
    return out


def load_datasets(uris: list[str]) -> Dataset:
    """The union of published datasets (a session shared by two must have the same contents; a question may
    appear in only one), one InputError naming the dataset otherwise."""
    sessions: dict = {}
    questions: list[Question] = []
    seen: set[str] = set()
    for uri in uris:
        ds = read_dataset(uri)
        for sid, s in ds.sessions.items():
            old = sessions.get(sid)
            if old is not None and old.content_hash != s.content_hash:
                raise InputError(f"session '{sid}' has different contents in two input datasets", file=uri)
            sessions[sid] = s
        for q in ds.questions:
            if q.question_id in seen:
                raise InputError(f"question '{q.question_id}' appears in two input datasets", file=uri)
            seen.add(q.question_id)
            questions.append(q)
    return Dataset(sessions, questions)
