"""What the train stage, the reward and verl's workers agree on for the memory agents' training, without
importing verl (the train stage's driver composes verl's config without starting it).

* the agent-loop names of prepare-agents' rows (``agent_name``) and the agent method each runs;
* the shipped agent-loop file verl reads (``actor_rollout_ref.rollout.agent.agent_loop_config_path``):
  :func:`config_path`, ``memsifter/configs/verl/agent_loops.yaml`` in the installed package;
* the environment of the Ray job that the train stage writes and :mod:`memsifter.agents.verl_loop` reads;
* :func:`plain`: a dataset row's values as plain Python, as every verl loop of ours reads them.
"""

from __future__ import annotations

from importlib import resources
from typing import Any

DATA_SOURCE = "memsifter_agent"  # prepare-agents' data_source: the reward scores these rows as agent episodes
LOOPS = {"memsifter_search": "agent:search", "memsifter_memory": "agent:memory",
         "memsifter_memory_recall": "agent:memory+recall"}
SEARCH_LOOPS = frozenset({"memsifter_search"})  # loops that search the memory service

SEARCH_URL_ENV = "MEMSIFTER_AGENT_SEARCH_URL"           # the memory service's base URL (train: search_url)
SEARCH_KEY_ENV = "MEMSIFTER_AGENT_SEARCH_API_KEY_ENV"   # the NAME of the variable holding its key (not the key)
KEEP_MESSAGES_ENV = "MEMSIFTER_AGENT_KEEP_MESSAGES"     # "1": each output keeps its conversation (tests, debugging)

CONFIG = ("configs", "verl", "agent_loops.yaml")


def config_path() -> str:
    """The shipped agent-loop file as a local path (the same on every node running this image)."""
    return str(resources.files("memsifter").joinpath(*CONFIG))


def plain(x: Any) -> Any:
    """Parquet/numpy values as plain Python (a row's extra_info arrives with numpy arrays for lists)."""
    if isinstance(x, dict):
        return {k: plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [plain(v) for v in x]
    if hasattr(x, "tolist") and not isinstance(x, (str, bytes)):
        return plain(x.tolist())
    return x
