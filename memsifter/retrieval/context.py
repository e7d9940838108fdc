"""Token budgets: the token counters and budgeted session selection.

Token counts of a session depend only on its text, so they are cached by content hash; every stage
that fits sessions into a budget (rank's pre-filter, chat's context, prepare-rl's prompt) uses
:class:`TokenCounter` and :func:`fill_budget`. Where no tokenizer is known (chat without ``tokenizer``,
the memory agents' default), tokens are estimated by one rule, :func:`approx_tokens`
(:data:`CHARS_PER_TOKEN`); :class:`ApproxCounter` gives it :class:`TokenCounter`'s interface, and
:func:`hf_counter` counts one text exactly with a known tokenizer.
"""

from __future__ import annotations

import hashlib
import math
import random
from typing import Any, Callable, Iterable, Literal, Sequence

# How the chosen sessions are listed in a ranker's prompt (their local ids are positions in this list):
# chronological (MEMSIFTER.md §2, the original), in the first stage's order, most similar first (a
# re-ranker that sees the retriever's order, as RankGPT-style re-rankers list candidates), or shuffled
# per question with a seed (the listing position then carries no first-stage signal to learn).
HistoryOrder = Literal["chronological", "first_stage", "shuffled"]
HISTORY_ORDERS = ("chronological", "first_stage", "shuffled")


# The tokenizer-free estimate: characters per token. On the project's data (LongMemEval_S and LoCoMo sessions as
# rendered) SmolLM2's tokenizer averages 4.2 characters a token (3.5 to 5.6 per session), so 3.4 over-counts
# by about 20%: a budget computed with it stays inside the real window.
CHARS_PER_TOKEN = 3.4


def approx_tokens(text: str) -> int:
    """A tokenizer-free token count: characters / :data:`CHARS_PER_TOKEN`, rounded up (0 for no text)."""
    return math.ceil(len(text) / CHARS_PER_TOKEN) if text else 0


class ApproxCounter:
    """:class:`TokenCounter`'s interface over :func:`approx_tokens`, when no tokenizer is given (a chat
    prompt counts its messages' text: no chat template is known)."""

    hits = misses = 0

    def count_many(self, texts: Sequence[str], cap: int | None = None) -> list[int]:
        return [approx_tokens(t) for t in texts]

    def count(self, text: str, cap: int | None = None) -> int:
        return approx_tokens(text)

    def chat_prompt_tokens(self, messages: list[dict]) -> int:
        return approx_tokens("".join(str(m.get("content") or "") for m in messages))


def hf_counter(tokenizer: Any) -> Callable[[str], int]:
    """A one-text counter from a Hugging Face tokenizer (exact counts; no special tokens added)."""
    return lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else 0


def load_tokenizer(name_or_path: str, trust_remote_code: bool = False) -> Any:
    """A Hugging Face tokenizer from a hub id or a local directory (offline-friendly)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)


# Texts longer than this many characters are tokenized in pieces of about this size (cut at a space
# near the end where there is one): a tokenizer's output for one text costs ~100-400 bytes per token,
# so a 50 MB turn tokenized whole needs gigabytes. A batch holds at most this many characters in all.
PIECE_CHARS = 1 << 18
BATCH_CHARS = 1 << 20


class TokenCounter:
    """Counts tokens with one tokenizer, caching per distinct text (sha1 of the text).

    Memory stays bounded whatever the text: long texts are counted piece by piece (the sum can differ
    from a whole-text count by a token or so per piece, which the exact prompt count that follows a
    selection corrects), and with ``cap`` a count stops once it is past ``cap``: a session that cannot
    fit is tokenized only as far as needed to know it."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._cache: dict[str, int] = {}
        self._over: dict[str, int] = {}   # text key -> a lower bound (the count stopped there: > some cap)
        self.hits = 0
        self.misses = 0

    @staticmethod
    def key(text: str) -> str:
        return hashlib.sha1(text.encode("utf-8")).hexdigest()

    def count(self, text: str, cap: int | None = None) -> int:
        return self.count_many([text], cap=cap)[0]

    def _ids(self, texts: list[str]) -> list[int]:
        enc = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        return [len(ids) for ids in enc]

    def _count_long(self, text: str, cap: int | None) -> tuple[int, bool]:
        """(tokens, exact) of a text longer than :data:`PIECE_CHARS`, piece by piece; stops past ``cap``."""
        n, start = 0, 0
        while start < len(text):
            end = min(len(text), start + PIECE_CHARS)
            if end < len(text):
                cut = text.rfind(" ", end - 4096, end)
                end = cut + 1 if cut > start else end
            n += self._ids([text[start:end]])[0]
            start = end
            if cap is not None and n > cap and start < len(text):
                return n, False
        return n, True

    def count_many(self, texts: Sequence[str], batch_size: int = 64, cap: int | None = None) -> list[int]:
        """Token counts of ``texts``; with ``cap``, a text of more than ``cap`` tokens may get any count
        above ``cap`` (the counting stopped there)."""
        keys = [self.key(t) for t in texts]
        todo: dict[str, str] = {}
        result: dict[str, int] = {}
        for k, t in zip(keys, texts):
            if k in self._cache:
                self.hits += 1
            elif cap is not None and self._over.get(k, -1) > cap:
                self.hits += 1
                result[k] = self._over[k]
            elif k not in todo:
                todo[k] = t
            else:
                self.hits += 1
        batch: list[tuple[str, str]] = []
        chars = 0

        def flush() -> None:
            nonlocal chars
            if batch:
                for (k, _), n in zip(batch, self._ids([t for _, t in batch])):
                    self._cache[k] = n
                self.misses += len(batch)
                batch.clear()
                chars = 0
        for k, t in todo.items():
            if len(t) > PIECE_CHARS:
                n, exact = self._count_long(t, cap)
                if exact:
                    self._cache[k] = n
                else:
                    self._over[k] = max(n, self._over.get(k, 0))
                    result[k] = n
                self.misses += 1
                continue
            if batch and (len(batch) >= batch_size or chars + len(t) > BATCH_CHARS):
                flush()
            batch.append((k, t))
            chars += len(t)
        flush()
        return [self._cache[k] if k in self._cache else result[k] for k in keys]

    def chat_prompt_tokens(self, messages: list[dict]) -> int:
        """Tokens of a chat prompt as the model sees it: the chat template and the generation prompt, or, when
        the last message is an assistant prefill, that message continued (no end of turn, no new turn: what the
        engines render, Ray Data LLM's chat-template stage, vLLM's ``continue_final_message`` and the service's
        ranker alike). A tokenizer without a chat template (a base model's) counts the messages' text."""
        if getattr(self.tokenizer, "chat_template", None) is None and hasattr(self.tokenizer, "chat_template"):
            return sum(self.count_many([str(m.get("content") or "") for m in messages]))
        prefill = bool(messages) and messages[-1].get("role") == "assistant"
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=not prefill,
                                                 continue_final_message=prefill, tokenize=True)
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


def shown_order(chosen: Iterable[int], order: Sequence[int], how: str, shuffle_key: str | None = None) -> list[int]:
    """The chosen haystack indices in the order a ranker's prompt lists them (``HistoryOrder``):
    ascending (chronological), by position in ``order`` (the first stage's, most similar first;
    indices missing from ``order`` go last, chronologically), or ``shuffled``: a permutation drawn from
    ``shuffle_key`` alone (e.g. ``"<seed>:<question id>"``), so the same key always lists the same set
    the same way. Never the order they were taken in: prepare-rl takes the gold sessions first, and
    listing them first would leak the answer."""
    if how == "chronological":
        return sorted(chosen)
    if how == "shuffled":
        if shuffle_key is None:
            raise ValueError("history order 'shuffled' needs a shuffle key (seed and question)")
        out = sorted(chosen)
        random.Random(shuffle_key).shuffle(out)  # str seeds hash with SHA-512: the same in every process
        return out
    if how != "first_stage":
        raise ValueError(f"history order {how!r}: expected one of {', '.join(HISTORY_ORDERS)}")
    rank = {i: r for r, i in enumerate(dict.fromkeys(order))}
    return sorted(chosen, key=lambda i: (rank.get(i, len(rank)), i))
