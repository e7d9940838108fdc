"""The ranker's rollouts with a listing of their own (issue 44): a verl 0.9.1 agent loop for prepare-rl's rows.

Why: a ranker trained on rows that list their sessions in one fixed order can score by copying it (the DAPO rankers
of issue 34 changed the order of 0 of 96 held-out questions). With ``reward.mode: improvement``
(:mod:`memsifter.training.rewards`: NDCG@K of the ranking minus NDCG@K of the listing it was shown) copying earns 0;
for that to teach reordering, the n rollouts of one prompt must start from different orders, so that the group's
advantages compare rankings, not listings.

What a rollout is shown: the row's prompt with its sessions listed in a permutation drawn for that rollout, built as
the rank stage builds a ``history_order: shuffled`` prompt (:func:`memsifter.retrieval.context.shown_order` with the
key ``"<seed>:<question id>"``, the history rendered by :func:`memsifter.retrieval.render.render_history_texts`, as
:func:`memsifter.retrieval.window.prompt_messages` renders every prompt): the prompt of rollout seed ``s`` is the one
the rank stage serves with ``shuffle_seed: s`` over the same sessions (tests/test_ranker_rl.py compares them). The
seed of a training rollout comes from verl's prompt uid and the rollout's index (``session_id`` of the v1 trainer),
so the n rollouts of a prompt get n listings; a validation row (``extra_info.split`` not ``train``) keeps the row's
own listing, as the rank stage serves it. The listing (the row's local ids in the order shown) and the seed go in
the output's ``extra_fields`` (:data:`memsifter.training.rewards.LISTING`, ``ranker_listing_seed``); verl's
``naive`` reward manager merges them into the reward function's ``extra_info``, which reads the ranking's ids
through it (``dapo``'s manager does not pass them: use ``naive``).

How a run turns it on (the train config's ``verl:`` block; :func:`verl_settings` gives the three keys):
``actor_rollout_ref.rollout.agent.agent_loop_config_path`` = :func:`config_path` (the shipped
``memsifter/configs/verl/ranker_loop.yaml``), ``actor_rollout_ref.rollout.agent.default_agent_loop`` =
``memsifter_ranker`` (prepare-rl's rows carry no ``agent_name``), ``reward.reward_manager.name`` = ``naive``.
"""

from __future__ import annotations

import hashlib
import uuid
from importlib import resources
from typing import Any

from ..agents.verl_names import plain
from ..retrieval.context import shown_order
from ..retrieval.render import render_history_texts
from .rewards import LISTING

NAME = "memsifter_ranker"
SEED_FIELD = "ranker_listing_seed"
CONFIG = ("configs", "verl", "ranker_loop.yaml")


def config_path() -> str:
    """The shipped agent-loop file as a local path (the same on every node running this image)."""
    return str(resources.files("memsifter").joinpath(*CONFIG))


def verl_settings() -> dict[str, Any]:
    """The train config's ``verl:`` keys that run prepare-rl's rows through this loop."""
    return {"actor_rollout_ref.rollout.agent.agent_loop_config_path": config_path(),
            "actor_rollout_ref.rollout.agent.default_agent_loop": NAME,
            "reward.reward_manager.name": "naive"}


def rollout_seed(uid: Any, session_id: Any) -> int:
    """The listing seed of rollout ``session_id`` of prompt ``uid`` (verl's per-step prompt id); a fresh random one
    when verl gives no rollout index."""
    key = f"{uid}:{session_id}" if uid is not None and session_id is not None else uuid.uuid4().hex
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], "big") >> 1


def relist(messages: list[dict], extra_info: dict, seed: int) -> tuple[list[dict], list[int]]:
    """The row's prompt ``messages`` with its sessions listed as the rank stage lists them for ``shuffle_seed:
    seed`` (``history_order: shuffled``), and that listing as the row's local ids in the order shown. The row's
    history block (its sessions as shown, in the row's order, with their dates) must occur once in its user
    message (a ValueError otherwise: the row was not built by prepare-rl's window)."""
    info = plain(dict(extra_info))
    texts, dates = list(info.get("sessions") or []), info.get("dates")
    dates = list(dates) if dates is not None else None
    hay = [int(h) for h in (info.get("haystack_index") or range(len(texts)))]
    if len(hay) != len(texts):
        raise ValueError(f"row {info.get('question_id')}: {len(texts)} sessions, {len(hay)} haystack positions")
    local = {h: i for i, h in enumerate(hay)}
    listing = [local[h] for h in shown_order(hay, [], "shuffled", f"{seed}:{info.get('question_id')}")]
    old = render_history_texts(texts, dates)
    new = render_history_texts([texts[i] for i in listing], [dates[i] for i in listing] if dates is not None else None)
    out = [dict(m) for m in messages]
    user = next((m for m in out if m.get("role") == "user"), None)
    if user is None or str(user.get("content", "")).count(old) != 1:
        raise ValueError(f"row {info.get('question_id')}: its history block is not found once in its prompt")
    user["content"] = str(user["content"]).replace(old, new)
    return out, listing


def rollout_prompt(messages: list[dict], extra_info: dict, uid: Any = None,
                   session_id: Any = None) -> tuple[list[dict], list[int], int | None]:
    """(messages, listing, seed) of one rollout: a training row re-listed by :func:`relist` with
    :func:`rollout_seed`; any other row as it is (its own listing, seed None)."""
    info = plain(dict(extra_info or {}))
    if info.get("split", "train") != "train":
        return [dict(m) for m in messages], list(range(len(info.get("sessions") or []))), None
    seed = rollout_seed(uid, session_id)
    msgs, listing = relist(messages, info, seed)
    return msgs, listing, seed


try:  # the loop itself needs verl (the train stage's driver imports this module's helpers without it)
    from verl.experimental.agent_loop.agent_loop import AgentLoopOutput, register
    from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop
except ImportError:  # pragma: no cover - verl not installed
    SingleTurnAgentLoop = None

if SingleTurnAgentLoop is not None:
    @register(NAME)
    class RankerAgentLoop(SingleTurnAgentLoop):
        """verl's single-turn loop on the rollout's own listing of the row's prompt (see the module doc)."""

        async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
            msgs, listing, seed = rollout_prompt(list(kwargs["raw_prompt"]), kwargs.get("extra_info") or {},
                                                 kwargs.get("uid"), kwargs.get("session_id"))
            out = await super().run(sampling_params, **{**kwargs, "raw_prompt": msgs})
            out.extra_fields[LISTING] = listing
            out.extra_fields[SEED_FIELD] = seed
            return out

    __all__ = ["NAME", "RankerAgentLoop", "config_path", "relist", "rollout_prompt", "rollout_seed", "verl_settings"]
