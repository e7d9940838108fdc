"""The ranker behind ``mode: ranked``: the ranker library (:mod:`memsifter.retrieval.ranker`), one request at
a time from the caller's side, batched on the engine's side.

A request (:class:`memsifter.retrieval.ranker.RankRequest`) carries the query and the first stage's top
``candidates`` sessions of the corpus, as the corpus holds them (:class:`memsifter.data.model.Session`
objects, oldest first, with their dates) and their first-stage order.
:func:`memsifter.retrieval.ranker.ranker_prompt` builds the prompt exactly as the rank stage does (the same
:class:`memsifter.retrieval.window.PromptBuilder`: pre-filter by first-stage order within ``context_limit``,
listing by ``history_order``), the engine answers, and :func:`memsifter.retrieval.ranker.result_row` parses
it (:func:`memsifter.retrieval.rankings.parse_ranking`) into the full order, or the first stage's with the
reason (status ``fallback`` / ``error``).

Engines: ``vllm`` (``vllm.LLM`` in this process: the GPU deployment; the batch is one ``LLM.chat``
call) or ``endpoint`` (an OpenAI-compatible server, :class:`memsifter.models.llm.ChatClient`). Under Ray Serve
the deployment batches concurrent requests with ``@serve.batch`` (:mod:`memsifter.service.app`); without
Ray, :class:`memsifter.service.core.MicroBatcher` does the same.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Mapping

from ..models import registry as models
from ..models.llm import ChatClient
from ..retrieval import ranker as R
from ..retrieval.context import TokenCounter, load_tokenizer
from ..retrieval.prompting import RANKER_PROMPTS, load_prompt
from ..security.redact import redact
from .config import RankerSettings

log = logging.getLogger(__name__)


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


class RankerCore:
    """Prompt building, generation and parsing of a batch of ranked requests."""

    def __init__(self, s: RankerSettings):
        self.settings = s
        if s.engine == "endpoint":
            s.preflight()
        model_dir = models.resolve(s.model) if s.engine == "vllm" else None
        tok_dir = models.resolve(s.tokenizer or s.model)
        self.counter = TokenCounter(load_tokenizer(tok_dir))
        style = R.resolve_style(s, self.counter.tokenizer)
        self.template = load_prompt(None, RANKER_PROMPTS[style], ("history", "current"))
        max_tokens, max_model_len = R.fit_lengths(s, models.model_context(model_dir or tok_dir), style)
        self.config = s.model_copy(update={"max_tokens": max_tokens, "answer_prefix": R.resolve_prefix(s, style),
                                           "vllm": s.vllm.model_copy(update={"max_model_len": max_model_len})})
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
    def prompt(self, item: R.RankRequest | Mapping[str, Any]) -> R.Prompted:
        """The ranker's prompt of one request (its JSON form, as a client outside the service sends it, is
        read into a :class:`~memsifter.retrieval.ranker.RankRequest`)."""
        req = R.RankRequest.of(item)
        return R.ranker_prompt(self.config, req.question, req.key, req.sessions, req.dates, req.order, self.counter,
                               self.template)

    async def rank_many(self, items: list[R.RankRequest]) -> list[dict]:
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
