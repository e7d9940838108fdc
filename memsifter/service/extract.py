"""Optional fact extraction for the mem0-compatible API's adds (issue 46 item 3), off by default.

With ``extract: {endpoint: {base_url: ..., model: ...}}`` in the serve config, an add (mem0's ``infer``,
true unless the request says false) asks that OpenAI-compatible endpoint, as mem0 does:

1. the *facts* in the messages (a JSON list of short statements);
2. when the owner already has memories, what each fact does to them (the stored memories most similar to
   the facts, by the service's first stage, numbered ``0``, ``1``, ...: the model names a number, never a
   memory id): ``ADD`` a new memory, ``UPDATE`` one (its new text; the old one stays in the history),
   ``DELETE`` one (the fact contradicts it) or ``NONE``.

The events are written as any add's, update's or delete's (one event file, durable when the answer
returns, in each memory's history). With ``structured: true`` (default) both requests ask for a JSON
schema (``response_format``; vLLM and OpenAI constrain the output to it, so a small local model answers
in the shape asked); either way the answer is parsed leniently (a code fence or text around the JSON is
ignored). An answer that is still not the JSON asked for, or an endpoint that fails, never loses the
user's message: it is stored as sent, and the response says so (``extraction.status: "fallback"`` and
why). Nothing is sent anywhere unless ``extract.endpoint`` names the server; the key is read from the
environment variable ``api_key_env`` names (:class:`memsifter.models.llm.LLMEndpoint`).
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..models.llm import LLMEndpoint

EVENTS = ("ADD", "UPDATE", "DELETE", "NONE")
TEXT_CHARS = 200   # a fact or a memory's new text in a schema answer at most (an answer then fits its token budget)

FACTS_PROMPT = """\
You read a conversation and write down what is worth remembering about the user: preferences, personal \
details, plans, relationships, events (with their dates when given). Each fact is one short statement that \
stands on its own, in the language of the conversation. Leave out greetings and small talk.
Answer with JSON only, in this form: {"facts": ["fact one", "fact two"]}. With nothing worth remembering: \
{"facts": []}."""

UPDATE_PROMPT = """\
You keep a user's memory consistent. You get the stored memories, each with an id, and new facts. For each \
new fact give one operation:
- ADD: the fact is new information (id "new").
- UPDATE: the fact changes or adds to a stored memory: that memory's id, and its new text (the stored one \
and the fact merged).
- DELETE: the fact says a stored memory is no longer true: that memory's id.
- NONE: the stored memories already say it: that memory's id.
Answer with JSON only, in this form: {"memory": [{"id": "0", "event": "UPDATE", "text": "..."}, \
{"id": "new", "event": "ADD", "text": "..."}]}."""


class ExtractSettings(BaseModel):
    """``extract``: fact extraction for mem0-style adds through an OpenAI-compatible endpoint (off when
    absent)."""

    model_config = ConfigDict(extra="forbid")

    endpoint: LLMEndpoint = Field(description="the OpenAI-compatible server the messages are sent to (base_url "
                                  "required; the key by reference: api_key_env)")
    structured: bool = Field(True, description="ask for a JSON schema (response_format json_schema: vLLM and "
                             "OpenAI constrain the answer to it); false for a server that does not take it")
    similar: int = Field(10, ge=1, le=100, description="stored memories shown to the model (the most similar "
                         "to each fact)")
    max_facts: int = Field(50, ge=1, le=500, description="facts kept from one add at most")

    @model_validator(mode="after")
    def _named(self) -> "ExtractSettings":
        if not self.endpoint.resolved_base_url():
            raise ValueError("extract.endpoint.base_url is not set: name the OpenAI-compatible server the "
                             "messages go to (nothing is sent elsewhere)")
        return self


class Malformed(ValueError):
    """The model's answer is not the JSON asked for."""


def first_json(text: str | None) -> Any:
    """The first JSON object in ``text`` (a code fence or words around it ignored)."""
    if not text:
        raise Malformed("an empty answer")
    dec = json.JSONDecoder()
    i = text.find("{")
    while i != -1:
        try:
            return dec.raw_decode(text, i)[0]
        except ValueError:
            i = text.find("{", i + 1)
    raise Malformed(f"no JSON object in the answer ({len(text)} characters)")


def parse_facts(text: str | None, max_facts: int, max_chars: int) -> list[str]:
    obj = first_json(text)
    facts = obj.get("facts") if isinstance(obj, dict) else None
    if not isinstance(facts, list):
        raise Malformed('the answer has no "facts" list')
    out: list[str] = []
    for f in facts:
        if isinstance(f, str) and f.strip() and f.strip() not in out:
            out.append(f.strip()[:max_chars])
    return out[:max_facts]


def parse_decisions(text: str | None, ids: list[str], max_chars: int) -> tuple[list[dict], int]:
    """The operations of the answer (``{"event", "ref", "text"}``, ``ref`` one of ``ids`` or None) and how
    many entries were left out (an unknown id or event, no text where one is needed)."""
    obj = first_json(text)
    items = obj.get("memory") if isinstance(obj, dict) else None
    if not isinstance(items, list):
        raise Malformed('the answer has no "memory" list')
    out, dropped = [], 0
    for it in items:
        if not isinstance(it, dict):
            dropped += 1
            continue
        event = str(it.get("event", "")).upper()
        ref = str(it.get("id")) if it.get("id") is not None else None
        txt = it.get("text")
        txt = txt.strip()[:max_chars] if isinstance(txt, str) else ""
        if event not in EVENTS or (event in ("UPDATE", "DELETE") and ref not in ids) or \
                (event in ("ADD", "UPDATE") and not txt):
            dropped += 1
            continue
        out.append({"event": event, "ref": ref if ref in ids else None, "text": txt})
    return out, dropped


def facts_schema(max_facts: int) -> dict:
    return {"type": "object", "properties": {"facts": {"type": "array", "maxItems": max_facts,
                                                       "items": {"type": "string", "maxLength": TEXT_CHARS}}},
            "required": ["facts"], "additionalProperties": False}


def decisions_schema(ids: list[str], facts: int) -> dict:
    """One operation per fact at most; ``id`` one of the numbers shown, or ``new``."""
    item = {"type": "object", "properties": {"id": {"type": "string", "enum": [*ids, "new"]},
                                             "event": {"type": "string", "enum": list(EVENTS)},
                                             "text": {"type": "string", "maxLength": TEXT_CHARS}},
            "required": ["id", "event", "text"], "additionalProperties": False}
    return {"type": "object", "properties": {"memory": {"type": "array", "items": item, "maxItems": facts}},
            "required": ["memory"], "additionalProperties": False}


def conversation(messages: list[dict]) -> str:
    return "\n".join(f"{m.get('role') or 'user'}: {m['content']}" for m in messages)


class Extractor:
    """The two requests of an inferred add against ``settings.endpoint``."""

    def __init__(self, settings: ExtractSettings):
        self.settings = settings
        self.calls = 0

    async def _ask(self, system: str, user: str, schema: dict, name: str) -> str:
        from ..models.llm import ChatClient, ResponseCache

        params: dict[str, Any] = {}
        if self.settings.structured:
            params["response_format"] = {"type": "json_schema",
                                         "json_schema": {"name": name, "schema": schema, "strict": True}}
        self.calls += 1
        client = ChatClient(self.settings.endpoint, cache=ResponseCache())   # no answer reused across adds
        try:
            done = (await client.acomplete_many([[{"role": "system", "content": system},
                                                  {"role": "user", "content": user}]], **params))[0]
        except Exception as e:  # noqa: BLE001 - e.g. the key's variable unset: the add falls back, says why
            raise Malformed(f"the endpoint could not be called ({type(e).__name__}: {str(e)[:200]})") from None
        if done.text is None:
            raise Malformed(f"the endpoint failed: {done.error}")
        return done.text

    async def facts(self, messages: list[dict], max_chars: int) -> list[str]:
        text = await self._ask(FACTS_PROMPT, conversation(messages), facts_schema(self.settings.max_facts), "facts")
        return parse_facts(text, self.settings.max_facts, max_chars)

    async def decisions(self, stored: list[str], facts: list[str], max_chars: int) -> tuple[list[dict], int]:
        """``stored``: the memories' texts, numbered by their position."""
        ids = [str(i) for i in range(len(stored))]
        user = json.dumps({"stored": [{"id": i, "text": t} for i, t in zip(ids, stored)], "new_facts": facts},
                          ensure_ascii=False)
        text = await self._ask(UPDATE_PROMPT, user, decisions_schema(ids, len(facts)), "memory_operations")
        return parse_decisions(text, ids, max_chars)
