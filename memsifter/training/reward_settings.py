"""How :mod:`memsifter.training.rewards` scores rollouts: the one definition of the reward settings.

The train stage's config holds them (``reward:``, passed to verl as the reward function's
``reward_kwargs``; no secrets), and the reward function reads them back with
:meth:`RewardSettings.resolve`: keyword arguments first, then ``MEMSIFTER_REWARD_*`` environment
variables (:data:`ENV`), then the defaults below.
"""

from __future__ import annotations

import json
import os
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MODES = ("dcg", "task", "improvement")
FORMATS = ("exact", "partial")
TOP_K = 10
DEFAULT_TIMEOUT_S = 120.0

# setting -> the environment variable that stands in when no keyword argument gives it
ENV = {"mode": "MEMSIFTER_REWARD_MODE", "base_url": "MEMSIFTER_REWARD_BASE_URL", "model": "MEMSIFTER_REWARD_MODEL",
       "api_key_env": "MEMSIFTER_REWARD_API_KEY_ENV", "temperature": "MEMSIFTER_REWARD_TEMPERATURE",
       "max_tokens": "MEMSIFTER_REWARD_MAX_TOKENS", "concurrency": "MEMSIFTER_REWARD_CONCURRENCY",
       "max_retries": "MEMSIFTER_REWARD_MAX_RETRIES", "timeout_s": "MEMSIFTER_REWARD_TIMEOUT_S",
       "top_k": "MEMSIFTER_REWARD_TOP_K", "cache_uri": "MEMSIFTER_REWARD_CACHE",
       "answer_prompt": "MEMSIFTER_REWARD_ANSWER_PROMPT", "format": "MEMSIFTER_REWARD_FORMAT"}


def _env(name: str) -> str | None:
    v = os.environ.get(name)
    return v if v not in (None, "") else None


class RewardSettings(BaseModel):
    """How ``memsifter.training.rewards`` scores rollouts (passed as verl ``reward_kwargs``; no secrets)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: Literal["dcg", "task", "improvement"] = Field(
        "dcg", description="dcg: DCG of the ranking against the gold sessions, no LLM calls (MemSifter's first "
        "stage); task: the working LLM's answer gains (needs base_url); improvement: NDCG@k of the ranking minus "
        "NDCG@k of the listing the ranker was shown (copying the shown order earns 0 whatever it is; a ranking "
        "that does not parse -1), no LLM calls. With the ranker's agent loop (memsifter.training.ranker_loop: "
        "verl.actor_rollout_ref.rollout.agent.default_agent_loop memsifter_ranker, its agent_loop_config_path and "
        "verl.reward.reward_manager.name naive; benchmarks/gpu/run_ranker.py's improve phase sets them) every "
        "rollout of a training row is shown its own shuffled listing; without it the row's listing is the "
        "baseline (metric listing_from_rollout 0)")
    base_url: str | None = Field(None, description="working LLM (OpenAI-compatible) base URL; task mode")
    model: str = "gpt-4o-mini"
    api_key_env: str | None = Field("OPENAI_API_KEY", description="name of the env var (in the pods) holding the "
                                    "key (null: the working LLM's server needs none)")
    temperature: float = 0.3
    max_tokens: int = 512
    concurrency: int = Field(64, description="working-LLM requests in flight per reward worker")
    max_retries: int = 4
    timeout_s: float | None = Field(None, gt=0, description="per-request timeout of the working LLM (default: "
                                    f"env MEMSIFTER_REWARD_TIMEOUT_S, else {DEFAULT_TIMEOUT_S:g} s)",
                                    json_schema_extra={"runtime": True})
    top_k: int = TOP_K
    cache_uri: str | None = Field(None, description="response cache (local or s3://); default "
                                  "<output>/_work/reward_cache")
    answer_prompt: str | None = Field(None, description="working-LLM prompt file (default: prompts/chat.txt)")
    format: Literal["exact", "partial"] = Field("exact", description="exact: a ranking needs K = min(top_k, N) "
                                                "valid ids or scores 0 (MemSifter); partial: any ranking of shown "
                                                "ids is scored on the ids it gives (lets learning start)")

    @classmethod
    def resolve(cls, **kw: Any) -> "RewardSettings":
        """Keyword arguments (verl's ``reward_kwargs``; unknown ones ignored) first, then environment
        variables, then the defaults. A bad mode or format is a ValueError naming it."""
        vals: dict[str, Any] = {}
        for name in cls.model_fields:
            v = kw.get(name)
            if v is None and name in ENV:
                v = _env(ENV[name])
            if v is not None:
                vals[name] = v
        for name in ("mode", "format", "model"):
            if name in vals:
                vals[name] = str(vals[name]).lower() if name != "model" else str(vals[name])
        for name in ("api_key_env", "cache_uri", "answer_prompt"):
            if name in vals:
                vals[name] = str(vals[name]) if vals[name] else None
        vals.setdefault("timeout_s", DEFAULT_TIMEOUT_S)
        if vals.get("mode", "dcg") not in MODES:
            raise ValueError(f"reward mode {vals['mode']!r}: expected one of {MODES}")
        if vals.get("format", "exact") not in FORMATS:
            raise ValueError(f"reward format {vals['format']!r}: expected one of {FORMATS}")
        return cls.model_validate(vals)

    def endpoint(self) -> Any:
        """The working LLM as a :class:`memsifter.models.llm.LLMEndpoint`."""
        from ..models.llm import LLMEndpoint

        return LLMEndpoint(base_url=self.base_url, model=self.model, api_key_env=self.api_key_env,
                           temperature=self.temperature, max_tokens=self.max_tokens,
                           timeout_s=self.timeout_s or DEFAULT_TIMEOUT_S, max_retries=self.max_retries,
                           concurrency=self.concurrency)

    def key(self) -> str:
        return json.dumps(self.model_dump(), sort_keys=True, default=str)
