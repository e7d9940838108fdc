"""The ranker behind ``mode: ranked``: the rank stage's prompt builder and parser, one request at a time
from the caller's side, batched on the engine's side.

A request carries the query, the first stage's top ``candidates`` sessions of the corpus (their turns and
dates, most similar first). :func:`memsifter.stages.rank.build_prompt` builds the prompt exactly as the
rank stage does (the same :class:`memsifter.retrieval.window.PromptBuilder`: pre-filter by first-stage order
within ``context_limit``, listing by ``history_order``), the engine answers, and
:func:`memsifter.stages.rank.result_row` parses it (:func:`memsifter.retrieval.rankings.parse_ranking`) into the
full order, or the first stage's with the reason (status ``fallback`` / ``error``).

Engines: ``vllm`` (``vllm.LLM`` in this process: the GPU deployment; the batch is one ``LLM.chat``
call) or ``endpoint`` (an OpenAI-compatible server, :class:`memsifter.models.llm.ChatClient`). Under Ray Serve
the deployment batches concurrent requests with ``@serve.batch`` (:mod:`memsifter.service.app`); without
Ray, :class:`memsifter.service.core.MicroBatcher` does the same.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from ..models import registry as models
from ..retrieval.context import TokenCounter, load_tokenizer
from ..data.model import Question, Session
from ..models.llm import ChatClient
from ..retrieval.prompting import RANKER_PROMPTS, load_prompt
from ..security.redact import redact
from ..stages import rank as R
from .config import RankerSettings

log = logging.getLogger(__name__)
PLACEHOLDER = "-"   # RankConfig's input / embeddings / output: the service reads none of them


class _NoCache:
    """The chat client's response cache, off: a long-running service must not keep every answer."""

    def get(self, key: str) -> None:
        return None

    def put(self, key: str, text: str) -> None:
        pass

    def flush(self) -> None:
        pass

    def __len__(self) -> int:
        return 0


class _Haystack:
    """``ds`` for :func:`memsifter.stages.rank.build_prompt` (it reads ``ds.sessions``)."""

    def __init__(self, sessions: dict[str, Session]):
        self.sessions = sessions


class RankerCore:
    """Prompt building, generation and parsing of a batch of ranked requests."""

    def __init__(self, s: RankerSettings):
        self.settings = s
        rc = R.RankConfig(input=PLACEHOLDER, embeddings=PLACEHOLDER, output=PLACEHOLDER, model=s.model,
                          tokenizer=s.tokenizer, prompt_style=s.prompt_style, answer_prefix=s.answer_prefix,
                          context_limit=s.context_limit, session_tokens=s.session_tokens,
                          history_order=s.history_order, top_k=s.top_k, temperature=s.temperature,
                          max_tokens=s.max_tokens, constrained_output=s.constrained_output, engine=s.engine,
                          endpoint=s.endpoint)
        if s.engine == "endpoint":
            rc.preflight()
        model_dir = models.resolve(s.model) if s.engine == "vllm" else None
        tok_dir = models.resolve(s.tokenizer or s.model)
        self.counter = TokenCounter(load_tokenizer(tok_dir))
        style = R.resolve_style(rc, self.counter.tokenizer)
        self.template = load_prompt(None, RANKER_PROMPTS[style], ("history", "current"))
        max_tokens, max_model_len = R.fit_lengths(rc, models.model_context(model_dir or tok_dir), style)
        self.config = rc.model_copy(update={"max_tokens": max_tokens, "answer_prefix": R.resolve_prefix(rc, style),
                                            "vllm": rc.vllm.model_copy(update={"max_model_len": max_model_len})})
        self.method = R.method_label(self.config)
        self.client: ChatClient | None = None
        self.llm: Any = None
        if s.engine == "endpoint":
            ep = s.endpoint.model_copy(update={"temperature": self.config.temperature, "top_p": self.config.top_p,
                                               "max_tokens": max_tokens, "seed": self.config.seed})
            self.client = ChatClient(ep, _NoCache())  # type: ignore[arg-type]
        else:
            self._start_vllm(model_dir, max_model_len)

    def _start_vllm(self, model_dir: str, max_model_len: int) -> None:
        from vllm import LLM

        from ..models.raypool import cluster_gpus

        try:
            import torch

            on_gpu = torch.cuda.is_available()
        except Exception:  # noqa: BLE001
            on_gpu = cluster_gpus() >= 1
        kw = R.engine_kwargs(self.config, on_gpu)
        kw.pop("pipeline_parallel_size", None)
        kw.update(self.settings.vllm_kwargs)
        self.llm = LLM(model=model_dir, **kw)

    def secrets(self) -> list[str]:
        return self.settings.endpoint.secrets() if self.settings.endpoint else []

    # ------------------------------------------------------------------ one batch
    def prompt(self, item: dict) -> R.Prompted:
        sessions = {s["session_id"]: Session(s["session_id"], s["turns"], s.get("date")) for s in item["sessions"]}
        hay = [s["session_id"] for s in item["sessions"]]
        q = Question(question_id=str(item.get("key") or "query"), dataset="serve", question=item["question"],
                     answer="", haystack_session_ids=hay, gold_session_ids=[],
                     haystack_dates=[s.get("date") for s in item["sessions"]])
        return R.build_prompt(self.config, _Haystack(sessions), q, {"ranked_session_ids": item["order"]},
                              self.counter, self.template)

    async def rank_many(self, items: list[dict]) -> list[dict]:
        """One row per item: ``ranked_session_ids`` (the whole candidate list), ``status`` (ok / fallback /
        error) and ``reason``."""
        prompts = [self.prompt(it) for it in items]
        todo = [p for p in prompts if not p.skipped]
        gens: dict[str, dict] = {}
        if todo:
            for p, g in zip(todo, await self._generate(todo)):
                gens[p.question_id] = g
        out = []
        for p in prompts:
            row = R.result_row(self.config, p, gens.get(p.question_id), self.method)
            out.append({"ranked_session_ids": row["ranked_session_ids"], "status": row["status"],
                        "reason": redact(row["reason"], self.secrets()) if row["reason"] else None})
        return out

    async def _generate(self, todo: list[R.Prompted]) -> list[dict]:
        if self.client is not None:
            body: dict[str, Any] = {"skip_special_tokens": False}
            if R.prefix_of(self.config):
                body.update({"continue_final_message": True, "add_generation_prompt": False})
            results: list[dict] = [{} for _ in todo]
            groups: dict[int, list[int]] = {}
            for i, p in enumerate(todo):
                groups.setdefault(len(p.id_map) if self.config.constrained_output else 0, []).append(i)
            for n, idx in groups.items():
                b = dict(body)
                if self.config.constrained_output:
                    b["structured_outputs"] = {"regex": R.constrained_regex(self.config, n)}
                comps = await self.client.acomplete_many([todo[i].messages for i in idx], extra_body=b)
                for i, c in zip(idx, comps):
                    results[i] = {"text": c.text, "error": c.error}
            return results
        return await asyncio.to_thread(self._generate_vllm, todo)

    def _generate_vllm(self, todo: list[R.Prompted]) -> list[dict]:
        from vllm import SamplingParams
        from vllm.sampling_params import StructuredOutputsParams

        base = R.sampling_params(self.config)
        params = []
        for p in todo:
            kw = dict(base)
            if self.config.constrained_output:
                kw["structured_outputs"] = StructuredOutputsParams(regex=R.constrained_regex(self.config, len(p.id_map)))
            params.append(SamplingParams(**kw))
        prefix = bool(R.prefix_of(self.config))
        try:
            outs = self.llm.chat([p.messages for p in todo], params, use_tqdm=False,
                                 add_generation_prompt=not prefix, continue_final_message=prefix)
        except Exception as e:  # noqa: BLE001 - the engine's error becomes every row's reason
            return [{"text": None, "error": f"{type(e).__name__}: {str(e)[:300]}"} for _ in todo]
        return [{"text": o.outputs[0].text if o.outputs else None, "error": None} for o in outs]
