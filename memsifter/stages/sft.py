"""Stage ``sft``: a warm-up fine-tune of the ranker before DAPO (MEMSIFTER.md §6; the original run
started RL from an SFT checkpoint).

Why: a small instruct model (SmolLM2-135M-Instruct) asked for a ranking writes a valid one rarely
(measured in ``benchmarks/gpu/README.md``), so a task or DCG reward is 0 for nearly every rollout and
GRPO's group advantages are 0: RL cannot start. A few hundred supervised examples teach the format and
put the ranker near the first stage, so RL starts from there instead of below random.

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

from pydantic import Field

from ..store import storage
from ..errors import InputError
from ..retrieval.metrics import ndcg
from ..retrieval.rankings import parse_ranking
from ..stage import StageConfig, runtime_field, stage, uri_field

log = logging.getLogger(__name__)


class SFTConfig(StageConfig):
    model: str = Field("smollm2-135m-instruct", description="base ranker: hub id, local dir, s3:// URI or a "
                       "name of `memsifter models list`")
    data: str = uri_field("prepare-rl output (train_*.parquet; its eval split for evaluation)",
                          stage="prepare-rl")
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
    eval_generate: int = Field(64, ge=0, description="eval rows answered greedily for format rate and NDCG")
    device: str = runtime_field("auto", "auto: cuda when available, else cpu")

    def preflight(self) -> None:
        """A base model this machine could not load is one line before anything is read or loaded."""
        from ..models.embedding import check_model_ref

        check_model_ref(self.model, "sft", adapters=True)


# --------------------------------------------------------------------------- data
def split_rows(uri: str, split: str) -> list[dict]:
    manifest = storage.read_manifest(uri)
    names = (manifest.get("stats") or {}).get("files", {}).get(split)
    if names is None:
        names = sorted(f for f in manifest.get("files", {}) if f == f"{split}.parquet"
                       or (split == "train" and f.startswith("train_") and f.endswith(".parquet")))
    rows: list[dict] = []
    for n in names:
        rows.extend(storage.read_parquet(storage.published_file(uri, n)).to_pylist())
    return rows


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
    eos = tokenizer.eos_token_id
    return p_ids, a_ids + ([eos] if eos is not None else [])


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
            width = max(len(p) for p in prompts)
            x = torch.full((len(part), width), pad, dtype=torch.long)
            mask = torch.zeros((len(part), width), dtype=torch.long)
            for i, p in enumerate(prompts):
                x[i, width - len(p):] = torch.tensor(p)
                mask[i, width - len(p):] = 1
            y = model.generate(input_ids=x.to(device), attention_mask=mask.to(device), max_new_tokens=max_new_tokens,
                               do_sample=False, pad_token_id=pad)
            for r, out in zip(part, y):
                info = r["extra_info"]
                n = int(info["n_sessions"])
                gold = [str(g) for g in info["gold_local"]]
                text = tokenizer.decode(out[width:], skip_special_tokens=True)
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
    import torch

    model.eval()
    tot, n = 0.0, 0
    with torch.no_grad():
        for b in batches([len(p) + len(a) for p, a in data], budget, 0):
            ids, labels, mask = collate([data[i] for i in b], 0)
            out = model(input_ids=ids.to(device), attention_mask=mask.to(device), labels=labels.to(device))
            k = int((labels[:, 1:] != -100).sum())
            tot += float(out.loss) * k
            n += k
    return tot / max(1, n)


def collate(items: list[tuple[list[int], list[int]]], pad_id: int) -> tuple[Any, Any, Any]:
    import torch

    width = max(len(p) + len(a) for p, a in items)
    ids = torch.full((len(items), width), pad_id, dtype=torch.long)
    labels = torch.full((len(items), width), -100, dtype=torch.long)
    mask = torch.zeros((len(items), width), dtype=torch.long)
    for r, (p, a) in enumerate(items):
        seq = p + a
        ids[r, :len(seq)] = torch.tensor(seq)
        labels[r, len(p):len(seq)] = torch.tensor(a)
        mask[r, :len(seq)] = 1
    return ids, labels, mask


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
       help="Warm-up fine-tune of the ranker (LoRA by default) on prepare-rl rows: gold-first or first-stage targets")
def run(config: SFTConfig, out: storage.Publication) -> dict:
    import torch
    from tqdm import tqdm

    from ..training import trainmetrics

    device = config.device if config.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(config.seed)
    train_rows = split_rows(config.data, "train")
    if not train_rows:
        raise InputError("no train rows (is this a prepare-rl output?)", file=config.data, field="data")
    if config.max_rows:
        train_rows = train_rows[:config.max_rows]
    eval_rows = split_rows(config.data, config.eval_split) if config.eval_split else []
    model, tok, path = load_base(config.model, device)
    examples = [encode(tok, r, answer_text(target_ids(r, config.target, config.top_k, config.data)))
                for r in train_rows]
    eval_examples = [encode(tok, r, answer_text(target_ids(r, config.target, config.top_k, config.data)))
                     for r in eval_rows]
    longest = max(len(p) + len(a) for p, a in examples)
    if longest > config.batch_tokens:
        raise InputError(f"a row has {longest} tokens, more than batch_tokens={config.batch_tokens}",
                         file=config.data, field="batch_tokens")
    if config.lora_rank > 0:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=config.lora_rank, lora_alpha=config.lora_alpha,
                                                 target_modules=config.lora_target_modules, lora_dropout=0.0,
                                                 task_type="CAUSAL_LM"))
    params = [p for p in model.parameters() if p.requires_grad]
    n_train = sum(p.numel() for p in params)
    opt = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
    plan = [batches([len(p) + len(a) for p, a in examples], config.batch_tokens, config.seed + e)
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
            if config.eval_generate:
                r.update(evaluate_rows(model, tok, eval_rows, config.top_k, device, config.eval_generate, max_new))
        r["eval_s"] = round(time.time() - t0, 2)
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
    out.write_bytes("sft_curves.png", trainmetrics.plot_sft(records, f"sft: {config.model}, target {config.target}"))
    first, last = (evals[0] or {}), (evals[-1] or {})
    return {"rows": len(examples), "eval_rows": len(eval_rows), "steps": step, "epochs": config.epochs,
            "trainable_params": n_train, "artifact": folder, "artifact_bytes": size, "train_s": round(train_s, 1),
            "tokens_per_s": round(tokens / max(train_s, 1e-9), 1), "device": device,
            "before": {k: first.get(k) for k in ("eval_loss", "valid_format", "ndcg@10", "first_stage_ndcg@10")},
            "after": {k: last.get(k) for k in ("eval_loss", "valid_format", "ndcg@10", "first_stage_ndcg@10")}}
