"""Stage ``prepare-rl``: verl RL data for training the ranker (MEMSIFTER.md §6).

Inputs: published datasets, a recipe (per split, ``{dataset: count}``; inline or a YAML/JSON file
URI), optionally previous rankings (a ``rank`` output of an earlier ranker) and similarities (an
``embed`` output). Both are read as ``rankings.parquet`` files (:mod:`memsifter.retrieval.rankings`).

Sampling, per dataset (the questions' ``dataset`` column), by the one split of the training stages
(:func:`memsifter.data.splits.choose`: the split asking for the fewest questions first; no question, no
conversation and no session text in two splits; published as ``split.json`` and
summarised in the manifest's ``split`` stats); questions without gold sessions and abstention questions are
skipped; the order within a split:

- *anchor curriculum* when previous rankings cover the dataset: priority ``1 - |DCG@10 - 0.2|``
  (DCG@10 of the previous ranking divided by |gold|, ``metrics.dcg_over_gold``): hard but learnable
  questions first; questions the previous run did not rank come last; ties broken by the seed;
- otherwise seeded random sampling.

Prompt: the ranker template (``prompts/ranker.txt`` or ``prompt``), slots ``{history}`` and
``{current}``, with the session window of the rank stage (:class:`memsifter.retrieval.window.PromptBuilder`:
the same code, the same token-cost model, so the ranker trains on the prompts it is served). The
budget is ``context_limit`` prompt tokens (as the rank stage's), else ``history_budget_tokens``
(130 x 1024) of history, counted with the ranker's tokenizer: every gold session is always included,
then the other sessions in similarity order while they fit, stopping at the first that does not
(``stop_at_first_overflow``, as the rank stage does; false: it is skipped and smaller ones may still
fit). Similarity order comes from ``similarities`` (embed output), else from the previous rankings'
order, else the haystack's own order (oldest first; documented fallback, recorded per row as
``order_source``). The chosen sessions are shown in chronological order with local ids (MEMSIFTER.md
§2), most similar first with ``history_order: first_stage``, or in a seeded permutation per question
with ``shuffled`` (never in the order taken: gold is taken first). A row whose whole prompt (counted
exactly, through the chat template) would exceed ``max_prompt_tokens`` is skipped (verl would drop
it) and the next candidate is taken instead; counts are in the manifest.

Row (verl parquet): ``data_source`` = ``memsifter_{dataset}``, ``prompt`` = chat messages,
``ability``, ``reward_model`` = ``{style: rule, ground_truth: "{local gold ids};{N sessions}"}``, and
``extra_info`` with what ``memsifter.training.rewards`` needs: question, question date, gold answer, dataset,
the rendered sessions in prompt order with their dates and original ids, the local gold ids, and the
local ids in first-stage order (``first_stage_local``: the warm-up SFT's targets, the first stage as a
baseline) and each shown session's haystack position (``haystack_index``: the task reward shows the
working LLM its sessions chronologically). ``prompt_style: direct`` and ``session_tokens`` build the prompt a small-context ranker is
served with by the rank stage (ids only; each session condensed towards the question).

Output: ``train_00000.parquet`` … (train rows shuffled with the seed, split evenly into files of at
most ``shard_rows`` rows, so there is no tiny trailing shard), ``test.parquet`` (and one file per
other split), ``questions.json`` (chosen question ids per split). The manifest's stats count rows
per split and dataset.
"""

from __future__ import annotations

import logging
import math
import random
from typing import Any, Literal

import pyarrow as pa
from pydantic import Field, field_validator

from ..store import storage
from ..data import splits
from ..data.recipe import load_datasets, load_recipe
from ..data.splits import read_rows, shard_sizes  # noqa: F401 (read_rows: this output's rows, for callers)
from ..retrieval.context import TokenCounter, load_tokenizer
from ..data.model import Dataset, Question
from ..errors import InputError
from ..retrieval.metrics import dcg_over_gold
from ..retrieval.prompting import RANKER_PROMPTS, load_prompt
from ..stage import StageConfig, runtime_field, stage, uri_field
from ..retrieval.window import Window, WindowSettings

log = logging.getLogger(__name__)

HISTORY_BUDGET = 130 * 1024
MAX_PROMPT = 135168
ANCHOR_TARGET = 0.2

TURN = pa.struct([("role", pa.string()), ("content", pa.string())])
EXTRA_INFO = pa.struct([
    ("split", pa.string()), ("index", pa.int64()), ("question_id", pa.string()), ("dataset", pa.string()),
    ("question", pa.string()), ("question_date", pa.string()), ("answer", pa.string()),
    ("sessions", pa.list_(pa.string())), ("dates", pa.list_(pa.string())),
    ("session_ids", pa.list_(pa.string())), ("gold_local", pa.list_(pa.int64())),
    ("n_sessions", pa.int64()), ("prompt_tokens", pa.int64()), ("anchor_dcg10", pa.float64()),
    ("order_source", pa.string()), ("first_stage_local", pa.list_(pa.int64())),
    ("haystack_index", pa.list_(pa.int64())),
])
ROW_SCHEMA = pa.schema([
    ("data_source", pa.string()), ("prompt", pa.list_(TURN)), ("ability", pa.string()),
    ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
    ("extra_info", EXTRA_INFO),
])


class PrepareRLConfig(StageConfig, WindowSettings):
    """prepare-rl: the rank stage's session window (:class:`memsifter.retrieval.window.WindowSettings`: the same
    fields and defaults, but for ``context_limit``, unset here: a history budget instead) plus the sampling."""

    datasets: list[str] = uri_field("published datasets (import/synth outputs)", min_length=1,
                                    stage=("import", "synth"))
    recipe: dict[str, dict[str, int]] = Field(
        description="per split, {dataset: count}; or the URI of a YAML/JSON file holding that mapping "
                    "(read when the config is validated, so the manifest records the recipe used)")
    previous_rankings: list[str] = uri_field("rankings of a previous ranker (rank outputs or "
                                             "rankings parquet files): anchor curriculum", [],
                                             stage="rank", wire="none")
    similarities: list[str] = uri_field("embed outputs (rankings.parquet by similarity): order of the "
                                        "non-gold sessions in the budget", [], stage="embed")
    tokenizer: str = Field("zstanjj/MemSifter-4B-Thinking", description="ranker tokenizer (hub id or dir) "
                           "used to count the budget")
    prompt: str | None = Field(None, description="ranker prompt template URI (default: the shipped prompt of "
                               "prompt_style)")
    prompt_style: Literal["thinking", "direct"] = Field(
        "thinking", description="shipped prompt when 'prompt' is not set: thinking = MemSifter's "
        "(prompts/ranker.txt), direct = ids only for small non-thinking rankers (prompts/ranker_direct.txt, "
        "the rank stage's prompt_style direct); train with the prompt the rank stage will use")
    history_budget_tokens: int = Field(HISTORY_BUDGET, gt=0, description="history budget (130 x 1024), "
                                       "when context_limit is not set")
    context_limit: int | None = Field(None, gt=0, description="prompt tokens at most, costed exactly as the rank "
                                      "stage's context_limit (template, question, chat template, history): set "
                                      "it, stop_at_first_overflow, session_tokens, history_order and shuffle_seed "
                                      "as the rank stage will serve, and the rows hold the prompts it serves "
                                      "(gold sessions added if it leaves them out); default: history_budget_tokens "
                                      "of history")
    max_prompt_tokens: int = Field(MAX_PROMPT, gt=0, description="rows with longer prompts are skipped "
                                   "(verl data.max_prompt_length)")
    anchor_target: float = Field(ANCHOR_TARGET, description="DCG@10 the anchor curriculum aims at")
    seed: int = 0
    shard_rows: int = Field(2000, gt=0, description="train rows per parquet file at most")
    ability: str = "memory_ranking"
    include_dates: bool = Field(True, description="show session dates in the history when known")
    batch_size: int = runtime_field(64, "rows built at once")

    @field_validator("recipe", mode="before")
    @classmethod
    def _recipe(cls, v: Any) -> Any:
        return load_recipe(v)


# --------------------------------------------------------------------------- inputs
def anchor_priority(dcg10: float, target: float = ANCHOR_TARGET) -> float:
    return 1.0 - abs(dcg10 - target)


# --------------------------------------------------------------------------- prompt building
# The answer prefill the rank stage serves each prompt style with (its ``answer_prefix: auto``). A verl
# row holds only the user message (the policy writes the whole answer), but the window is costed with
# the prefill, as the rank stage costs it, so that both pick the same sessions.
SERVED_PREFIX = {"thinking": "", "direct": "<ranking>"}


class Builder:
    """The ranker prompts of prepare-rl: the rank stage's session window (:mod:`memsifter.retrieval.window`,
    same builder, same settings), with the question's gold sessions always shown."""

    def __init__(self, config: PrepareRLConfig, ds: Dataset, sims: dict[str, list[str]],
                 prev: dict[str, list[str]]):
        self.config, self.ds, self.sims, self.prev = config, ds, sims, prev
        from ..models import registry as models

        self.tokenizer = load_tokenizer(models.resolve(config.tokenizer))
        self.counter = TokenCounter(self.tokenizer)
        self.template = load_prompt(config.prompt, RANKER_PROMPTS[config.prompt_style], ("history", "current"))
        self.window = config.builder(
            self.counter, self.template, answer_prefix=SERVED_PREFIX[config.prompt_style],
            history_budget=config.history_budget_tokens if config.context_limit is None else None,
            include_dates=config.include_dates)

    def order(self, q: Question) -> tuple[list[int], str]:
        """Haystack indices in first-stage order (similarities, else the previous ranking, else the
        haystack's own order) and the name of that source."""
        hay = q.haystack_session_ids
        pos = {s: i for i, s in enumerate(hay)}
        if q.question_id in self.sims:
            source, ranked = "similarity", self.sims[q.question_id]
        elif q.question_id in self.prev:
            source, ranked = "previous_ranking", self.prev[q.question_id]
        else:
            source, ranked = "haystack", list(hay)
        order = list(dict.fromkeys(pos[s] for s in ranked if s in pos))
        seen = set(order)
        return order + [i for i in range(len(hay)) if i not in seen], source

    def build(self, q: Question) -> tuple[Window, str]:
        """The question's window (gold sessions required) and the name of its order's source."""
        hay = q.haystack_session_ids
        order, source = self.order(q)
        w = self.window.build(q.question, hay, self.ds.sessions, [q.date_of(s, self.ds.sessions) for s in hay],
                              [hay[i] for i in order], key=q.question_id, required=q.gold_session_ids)
        return w, source

    def select(self, q: Question) -> tuple[list[int], str, int]:
        """Haystack indices shown (in the prompt's order, ``history_order``), the order source and the
        prompt's tokens (chat template; exact unless required sessions are far over the limit)."""
        w, source = self.build(q)
        return w.shown, source, w.prompt_tokens

    def row(self, q: Question, chosen: list[int], source: str, tokens: int, split: str, index: int,
            dcg10: float | None) -> dict:
        """The verl row of a window ``chosen`` by :meth:`select` (re-rendered here rather than kept, so
        that only the chosen indices of every row are held in memory)."""
        hay = [q.haystack_session_ids[i] for i in chosen]
        texts = [self.window.session_text(self.ds.sessions[s].turns, q.question) for s in hay]
        dates = [q.date_of(s, self.ds.sessions) if self.config.include_dates else None for s in hay]
        prompt = self.window.messages(q.question, texts, dates)[:1]  # the user message (no prefill)
        gold = set(q.gold_session_ids)
        gold_local = [i for i, s in enumerate(hay) if s in gold]
        local = {h: i for i, h in enumerate(chosen)}  # haystack index -> local id
        first_stage = [local[h] for h in self.order(q)[0] if h in local]
        return {
            "data_source": f"memsifter_{q.dataset}",
            "prompt": prompt,
            "ability": self.config.ability,
            "reward_model": {"style": "rule",
                             "ground_truth": f"{','.join(map(str, gold_local))};{len(hay)}"},
            "extra_info": {
                "split": split, "index": index, "question_id": q.question_id, "dataset": q.dataset,
                "question": q.question, "question_date": q.question_date, "answer": q.answer,
                "sessions": texts, "dates": dates, "session_ids": hay, "gold_local": gold_local,
                "n_sessions": len(hay), "prompt_tokens": tokens, "anchor_dcg10": dcg10,
                "order_source": source, "first_stage_local": first_stage, "haystack_index": list(chosen),
            },
        }


# --------------------------------------------------------------------------- the stage
@stage("prepare-rl", PrepareRLConfig, family="train",
       help="verl RL data: recipe sampling (anchor curriculum), ranker prompts within the token budget")
def run(config: PrepareRLConfig, out: storage.Publication) -> dict:
    ds = load_datasets(config.datasets)
    prev = {q: ids for q, (_, ids) in splits.load_orders(config.previous_rankings, "previous_rankings").items()}
    sims = {q: ids for q, (_, ids) in splits.load_orders(config.similarities, "similarities").items()}
    builder = Builder(config, ds, sims, prev)

    by_ds: dict[str, list[Question]] = {}
    skipped_no_gold = 0
    for q in ds.questions:
        if not q.gold_session_ids or q.abstention:
            skipped_no_gold += 1
            continue
        by_ds.setdefault(q.dataset, []).append(q)
    known = sorted({q.dataset for q in ds.questions})
    for split, entries in config.recipe.items():
        for name in entries:
            if name not in known:
                raise InputError(f"recipe {split}: no questions of dataset '{name}' in the inputs "
                                 f"(datasets present: {', '.join(known)})")

    pool = [q for qs in by_ds.values() for q in qs]
    dcgs = {q.question_id: dcg_over_gold(prev[q.question_id], q.gold_session_ids, 10)
            for q in pool if q.question_id in prev}
    strategy: dict[str, str] = {name: "anchor" if any(q.question_id in dcgs for q in qs) else "random"
                                for name, qs in by_ds.items()}

    def priority(split: str, name: str, q: Question) -> tuple[float, float]:
        """Anchor curriculum: the highest priority first, questions the previous ranker did not rank last;
        else a seeded draw."""
        d = dcgs.get(q.question_id)
        if strategy.get(name) != "anchor":
            return (0.0, splits.tiebreak(config.seed, split, name, q.question_id))
        prio = anchor_priority(d, config.anchor_target) if d is not None else -math.inf
        return (-prio, splits.tiebreak(config.seed, split, name, q.question_id))

    selected: dict[str, tuple[list[int], str, int]] = {}

    def accept(q: Question) -> bool:
        """A question whose whole prompt fits max_prompt_tokens (else the next one is taken)."""
        sel, source, tokens = builder.select(q)
        if tokens > config.max_prompt_tokens:
            return False
        selected[q.question_id] = (sel, source, tokens)
        return True

    plan = splits.choose(pool, ds.sessions, config.recipe, config.seed, priority=priority, accept=accept)
    over_max = sum(plan.refused.values())
    shortfall = plan.shortfall
    chosen: dict[str, list[tuple[Question, list[int], str, int, float | None]]] = {
        split: [(q, *selected[q.question_id], dcgs.get(q.question_id)) for q in qs]
        for split, qs in plan.chosen.items()}
    stats_split: dict[str, dict[str, int]] = {
        split: {name: sum(1 for q in plan.chosen[split] if q.dataset == name) for name in entries}
        for split, entries in config.recipe.items()}
    strategy = {name: strategy[name] for name in sorted({d for e in config.recipe.values() for d in e})}

    for split, items in chosen.items():
        if not items and sum(config.recipe.get(split, {}).values()) > 0:
            # an empty split would be published as a 0-row parquet, which verl's loader cannot read
            # (seen on the GPU run: ArrowInvalid "BatchSize must be greater than 0")
            raise InputError(f"recipe {split}: no question fits: {over_max} over max_prompt_tokens="
                             f"{config.max_prompt_tokens}; raise max_prompt_tokens or lower "
                             f"history_budget_tokens", field=f"recipe.{split}")
    files: dict[str, list[str]] = {}
    prompt_tokens: list[int] = []
    kept: list[int] = []
    order_sources: dict[str, int] = {}
    for split, items in chosen.items():
        if split == "train":
            random.Random(f"{config.seed}:shuffle").shuffle(items)
            sizes = shard_sizes(len(items), config.shard_rows)
            names = [f"train_{i:05d}.parquet" for i in range(len(sizes))]
        else:
            sizes, names = [len(items)], [f"{split}.parquet"]
        files[split] = names
        start = 0
        for name, size in zip(names, sizes):
            rows = []
            for j, (q, sel, source, tokens, dcg) in enumerate(items[start:start + size]):
                rows.append(builder.row(q, sel, source, tokens, split, start + j, dcg))
                prompt_tokens.append(tokens)
                kept.append(len(sel))
                order_sources[source] = order_sources.get(source, 0) + 1
            out.write_table(name, pa.Table.from_pylist(rows, schema=ROW_SCHEMA))
            start += size
    out.write_json("questions.json", {split: [q.question_id for q, *_ in items] for split, items in chosen.items()})
    out.write_json(splits.SPLIT_FILE, plan.document())
    n_rows = {split: len(items) for split, items in chosen.items()}
    return {
        "rows": n_rows, "rows_by_dataset": stats_split, "files": files, "sampling": strategy, "split": plan.summary(),
        "shortfall": shortfall, "skipped_no_gold_or_abstention": skipped_no_gold,
        "skipped_over_max_prompt": over_max, "order_source": order_sources,
        "sessions_kept_mean": round(sum(kept) / len(kept), 2) if kept else 0,
        "prompt_tokens_mean": round(sum(prompt_tokens) / len(prompt_tokens), 1) if prompt_tokens else 0,
        "prompt_tokens_max": max(prompt_tokens, default=0),
        "token_cache": {"hits": builder.counter.hits, "misses": builder.counter.misses},
    }


def ground_truth(row: dict) -> tuple[list[int], int]:
    gold, _, n = row["reward_model"]["ground_truth"].rpartition(";")
    return [int(x) for x in gold.split(",") if x], int(n)

