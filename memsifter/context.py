"""Token budgets: a cached token counter and budgeted session selection.

Token counts of a session depend only on its text, so they are cached by content hash; every stage
that fits sessions into a budget (rank's pre-filter, chat's context, prepare-rl's prompt) uses
:class:`TokenCounter` and :func:`fill_budget`.
"""

from __future__ import annotations

import hashlib
from typing import Any, Iterable, Literal, Sequence

# How the chosen sessions are listed in a ranker's prompt (their local ids are positions in this list):
# chronological (MEMSIFTER.md §2, the original) or in the first stage's order, most similar first (a
# re-ranker that sees the retriever's order, as RankGPT-style re-rankers list candidates).
HistoryOrder = Literal["chronological", "first_stage"]


def load_tokenizer(name_or_path: str, trust_remote_code: bool = False) -> Any:
    """A Hugging Face tokenizer from a hub id or a local directory (offline-friendly)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)


class TokenCounter:
    """Counts tokens with one tokenizer, caching per distinct text (sha1 of the text)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._cache: dict[str, int] = {}
        self.hits = 0
        self.misses = 0

    @staticmethod
    def key(text: str) -> str:
        return hashlib.sha1(text.encode("utf-8")).hexdigest()

    def count(self, text: str) -> int:
        return self.count_many([text])[0]

    def count_many(self, texts: Sequence[str], batch_size: int = 64) -> list[int]:
        keys = [self.key(t) for t in texts]
        todo: dict[str, str] = {}
        for k, t in zip(keys, texts):
            if k in self._cache or k in todo:
                self.hits += 1
            else:
                todo[k] = t
        items = list(todo.items())
        for i in range(0, len(items), batch_size):
            chunk = items[i:i + batch_size]
            enc = self.tokenizer([t for _, t in chunk], add_special_tokens=False)["input_ids"]
            for (k, _), ids in zip(chunk, enc):
                self._cache[k] = len(ids)
            self.misses += len(chunk)
        return [self._cache[k] for k in keys]

    def chat_prompt_tokens(self, messages: list[dict]) -> int:
        """Tokens of a chat prompt as the model sees it (chat template + generation prompt)."""
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return len(ids)


def fill_budget(order: Iterable[int], costs: Sequence[int], budget: int, *,
                stop_at_first_overflow: bool = False, required: Sequence[int] = ()) -> list[int]:
    """Pick indices in ``order`` while their summed cost fits ``budget``.

    ``required`` indices are taken first, whatever they cost. With ``stop_at_first_overflow`` the
    scan stops at the first candidate that does not fit (the original pre-filter); otherwise it
    skips it and keeps trying smaller ones. Returns the chosen indices in the order they were taken.
    """
    chosen = list(dict.fromkeys(required))
    used = sum(costs[i] for i in chosen)
    taken = set(chosen)
    for i in order:
        if i in taken:
            continue
        if used + costs[i] > budget:
            if stop_at_first_overflow:
                break
            continue
        chosen.append(i)
        taken.add(i)
        used += costs[i]
    return chosen


def shown_order(chosen: Iterable[int], order: Sequence[int], how: str) -> list[int]:
    """The chosen haystack indices in the order a ranker's prompt lists them (``HistoryOrder``):
    ascending (chronological) or by position in ``order`` (the first stage's, most similar first;
    indices missing from ``order`` go last, chronologically). Never the order they were taken in:
    prepare-rl takes the gold sessions first, and listing them first would leak the answer."""
    if how == "chronological":
        return sorted(chosen)
    if how != "first_stage":
        raise ValueError(f"history order {how!r}: expected chronological or first_stage")
    rank = {i: r for r, i in enumerate(dict.fromkeys(order))}
    return sorted(chosen, key=lambda i: (rank.get(i, len(rank)), i))

