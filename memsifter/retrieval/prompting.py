"""Prompt files and what the stages and the reward share about prompts and answers.

The templates live in ``memsifter/prompts/*.txt`` (or a replacement file, local or s3://); slots are
``{name}`` placeholders filled literally (:func:`fill`). The ranker's shipped prompts by style are
:data:`RANKER_PROMPTS`; the working LLM's answer is read with :func:`extract_answer` (MEMSIFTER.md §5).
"""

from __future__ import annotations

import re
from importlib import resources

from . import rankings
from ..store import storage
from ..errors import ConfigError
from .render import defuse_chat_markers

# The ranker's shipped prompt by style (rank's and prepare-rl's ``prompt_style``).
RANKER_PROMPTS = {"thinking": "ranker.txt", "direct": "ranker_direct.txt"}


def default_prompt(name: str) -> str:
    """A shipped template, ``memsifter/prompts/<name>``."""
    return resources.files("memsifter").joinpath("prompts", name).read_text(encoding="utf-8")


def load_prompt(uri: str | None, default: str, slots: tuple[str, ...]) -> str:
    """The template at ``uri`` (local or s3://), else the shipped ``default``; every slot must be in it."""
    text = storage.read_text(uri) if uri else default_prompt(default)
    missing = [s for s in slots if "{" + s + "}" not in text]
    if missing:
        raise ConfigError(f"prompt {uri or default}: missing slot(s) {', '.join('{' + s + '}' for s in missing)}")
    return text


CHAT_PROMPT = "chat.txt"   # the working LLM's shipped prompt (slots {history}, {current}, {date})


def load_chat_prompt(uri: str | None) -> str:
    """The working LLM's prompt: ``uri`` (a replacement file, local or s3://) or :data:`CHAT_PROMPT`; what the
    chat stage answers with and the reward's working LLM is asked with."""
    return load_prompt(uri, CHAT_PROMPT, ("history", "current"))


def fill(template: str, **slots: str) -> str:
    """Literal slot replacement in one pass (session text may contain braces or even a slot name
    like ``{current}``, so neither str.format nor successive replaces). Chat-template markers in the
    values (``<|im_end|>``…) are defused (:func:`memsifter.retrieval.render.defuse_chat_markers`): filled text
    is data, never prompt structure; the template's own text is kept as it is."""
    if not slots:
        return template
    values = {k: defuse_chat_markers(str(v)) for k, v in slots.items()}
    pattern = re.compile("|".join(re.escape("{" + k + "}") for k in slots))
    return pattern.sub(lambda m: values[m.group(0)[1:-1]], template)


_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)


def extract_answer(text: str | None) -> str:
    """Text inside the last <answer>…</answer> after the last </think>; else the whole reply.

    As for rankings (:func:`memsifter.retrieval.rankings.answer_part`), a reply that echoes the history shown
    counts only after its last ``</session>``: an ``<answer>`` written in a session is not the model's."""
    if not text:
        return ""
    tail, _ = rankings.answer_part(text)
    found = _ANSWER.findall(tail)
    if found:
        return found[-1].strip()
    i = tail.lower().rfind("<answer>")
    if i >= 0:
        return tail[i + len("<answer>"):].strip()
    return tail.strip()
