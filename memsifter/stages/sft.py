"""Stage ``sft``: a warm-up fine-tune of the ranker before DAPO (MEMSIFTER.md §6; the original run
started RL from an SFT checkpoint).

Why: a small instruct model (SmolLM2-135M-Instruct) asked for a ranking writes a valid one rarely
(measured in ``benchmarks/gpu/README.md``), so a task or DCG reward is 0 for nearly every rollout and
GRPO's group advantages are 0: RL cannot start. A few hundred supervised examples teach the format and
put the ranker near the first stage, so RL starts from there instead of below random.

Held-out split: before anything is loaded, the prepare stage's ``split.json`` is checked
(:func:`memsifter.data.splits.check`: no question, conversation or session text in two splits) and every
train and eval row must belong to its own split; one line naming the file, row and field otherwise. The
manifest's ``split`` stats record it (seed, questions, conversations and session hashes per split).

Data: the ``prepare-rl`` output (the same rows, prompts and local ids DAPO trains on). Target of a
row (``target``):

- ``gold_first``: the gold sessions (in first-stage order), then the other shown sessions in
  first-stage order; the supervised signal is which shown sessions hold the answer;
- ``first_stage``: the first stage's order alone (distillation of the retriever, no labels).

Both are cut to ``top_k`` ids and written as the answer the reward parses,
``<ranking>i, j, …</ranking>`` followed by the end-of-turn token. The loss covers the answer tokens
only. Prompts are the user message through the model's chat template with the generation prompt,
exactly what verl's rollout and the rank stage (``answer_prefix: ''``) send.

Training: AdamW, linear warm-up then cosine decay, batches packed by a token budget (rows sorted by
length within shuffled chunks), bf16 autocast on GPU and fp32 on CPU, gradient clipping. With
``lora_rank > 0`` (default 16) only a LoRA adapter is trained (PEFT); it is the artifact, and
``train``'s ``init_adapter`` continues it under DAPO so the final ranker stays one adapter of the
base model. ``lora_rank: 0`` fine-tunes every weight.

Evaluation on the ``eval_split`` rows (prepare-rl's ``test``): loss, and greedy answers of up to
``eval_generate`` rows: valid-format rate (K = min(top_k, N) distinct shown ids) and NDCG@10 of the
ranking against the gold local ids, before training and after each epoch, beside the first stage's
NDCG on the same rows.

Agent traces (``traces``, issue 33), instead of ``data``: the SFT traces of a ``prepare-agents`` output
(``sft_train.jsonl``; its ``sft_<eval_split>.jsonl`` for evaluation), one multi-turn chat record per
trajectory, of every agent that output prepared (prepare one agent's data, ``agents: [agent:search]``, to
train an adapter for it alone). A record is tokenized as the verl agent loop
tokenizes a conversation: the whole of it through the model's chat template
(``apply_chat_template(messages, tokenize=True)``); the loss covers the assistant replies only, each with
the end-of-turn token that closes it (found by rendering the conversation up to each reply, with and
without it: :func:`encode_chat`); prompts and observations (user messages, the template's text) are
labelled -100. Evaluation: loss, and the share of greedy replies that parse with the agent's own parser
(``parse_rate``: the last reply of up to ``eval_generate`` records regenerated from the messages before
it, cut at the record's stop strings as the server cuts them).

Output: ``adapter/`` (``adapter_config.json`` with ``base_model_name_or_path`` = ``model`` as given, so
``memsifter models`` names stay portable, and ``adapter_model.safetensors`` in bf16) or ``model/``
(full fine-tune, HF directory), ``metrics.jsonl`` (one record per optimizer step and per evaluation),
``sft_curves.png``, ``eval.json``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import shutil
import tempfile
import time
from typing import Any, Literal

from pydantic import Field, model_validator

from ..data import splits
from ..data.splits import read_rows
from ..store import storage
from ..errors import InputError
from ..retrieval.metrics import ndcg
from ..retrieval.rankings import parse_ranking
from ..stage import StageConfig, runtime_field, stage, uri_field

log = logging.getLogger(__name__)


class SFTConfig(StageConfig):
    model: str = Field("smollm2-135m-instruct", description="base ranker: hub id, local dir, s3:// URI or a "
                       "name of `memsifter models list`")
    data: str | None = uri_field("prepare-rl output (train_*.parquet; its eval split for evaluation); or "
                                 "give traces instead (then set data: null in a pipeline with prepare-rl)",
                                 None, stage="prepare-rl")
    traces: str | None = uri_field("prepare-agents output: train on its SFT traces (sft_train.jsonl; "
                                   "sft_<eval_split>.jsonl for evaluation), loss on the assistant replies",
                                   None, stage="prepare-agents", wire="none")
    target: Literal["gold_first", "first_stage"] = Field("gold_first", description="answer taught: gold "
                                                         "sessions first, then first-stage order; or the "
                                                         "first stage's order alone")
    top_k: int = Field(10, ge=1, description="ids in a target ranking (the reward's K = min(top_k, N))")
    lora_rank: int = Field(16, ge=0, description="LoRA rank (0: fine-tune every weight)")
    lora_alpha: int = Field(32, gt=0)
    lora_target_modules: str | list[str] = Field("all-linear", description="modules given LoRA adapters")
    lr: float = Field(2e-4, gt=0, description="peak learning rate (LoRA; use ~1e-5 for full fine-tuning)")
    epochs: int = Field(2, ge=1)
    batch_tokens: int = Field(16384, gt=0, description="padded tokens per optimizer step at most")
    warmup_ratio: float = Field(0.05, ge=0, lt=1)
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float = Field(1.0, gt=0)
    seed: int = 0
    max_rows: int | None = Field(None, ge=1, description="train on the first N rows only (smoke runs)")
    eval_split: str = Field("test", description="prepare-rl split for evaluation ('' for none)")
    eval_generate: int = Field(64, ge=0, description="eval rows answered greedily for format rate and NDCG "
                               "(traces: records whose last reply is regenerated for the parse rate)")
    device: str = runtime_field("auto", "auto: cuda when available, else cpu")

    @model_validator(mode="after")
    def _one_source(self) -> "SFTConfig":
        if (self.data is None) == (self.traces is None):
            raise ValueError("give either data (prepare-rl rows: the ranker) or traces (prepare-agents SFT "
                             "traces: the memory agents), not both and not neither")
        return self

    def preflight(self) -> None:
        """A base model this machine could not load is one line before anything is read or loaded."""
        from ..models.embedding import check_model_ref

        check_model_ref(self.model, "sft", adapters=True)


# --------------------------------------------------------------------------- data
def checked_split(uri: str, train_rows: list[dict], eval_rows: list[dict], eval_split: str, traces: bool) -> dict:
    """The prepare stage's published split, checked (:func:`memsifter.data.splits.check`: no question,
    conversation or session text in two splits) with every train and eval row in its own split; the manifest's
    ``split`` stats of this output (seed, questions and conversations per split)."""
    doc = splits.read_split(uri)
    field = "question_id" if traces else "extra_info.question_id"
    for split, rows in (("train", train_rows), (eval_split, eval_rows)):
        if rows:
            qids = [(n, r["question_id"] if traces else r["extra_info"]["question_id"]) for n, r in enumerate(rows)]
            splits.check_rows(doc, split, qids, storage.join(uri, f"{split} rows"), field)
    return {"seed": doc.get("seed"), "source": storage.join(uri, splits.SPLIT_FILE),
            "splits": {s: {"questions": len(e["question_ids"]), "conversations": e["conversations"],
                           "session_hashes": len(e["session_hashes"])} for s, e in doc["splits"].items()}}


def target_ids(row: dict, target: str, top_k: int, where: str = "") -> list[int]:
    """The ranking taught for one prepare-rl row (local ids)."""
    info = row.get("extra_info") or {}
    n = int(info.get("n_sessions") or 0)
    order = list(info.get("first_stage_local") or [])
    if not order or sorted(order) != list(range(n)):
        raise InputError("extra_info.first_stage_local is missing or not a permutation of the shown sessions "
                         "(prepare-rl of this version writes it)", file=where, item=f"row {info.get('index')}",
                         field="extra_info.first_stage_local")
    if target == "gold_first":
        gold = set(info.get("gold_local") or [])
        order = [i for i in order if i in gold] + [i for i in order if i not in gold]
    return order[:min(top_k, n)]


def answer_text(ids: list[int]) -> str:
    return "<ranking>" + ", ".join(str(i) for i in ids) + "</ranking>"


def encode(tokenizer: Any, row: dict, answer: str | None) -> tuple[list[int], list[int]]:
    """(prompt ids, answer ids + end of turn) as the rollout sees them."""
    msgs = [dict(m) for m in row["prompt"]]
    prompt = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    p_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    if answer is None:
        return p_ids, []
    a_ids = tokenizer(answer, add_special_tokens=False)["input_ids"]
    eos = reply_end_id(tokenizer)
    return p_ids, a_ids + ([eos] if eos is not None else [])


def reply_end_id(tokenizer: Any) -> int | None:
    """The token that closes an assistant reply in the chat template (ChatML: ``<|im_end|>``), else the
    tokenizer's eos. SmolLM2's converted tokenizer names ``<|im_start|>`` its eos; a reply ending in it
    would teach the model to open a new turn instead of ending its own."""
    marker = "\u2063REPLY\u2063"
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "q"},
                                              {"role": "assistant", "content": marker}], tokenize=False)
    except Exception:  # noqa: BLE001 - no chat template: the tokenizer's eos
        return tokenizer.eos_token_id
    i = text.rfind(marker)
    tail = tokenizer(text[i + len(marker):], add_special_tokens=False)["input_ids"] if i >= 0 else []
    # the first token after the reply (SmolLM2 does not even list <|im_end|> among its special tokens)
    return int(tail[0]) if tail else tokenizer.eos_token_id


def batches(lengths: list[int], budget: int, seed: int) -> list[list[int]]:
    """Index batches whose padded size (rows x longest) stays within ``budget`` tokens; rows are
    sorted by length within shuffled chunks so padding stays small and order still varies."""
    idx = list(range(len(lengths)))
    rng = random.Random(seed)
    rng.shuffle(idx)
    chunk = 256
    out: list[list[int]] = []
    for c in range(0, len(idx), chunk):
        part = sorted(idx[c:c + chunk], key=lambda i: lengths[i])
        cur: list[int] = []
        longest = 0
        for i in part:
            longest2 = max(longest, lengths[i])
            if cur and longest2 * (len(cur) + 1) > budget:
                out.append(cur)
                cur, longest2 = [], lengths[i]
            cur.append(i)
            longest = longest2
        if cur:
            out.append(cur)
    rng.shuffle(out)
    return out


def lr_at(step: int, total: int, warmup: int, peak: float) -> float:
    if warmup and step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return peak * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))


# --------------------------------------------------------------------------- evaluation
def left_padded(prompts: list[list[int]], pad: int) -> tuple[Any, Any]:
    """Token-id prompts as one left-padded batch for ``generate``: (input_ids, attention_mask)."""
    import torch

    width = max(len(p) for p in prompts)
    x = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        x[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    return x, mask


def evaluate_rows(model: Any, tokenizer: Any, rows: list[dict], top_k: int, device: str,
                  generate: int, max_new_tokens: int, batch: int = 16) -> dict:
    """Greedy answers of the first ``generate`` rows (left-padded batches: one token step costs the
    same kernel launches for 16 rows as for 1): valid-format rate and NDCG@10 (local ids)."""
    import torch

    model.eval()
    rows = rows[:generate]
    valid, scores, first, samples = 0, [], [], []
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    with torch.no_grad():
        for b in range(0, len(rows), batch):
            part = rows[b:b + batch]
            prompts = [encode(tokenizer, r, None)[0] for r in part]
            x, mask = left_padded(prompts, pad)
            y = model.generate(input_ids=x.to(device), attention_mask=mask.to(device), max_new_tokens=max_new_tokens,
                               do_sample=False, pad_token_id=pad)
            for r, out in zip(part, y):
                info = r["extra_info"]
                n = int(info["n_sessions"])
                gold = [str(g) for g in info["gold_local"]]
                text = tokenizer.decode(out[x.shape[1]:], skip_special_tokens=True)
                parsed = parse_ranking(text, n, k=min(top_k, n))
                valid += int(parsed.ok)
                scores.append(ndcg([str(i) for i in parsed.ids] if parsed.ok else [], gold, 10))
                first.append(ndcg([str(i) for i in info["first_stage_local"]], gold, 10))
                if len(samples) < 3:
                    samples.append(text[:200])
    m = max(1, len(rows))
    return {"rows": len(rows), "valid_format": valid / m, "ndcg@10": sum(scores) / m,
            "first_stage_ndcg@10": sum(first) / m, "samples": samples}


def eval_loss(model: Any, data: list[tuple[list[int], list[int]]], device: str, budget: int) -> float:
    """Mean loss per labelled token of ``data`` ((ids, labels) pairs)."""
    import torch

    model.eval()
    tot, n = 0.0, 0
    with torch.no_grad():
        for b in batches([len(ids) for ids, _ in data], budget, 0):
            ids, labels, mask = collate([data[i] for i in b], 0)
            out = model(input_ids=ids.to(device), attention_mask=mask.to(device), labels=labels.to(device))
            k = int((labels[:, 1:] != -100).sum())
            tot += float(out.loss) * k
            n += k
    return tot / max(1, n)


def labelled(prompt: list[int], answer: list[int]) -> tuple[list[int], list[int]]:
    """(ids, labels) of a prompt and its answer: the loss on the answer only."""
    return prompt + answer, [-100] * len(prompt) + answer


def collate(items: list[tuple[list[int], list[int]]], pad_id: int) -> tuple[Any, Any, Any]:
    """Right-padded batch of (ids, labels) pairs: ids, labels (-100 on padding), attention mask."""
    import torch

    width = max(len(ids) for ids, _ in items)
    ids_t = torch.full((len(items), width), pad_id, dtype=torch.long)
    labels_t = torch.full((len(items), width), -100, dtype=torch.long)
    mask = torch.zeros((len(items), width), dtype=torch.long)
    for r, (ids, labels) in enumerate(items):
        ids_t[r, :len(ids)] = torch.tensor(ids)
        labels_t[r, :len(labels)] = torch.tensor(labels)
        mask[r, :len(ids)] = 1
    return ids_t, labels_t, mask


# --------------------------------------------------------------------------- agent traces
def trace_records(uri: str, split: str) -> list[dict]:
    """The SFT trace records of one split of a prepare-agents output."""
    manifest = storage.read_manifest(uri)
    if manifest.get("stage") != "prepare-agents":
        raise InputError(f"the output of stage '{manifest.get('stage')}', not prepare-agents", file=uri,
                         field="traces")
    name = (((manifest.get("stats") or {}).get("traces") or {}).get("files") or {}).get(split)
    if not name:
        return []
    where = storage.join(uri, name)
    out: list[dict] = []
    for n, line in enumerate(storage.read_text(storage.published_file(uri, name)).splitlines(), 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except ValueError as e:
            raise InputError(f"not JSON ({e})", file=where, item=f"line {n}") from None
        msgs = r.get("messages") if isinstance(r, dict) else None
        if (not isinstance(msgs, list) or len(msgs) < 2 or any(
                not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str)
                for m in msgs) or msgs[0]["role"] == "assistant" or msgs[-1]["role"] != "assistant"):
            raise InputError("expected chat messages ({role, content}), not starting with an assistant message and "
                             "ending with one", file=where, item=f"line {n}", field="messages")
        out.append(r)
    return out


def end_of_turn_ids(tokenizer: Any, path: str | None = None) -> set[int]:
    """Token ids that end a reply: the tokenizer's eos and the model's generation eos (SmolLM2's tokenizer
    names ``<|im_start|>`` its eos, its generation config ``<|im_end|>``)."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    f = os.path.join(path, "generation_config.json") if path else None
    if f and os.path.isfile(f):
        with open(f) as fh:
            eos = json.load(fh).get("eos_token_id")
        ids.update(int(x) for x in (eos if isinstance(eos, list) else [eos]) if x is not None)
    return ids


def render_ids(tokenizer: Any, messages: list[dict], generation_prompt: bool = False) -> list[int]:
    return list(tokenizer.apply_chat_template([dict(m) for m in messages], tokenize=True,
                                              add_generation_prompt=generation_prompt, return_dict=False))


def encode_chat(tokenizer: Any, messages: list[dict], eot: set[int], where: str = "") -> tuple[list[int], list[int]]:
    """(ids, labels) of a conversation: ids = the whole conversation through the chat template (as the verl
    agent loop renders it); labels = the ids of each assistant reply and the end-of-turn token closing it,
    -100 elsewhere. A reply's span is found by rendering the conversation up to it with the generation
    prompt (where the reply starts) and up to it included (the end-of-turn token is the last of ``eot``
    there; the template's text after it, ChatML's newline, is not the model's)."""
    ids = render_ids(tokenizer, messages)
    labels = [-100] * len(ids)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        if i == 0:
            raise InputError("a conversation starting with an assistant message", file=where, field="messages")
        before = render_ids(tokenizer, messages[:i], True)
        upto = render_ids(tokenizer, messages[:i + 1])
        if ids[:len(before)] != before or ids[:len(upto)] != upto or len(upto) <= len(before):
            raise InputError(f"the chat template does not render message {i} as the continuation of the messages "
                             f"before it (a template that rewrites earlier turns): its reply cannot be masked",
                             file=where, field="messages")
        end = len(upto)
        for j in range(len(upto) - 1, len(before) - 1, -1):
            if upto[j] in eot:
                end = j + 1
                break
        labels[len(before):end] = ids[len(before):end]
    return ids, labels


def reply_parses(method: str, kind: str, text: str, stop: list[str]) -> bool:
    """Whether a reply to a request of ``kind`` parses with the agent's own parser (well-formed tags and the
    action the request asks for)."""
    from ..agents.base import close_stop

    text = close_stop(text, stop)
    if method == "agent:search":
        from ..agents.search import parse_reply

        p = parse_reply(text)
        return p.ok and (kind != "answer" or p.action == "answer")
    from ..agents.memory import parse_answer, parse_notes

    if kind == "answer":
        answer, problems = parse_answer(text)
        return answer is not None and not problems
    return not parse_notes(text, recall=method == "agent:memory+recall").problems


def cut_at_stop(text: str, stop: list[str]) -> str:
    """``text`` up to and including the first stop string in it (as a server stops)."""
    hits = [(text.find(s), s) for s in stop if s and text.find(s) >= 0]
    if not hits:
        return text
    i, s = min(hits)
    return text[:i + len(s)]


def evaluate_traces(model: Any, tokenizer: Any, records: list[dict], device: str, generate: int,
                    batch: int = 16) -> dict:
    """Greedy regeneration of the last reply of ``generate`` records (evenly spaced in the file), in
    left-padded batches of records with the same stop strings, each reply at most its record's ``max_tokens``
    and stopped at those strings (as the server stops it): the share that parses (:func:`reply_parses`)."""
    import torch

    model.eval()
    n = min(generate, len(records))
    rows = [records[i * len(records) // n] for i in range(n)]   # spread over the file: every agent and kind
    ok, samples = 0, []
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault(tuple(r.get("stop") or ()), []).append(r)
    parts = [(stop, g[i:i + batch]) for stop, g in groups.items() for i in range(0, len(g), batch)]
    with torch.no_grad():
        for stop, part in parts:
            prompts = [render_ids(tokenizer, r["messages"][:-1], True) for r in part]
            x, mask = left_padded(prompts, pad)
            new = max(int(r.get("max_tokens") or 256) for r in part)
            y = model.generate(input_ids=x.to(device), attention_mask=mask.to(device), max_new_tokens=new,
                               do_sample=False, pad_token_id=pad, stop_strings=list(stop) or None,
                               tokenizer=tokenizer)
            for r, out in zip(part, y):
                text = cut_at_stop(tokenizer.decode(out[x.shape[1]:], skip_special_tokens=True), list(r.get("stop") or []))
                good = reply_parses(str(r.get("method")), str(r.get("kind")), text, list(r.get("stop") or []))
                ok += int(good)
                if len(samples) < 3:
                    samples.append(text[:200])
    m = max(1, len(rows))
    return {"rows": len(rows), "parse_rate": ok / m, "valid_format": ok / m, "samples": samples}


# --------------------------------------------------------------------------- the stage
def load_base(model_ref: str, device: str) -> tuple[Any, Any, str]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..models import registry as models

    path = models.fetch_s3(model_ref) if storage.is_s3(model_ref) else (models.resolve(model_ref) or model_ref)
    tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    dtype = torch.float32  # master weights; bf16 autocast on GPU
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
    return model, tok, path


def save_adapter(model: Any, base_ref: str, dest: str) -> None:
    """PEFT adapter in bf16, its base named as the user gave it."""
    import torch
    from safetensors.torch import load_file, save_file

    model.save_pretrained(dest)
    f = os.path.join(dest, "adapter_model.safetensors")
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in load_file(f).items()}, f)
    cfg_path = os.path.join(dest, "adapter_config.json")
    with open(cfg_path) as fh:
        cfg = json.load(fh)
    cfg["base_model_name_or_path"] = base_ref
    with open(cfg_path, "w") as fh:
        json.dump(cfg, fh, indent=2)


@stage("sft", SFTConfig, family="train", gpus=1,
       help="Warm-up fine-tune (LoRA by default): the ranker on prepare-rl rows, or the memory agents on "
            "prepare-agents traces")
def run(config: SFTConfig, out: storage.Publication) -> dict:
    import torch
    from tqdm import tqdm

    from ..training import trainmetrics

    device = config.device if config.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(config.seed)
    source = config.traces or config.data
    if config.traces:
        train_rows = trace_records(config.traces, "train")
        if not train_rows:
            raise InputError("no train trace records (is this a prepare-agents output with traces: true?)",
                             file=config.traces, field="traces")
    else:
        train_rows = read_rows(config.data, "train")
        if not train_rows:
            raise InputError("no train rows (is this a prepare-rl output?)", file=config.data, field="data")
    if config.max_rows:
        train_rows = train_rows[:config.max_rows]
    if config.traces:
        eval_rows = trace_records(config.traces, config.eval_split) if config.eval_split else []
    else:
        eval_rows = read_rows(config.data, config.eval_split) if config.eval_split else []
    split = checked_split(source, train_rows, eval_rows, config.eval_split, bool(config.traces))
    model, tok, path = load_base(config.model, device)
    if config.traces:
        eot = end_of_turn_ids(tok, path)
        gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        eot.update(int(x) for x in (gen_eos if isinstance(gen_eos, list) else [gen_eos]) if x is not None)
        examples = [encode_chat(tok, r["messages"], eot, config.traces) for r in train_rows]
        eval_examples = [encode_chat(tok, r["messages"], eot, config.traces) for r in eval_rows]
    else:
        examples = [labelled(*encode(tok, r, answer_text(target_ids(r, config.target, config.top_k, config.data))))
                    for r in train_rows]
        eval_examples = [labelled(*encode(tok, r, answer_text(target_ids(r, config.target, config.top_k, config.data))))
                         for r in eval_rows]
    longest = max(len(ids) for ids, _ in examples)
    if longest > config.batch_tokens:
        raise InputError(f"a {'record' if config.traces else 'row'} has {longest} tokens, more than "
                         f"batch_tokens={config.batch_tokens}", file=source, field="batch_tokens")
    if config.lora_rank > 0:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=config.lora_rank, lora_alpha=config.lora_alpha,
                                                 target_modules=config.lora_target_modules, lora_dropout=0.0,
                                                 task_type="CAUSAL_LM"))
    params = [p for p in model.parameters() if p.requires_grad]
    n_train = sum(p.numel() for p in params)
    opt = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
    plan = [batches([len(ids) for ids, _ in examples], config.batch_tokens, config.seed + e)
            for e in range(config.epochs)]
    total = sum(len(p) for p in plan)
    warmup = int(config.warmup_ratio * total)
    max_new = 8 * config.top_k + 16
    records: list[dict] = []
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device == "cuda" else torch.autocast("cpu", enabled=False)

    def evaluate(epoch: int, step: int) -> dict:
        if not eval_rows:
            return {}
        t0 = time.time()
        with autocast:
            r = {"epoch": epoch, "step": step, "eval_loss": eval_loss(model, eval_examples, device, config.batch_tokens)}
            if config.eval_generate and config.traces:
                r.update(evaluate_traces(model, tok, eval_rows, device, config.eval_generate))
            elif config.eval_generate:
                r.update(evaluate_rows(model, tok, eval_rows, config.top_k, device, config.eval_generate, max_new))
        r["eval_s"] = round(time.time() - t0, 2)
        if config.traces:
            log.info("sft eval (epoch %d, step %d): loss %.4f, replies that parse %s", epoch, step,
                     r["eval_loss"], r.get("parse_rate"))
        else:
            log.info("sft eval (epoch %d, step %d): loss %.4f, valid format %s, NDCG@10 %s (first stage %s)",
                     epoch, step, r["eval_loss"], r.get("valid_format"), r.get("ndcg@10"), r.get("first_stage_ndcg@10"))
        records.append({"kind": "eval", **{k: v for k, v in r.items() if k != "samples"}})
        return r

    evals = [evaluate(0, 0)]
    step, t_start, tokens = 0, time.time(), 0
    bar = tqdm(total=total, desc="sft", unit="step", disable=None)
    for epoch, order in enumerate(plan, 1):
        model.train()
        for b in order:
            ids, labels, mask = collate([examples[i] for i in b], tok.pad_token_id)
            lr = lr_at(step, total, warmup, config.lr)
            for g in opt.param_groups:
                g["lr"] = lr
            t0 = time.time()
            with autocast:
                loss = model(input_ids=ids.to(device), attention_mask=mask.to(device), labels=labels.to(device)).loss
            loss.backward()
            gn = torch.nn.utils.clip_grad_norm_(params, config.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            tokens += int(mask.sum())
            rec = {"kind": "train", "step": step, "epoch": epoch, "loss": float(loss.detach()), "lr": lr,
                   "grad_norm": float(gn), "rows": len(b), "tokens": int(mask.sum()), "step_s": round(time.time() - t0, 3)}
            records.append(rec)
            bar.update(1)
            bar.set_postfix(loss=f"{rec['loss']:.3f}")
        evals.append(evaluate(epoch, step))
    bar.close()
    train_s = time.time() - t_start
    scratch = tempfile.mkdtemp(prefix="sft-")
    try:
        if config.lora_rank > 0:
            save_adapter(model, config.model, os.path.join(scratch, "adapter"))
            folder = "adapter"
        else:
            model.save_pretrained(os.path.join(scratch, "model"), safe_serialization=True)
            tok.save_pretrained(os.path.join(scratch, "model"))
            folder = "model"
        size = 0
        for root, _, files in os.walk(os.path.join(scratch, folder)):
            for f in sorted(files):
                full = os.path.join(root, f)
                size += os.path.getsize(full)
                out.add_file(os.path.relpath(full, scratch).replace(os.sep, "/"), full)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    out.write_text("metrics.jsonl", "".join(json.dumps(r) + "\n" for r in records))
    out.write_json("eval.json", {"evaluations": [e for e in evals if e]})
    what = "agent traces" if config.traces else f"target {config.target}"
    out.write_bytes("sft_curves.png", trainmetrics.plot_sft(records, f"sft: {config.model}, {what}"))
    first, last = (evals[0] or {}), (evals[-1] or {})
    keys = ("eval_loss", "parse_rate") if config.traces else ("eval_loss", "valid_format", "ndcg@10",
                                                               "first_stage_ndcg@10")
    return {"rows": len(examples), "eval_rows": len(eval_rows), "steps": step, "epochs": config.epochs,
            "trainable_params": n_train, "artifact": folder, "artifact_bytes": size, "train_s": round(train_s, 1),
            "tokens_per_s": round(tokens / max(train_s, 1e-9), 1), "device": device,
            "before": {k: first.get(k) for k in keys}, "after": {k: last.get(k) for k in keys}, "split": split}
