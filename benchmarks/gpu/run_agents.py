#!/usr/bin/env python3
"""The memory agents on one GPU (issue 33 item 4): base → SFT warm start → GRPO, each evaluated on a held-out
split beside the same model answering with no memory, from the first stage, and from the gold sessions.

    source benchmarks/gpu/install.sh
    python3 -m memsifter.runs.detached start benchmarks/gpu/configs/agents.yaml -- \\
        --lme DATA/longmemeval_s_train348.json.gz --locomo DATA/locomo_dev2.json.gz   # detached; then, as often as needed:
    python3 -m memsifter.runs.detached wait benchmarks/gpu/configs/agents.yaml --out "$OUT"   # results.tar.gz, pub.NN

The test data are arguments (any LongMemEval_S-format and LoCoMo-format files). Every step is a ``memsifter``
CLI call against a SeaweedFS started here, as a user runs it:

1. ``run import`` of both files, one combined dataset, its BM25 first stage (``run embed``: no encoder is
   needed on the host) — the memory service's index and the memory agents' chunk order;
2. ``run prepare-agents``: held-out and train splits (disjoint by haystack: one LoCoMo conversation held
   out whole), verl rows and SFT traces; the held-out questions published as their own dataset;
3. ``memsifter serve --no-ray`` (the memory service, loopback, read with a per-run key) and vLLM's GPU server;
4. the phases, in the order ``--phases`` gives them (default ``base,sft,sft-answers,grpo,grpo-answers``):
   ``base``: ``run agents`` (each agent) and ``run chat`` (no memory, gold sessions) on the held-out questions
   with SmolLM2-135M-Instruct; ``sft``: ``run sft`` on the traces (LoRA); ``sft-answers``: ``run agents`` with
   that adapter; ``grpo``: ``run train`` (GRPO through verl's agent loops, the search agent against the service,
   the SFT adapter continued, checkpoints to S3; stopped at ``--train-timeout-s`` keeping its saved steps) and
   ``run collect`` of the last step; ``grpo-answers``: ``run agents`` with that adapter;
5. after each phase ``run evaluate`` of every answers output so far (one table: F1 / EM with 95% intervals,
   cost per question; its plot) and ``pub.NN`` parts of what is published (at most 15 MiB each: what a device
   returns). ``wait`` copies ``results.tar.gz`` (tables, plots, curves, logs) and the parts to ``--out``;
   ``run --published DIR`` on another machine restores the parts and skips the phases they cover, so a run
   longer than one machine's lease continues on the next.

A phase already finished in ``--work`` is skipped on a re-run (the stages' own skip of published outputs).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from run_train import ROOT, ms, sh, verl_steps, write_yaml  # noqa: E402

sys.path.insert(0, ROOT)

RUN = "s3://memsifter/agents"
BASE = "smollm2-135m-instruct"
AGENTS = ["agent:search", "agent:memory"]


def combined(a) -> None:
    """Import both files and publish their union (one memory service holds every question's corpus)."""
    from memsifter.data.model import Dataset, read_dataset
    from memsifter.stage import code_version
    from memsifter.store import storage

    if storage.exists(f"{RUN}/all/_SUCCESS"):
        return
    parts = []
    for fmt, src, name in (("longmemeval", a.lme, "longmemeval_s"), ("locomo", a.locomo, "locomo")):
        if not src:
            continue
        sh(ms("run", "import", "--format", fmt, "--source", src, "--output", f"{RUN}/{name}", "--dataset-name",
              name, "-q"),
           f"{a.out}/import-{name}.log")
        parts.append(read_dataset(f"{RUN}/{name}"))
    sessions, questions = {}, []
    for ds in parts:
        sessions.update(ds.sessions)
        questions += ds.questions
    pub = storage.Publication(f"{RUN}/all", "import", {"derived": "union of the imports"}, "all", code_version())
    pub.publish(Dataset(sessions, questions).write(pub))


def bm25(a, data: str) -> None:
    sh(ms("run", "embed", "--input", data, "--output", f"{data}-embed", "--primary", "bm25", "--no-cascade",
          "--no-zsum", "--no-dense", "--no-chunked", "--no-turns", "-q"), f"{a.out}/embed-{data.rsplit('/', 1)[-1]}.log")


def heldout(a) -> list[str]:
    """The held-out split's questions (prepare-agents' ``split.json``, checked: no question, conversation or session
    text shared with training), published as their own dataset (every stage answers exactly these); the split file
    is copied to ``--out`` (the results keep the split they were measured on)."""
    from memsifter.data import splits
    from memsifter.data.model import read_dataset
    from memsifter.store import storage

    doc = splits.read_split(f"{RUN}/prep")
    ids = doc["splits"]["test"]["question_ids"]
    with open(os.path.join(a.out, "split.json"), "w") as f:
        json.dump(doc, f)
    if not storage.exists(f"{RUN}/heldout/_SUCCESS"):
        publish_questions([read_dataset(f"{RUN}/all")], ids, f"{RUN}/heldout", "prepare-agents test split", doc)
        bm25(a, f"{RUN}/heldout")
    return ids


def publish_questions(datasets: list, ids: list[str], out: str, note: str, split: dict | None = None,
                      split_name: str = "test") -> None:
    """Publish the questions ``ids`` of ``datasets`` (and the sessions their haystacks use) as one dataset. With
    ``split`` (a prepare stage's ``split.json``): the split is checked (:func:`memsifter.data.splits.check`) and
    every id must be a question of its ``split_name`` split, or nothing is published."""
    from memsifter.data import splits
    from memsifter.data.model import Dataset
    from memsifter.stage import code_version
    from memsifter.store import storage

    if split is not None:
        splits.check(split, f"{out} (split)")
        splits.check_rows(split, split_name, enumerate(ids), f"{out} (questions)", "question_id")
    sessions = {k: v for ds in datasets for k, v in ds.sessions.items()}
    keep = set(ids)
    qs = [q for ds in datasets for q in ds.questions if q.question_id in keep]
    missing = keep - {q.question_id for q in qs}
    if missing:
        raise SystemExit(f"{len(missing)} question(s) are in none of the datasets, e.g. {sorted(missing)[:3]}")
    used = {s for q in qs for s in q.haystack_session_ids}
    pub = storage.Publication(out, "import", {"derived": note}, out.rstrip("/").rsplit("/", 1)[-1], code_version())
    pub.publish(Dataset({k: v for k, v in sessions.items() if k in used}, qs).write(pub))


class Server:
    """A background server (own process group), stopped with everything it started."""

    def __init__(self, cmd: list[str], log: str, port: int, path: str = "/healthz", timeout: float = 600,
                 env: dict | None = None):
        import urllib.request

        self.p = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, cwd=ROOT,
                                  start_new_session=True, env={**os.environ, **(env or {})})
        t = time.time()
        while True:
            if self.p.poll() is not None:
                raise SystemExit(f"server exited ({self.p.returncode}): {cmd} (log {log})")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5)
                break
            except Exception:  # noqa: BLE001 - not up yet
                if time.time() - t > timeout:
                    self.stop()
                    raise SystemExit(f"server not ready in {timeout:.0f}s: {cmd} (log {log})")
                time.sleep(3)
        print(f"server up in {time.time() - t:.0f}s: {' '.join(cmd[-6:])}", flush=True)

    def stop(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.p.pid, sig)
                self.p.wait(timeout=30)
                return
            except ProcessLookupError:
                return
            except subprocess.TimeoutExpired:
                continue


def vllm_config(a, model: str, tag: str):
    """The agents' vLLM server on this GPU (memsifter.models.vllm_server, the one launcher) for a model name or
    directory (an adapter directory is merged onto its base first, as the stages load it)."""
    from memsifter.models import registry
    from memsifter.models.vllm_server import VllmServerConfig

    return VllmServerConfig(model=registry.resolve(model), served_name="agent", device="gpu", port=a.llm_port,
                            max_model_len=8192, gpu_memory_utilization=0.3, max_num_seqs=256, timeout_s=600,
                            poll_s=3, log_path=f"{a.out}/vllm-{tag}.log")


def vllm(a, model: str, tag: str):
    """The server of :func:`vllm_config`, started and ready (``.stop()`` stops it)."""
    from memsifter.models.vllm_server import VllmServer

    srv = VllmServer(vllm_config(a, model, tag)).start()
    srv.wait_ready()
    print(f"vLLM server up in {time.time() - srv.t0:.0f}s: {model}", flush=True)
    return srv


def endpoint(a) -> dict:
    return {"base_url": f"http://127.0.0.1:{a.llm_port}/v1", "model": "agent", "api_key_env": None,
            "concurrency": a.concurrency, "timeout_s": 600}


# The memory service is reached with a key, as on Kubernetes (the agents stage and verl's workers read it from
# this variable; the driver makes one per run). Without it every search got HTTP 401.
KEY_ENV = "MEMSIFTER_AGENTS_SEARCH_KEY"


def service_cmd(a) -> list[str]:
    """``memsifter serve`` over the run's index, reading with the run's key only."""
    return ms("serve", "--index", f"{RUN}/all-embed", "--dataset", f"{RUN}/all", "--no-ray", "--port",
              str(a.serve_port), "--workdir", f"{a.work}/serve", "--set", f"auth.keys.{KEY_ENV}.read=['*']")


def agents_config(a, tag: str) -> dict:
    """The agents stage on the held-out questions, with the budgets prepare-agents built the training rows with
    (the memory agent reads at most ``--max-chunks`` sessions: the first stage's top ones of a longer haystack)."""
    memory = {"max_chunks": a.max_chunks}
    return {"input": f"{RUN}/heldout", "embeddings": f"{RUN}/heldout-embed", "output": f"{RUN}/agents-{tag}",
            "methods": a.agents, "endpoint": endpoint(a), "search_url": f"http://127.0.0.1:{a.serve_port}",
            "search_api_key_env": KEY_ENV, "tokenizer": BASE, "max_failed_fraction": 0.02,
            "agent_options": {m: dict(memory) for m in a.agents if m.startswith("agent:memory")}}


def answer_agents(a, tag: str) -> str:
    cfg = agents_config(a, tag)
    sh(ms("run", "agents", "--config", write_yaml(f"{a.work}/agents-{tag}.yaml", cfg)), f"{a.out}/agents-{tag}.log",
       check=False)
    return cfg["output"]


def served_answers(a, model: str, tag: str, ready=None, chat: list[str] | None = None) -> list[str]:
    """The agents' held-out answers with ``model`` (a trained adapter) served by vLLM for the duration (``ready``,
    a threading.Event, is set once the server holds its GPU memory); with ``chat`` (chat baselines, e.g. none and
    random) the same model also answers in one call: from the first stage and each baseline's context (the
    reference rows beside the agent, same weights)."""
    try:
        srv = vllm(a, model, tag)
    finally:
        if ready is not None:
            ready.set()
    try:
        out = [answer_agents(a, tag)]
        if chat:
            out.append(answer_chat(a, tag, chat))
        return out
    finally:
        srv.stop()


def answer_chat(a, tag: str, baselines: list[str] | tuple[str, ...] = ("none", "oracle")) -> str:
    out = f"{RUN}/chat-{tag}"
    cfg = write_yaml(f"{a.work}/chat-{tag}.yaml", {
        "input": f"{RUN}/heldout", "rankings": f"{RUN}/heldout-embed", "output": out,
        "baselines": list(baselines), "endpoint": {**endpoint(a), "temperature": 0.0, "max_tokens": 64},
        "context_tokens": 6144, "max_failed_fraction": 0.02})
    sh(ms("run", "chat", "--config", cfg), f"{a.out}/chat-{tag}.log", check=False)
    return out


def evaluate(a, answers: list[str]) -> list[str]:
    """The side-by-side table of every answers output published so far (run after each phase too, so that a
    run cut short still leaves its table); copied next to the logs."""
    from memsifter.store import storage

    done = [x for x in dict.fromkeys(answers_outputs() + answers)  # a re-run's and restored ones too
            if storage.exists(f"{x}/_SUCCESS")]
    if not done:
        return done
    cfg = write_yaml(f"{a.work}/evaluate.yaml", {"input": f"{RUN}/heldout", "rankings": [f"{RUN}/heldout-embed"],
                                                 "answers": done, "output": f"{RUN}/evaluate"})
    sh(ms("run", "evaluate", "--config", cfg, "--force", "--replace"), f"{a.out}/evaluate.log", check=False)
    if storage.exists(f"{RUN}/evaluate/_SUCCESS"):
        for f in ("report.md", "report.json", "answer_f1_and_cost.png", "answer_f1_by_method.png"):
            if storage.exists(f"{RUN}/evaluate/{f}"):
                storage.copy_file(f"{RUN}/evaluate/{f}", f"{a.out}/{f}")
    return done


PHASES = ("base", "sft", "sft-answers", "grpo", "grpo-answers")
ROUNDS = range(1, 10)  # --grpo-round


def grpo_names(r: int) -> dict[str, str]:
    """The outputs of GRPO round ``r``: round 1 trains from the SFT adapter, round r > 1 (another machine's lease)
    from round r-1's collected adapter with a fresh optimizer; each round's steps count from 1."""
    sfx = "" if r == 1 else f"-r{r}"
    return {"train": f"{RUN}/train{sfx}", "collect": f"{RUN}/collect{sfx}", "answers": f"grpo{sfx}", "suffix": sfx}


def answers_outputs() -> list[str]:
    """Every answers output a run of this driver can publish (evaluated side by side when published)."""
    return ([f"{RUN}/chat-base", f"{RUN}/agents-base", f"{RUN}/chat-sft", f"{RUN}/agents-sft"]
            + [f"{RUN}/agents-{grpo_names(r)['answers']}" for r in ROUNDS])


def grpo_config(a) -> dict:
    """The train stage's config for GRPO on the agent rows: verl's agent loops (the search agent against this
    run's service with its key), the SFT warm start when one is published, LoRA lr 5e-5 as the ranker's DAPO runs."""
    from memsifter.store import storage

    tokens = 32768  # the no-grad log-prob passes
    # the update: rows are padded to prompt + response length (no flash-attn: no padding removal) and SDPA's math
    # kernel keeps a score matrix of that side per head and row: 32,768 tokens per micro-batch without checkpointing
    # took 75 GiB at 8,192-token rows and ran out of memory at the first update (2026-11-26). verl fills a
    # micro-batch by *real* tokens (attention_mask sums), not padded ones, so a micro-batch holds
    # update_tokens / (shortest real row) padded rows: per-layer recomputation, a smaller budget, and for the search
    # agent alone (short first prompts) --max-prompt 1024 (rows of 3,072 instead of 8,192 tokens)
    update_tokens = 16384
    names = grpo_names(a.grpo_round)
    if a.grpo_round == 1:  # the SFT warm start, run here or restored from another machine (--published)
        init = {"init_adapter": f"{RUN}/sft/adapter"} if storage.exists(f"{RUN}/sft/_SUCCESS") else {}
    else:  # the round before's last collected step (restored with --published): its weights, a fresh optimizer
        before = grpo_names(a.grpo_round - 1)["collect"]
        adapter = last_adapter(before) if storage.exists(f"{before}/_SUCCESS") else None
        if adapter is None:
            raise SystemExit(f"--grpo-round {a.grpo_round}: {before} holds no collected adapter (run round "
                             f"{a.grpo_round - 1} first, or restore it with --published)")
        init = {"init_adapter": adapter}
    cfg = {
        "output": names["train"], "data": f"{RUN}/prep", "model": BASE, **init,
        # the reward: (1 - f) x answer F1 + f x format. f = 0.1 (the stage's default) taught the search agent to stop
        # searching in 7 steps (2026-11-27-h100-agents-grpo7): --format-score 0 pays for the answer alone
        "agent": {k: v for k, v in (("format_score", getattr(a, "format_score", None)),
                                     ("evidence_score", getattr(a, "evidence_score", None))) if v is not None},
        "nnodes": 1, "n_gpus_per_node": 1, "experiment_name": "agents",
        "search_url": f"http://127.0.0.1:{a.serve_port}", "search_api_key_env": KEY_ENV,
        "local_dir": f"{a.work}/pod", "keep_local_checkpoints": 1,
        "verl": {
            "data": {"max_prompt_length": a.max_prompt, "max_response_length": a.max_response,
                     "train_batch_size": a.batch, "gen_batch_size": a.batch},
            "algorithm": {"filter_groups": {"enable": False}},
            "actor_rollout_ref": {
                "model": {"lora_rank": 16, "lora_alpha": 32, "enable_gradient_checkpointing": True},
                "actor": {"ppo_mini_batch_size": a.mini_batch or a.batch, "ulysses_sequence_parallel_size": 1,
                          "ppo_max_token_len_per_gpu": update_tokens,
                          "fsdp_config": {"param_offload": False, "optimizer_offload": False},
                          "optim": {"lr": a.lr, "lr_warmup_steps": 0, "weight_decay": 0.0}},
                "ref": {"log_prob_max_token_len_per_gpu": tokens},
                "rollout": {"n": a.n, "tensor_model_parallel_size": 1, "gpu_memory_utilization": 0.4,
                            "enforce_eager": True, "log_prob_max_token_len_per_gpu": tokens}},
            # validation (test_freq > 0): verl's own episodes on the held-out rows (prepare-agents' test split),
            # the held-out reward curve; the paired comparison is the agents stage's answers (sft-/grpo-answers)
            "trainer": {"save_freq": a.save_freq or max(1, a.steps // 2), "test_freq": a.test_freq,
                        "total_training_steps": a.steps, "val_before_train": a.test_freq > 0}},
    }
    if getattr(a, "seed", None) is not None:  # a repeat of a run: verl's data order and vLLM's sampling
        cfg["verl"]["data"]["seed"] = a.seed
        cfg["verl"]["actor_rollout_ref"]["rollout"]["seed"] = a.seed
    return cfg


def run_deadline(cmd: list[str], log: str, seconds: float, after: list[str] | None = None) -> tuple[int | None, float]:
    """``cmd`` in its own process group, stopped after ``seconds`` (then ``after`` runs, e.g. ``ray stop`` for
    the Ray cluster it started): (exit code, or None when stopped; wall seconds). A training run cut this way
    keeps the checkpoints it saved."""
    print(f"\n$ {' '.join(cmd)}   (log: {os.path.basename(log)}, at most {seconds:.0f}s)", flush=True)
    t = time.time()
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
        try:
            rc = p.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            rc = None
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(p.pid, sig)
                    p.wait(timeout=60)
                    break
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    continue
            if after:
                subprocess.run(after, stdout=f, stderr=subprocess.STDOUT, check=False)
    dt = time.time() - t
    print(f"  -> {'stopped at the deadline' if rc is None else f'exit {rc}'} in {dt:.1f}s", flush=True)
    return rc, dt


def last_adapter(collect: str) -> str | None:
    """The highest step's adapter directory of a ``collect`` output (steps by number, not by name)."""
    from memsifter.store import storage

    steps = sorted({int(f.split("/")[0].rsplit("_", 1)[1]) for f in storage.list_files(collect)
                    if f.startswith("global_step_") and f.endswith("adapter/adapter_config.json")})
    return storage.join(collect, f"global_step_{steps[-1]}", "adapter") if steps else None


def phase_grpo(a, notes: list[str]) -> None:
    """GRPO through the train stage (cut at --train-timeout-s, keeping its saved steps), then ``collect`` of the
    last complete step."""
    from memsifter.store import storage

    names = grpo_names(a.grpo_round)
    sfx, train, collect = names["suffix"], names["train"], names["collect"]
    if storage.exists(f"{collect}/_SUCCESS"):
        notes.append(f"grpo{sfx}: collect already published (restored or earlier run): training skipped")
        return
    cfg = write_yaml(f"{a.work}/train{sfx}.yaml", grpo_config(a))
    if a.train_dry_run:  # the composed verl config only (agent loops on: a dry run reads no s3 data)
        sh(ms("run", "train", "--config", cfg, "--dry-run", "--set", "agent.loops=on"), f"{a.out}/train-dry-run.log")
        raise SystemExit(0)
    limit = a.train_timeout_s
    if a.train_stop_at_s:  # a machine's lease ends at a fixed time: stop there, whatever ran before
        limit = min(limit, a.train_stop_at_s - (time.time() - a.started))
    if limit < 300:
        notes.append(f"grpo: skipped, {limit:.0f}s left before --train-stop-at-s (verl alone takes ~3.5 min to start)")
        return
    rc, dt = run_deadline(ms("run", "train", "--config", cfg), f"{a.out}/train{sfx}.log", limit,
                          after=["ray", "stop", "--force"])
    steps = verl_steps(f"{a.out}/train{sfx}.log")
    with open(f"{a.out}/train{sfx}_steps.json", "w") as f:
        json.dump(steps, f, indent=1)
    notes.append(f"train{sfx}: {'stopped at the deadline' if rc is None else f'exit {rc}'} after {dt:.0f}s, "
                 f"{len(steps)} steps logged")
    for f in ("metrics.jsonl", "training_curves.png", "checkpoints.json"):
        src = f"{train}/{f}" if storage.exists(f"{train}/{f}") else f"{train}/_work/{f}"
        if storage.exists(src):
            storage.copy_file(src, f"{a.out}/train{sfx}_{f}")
    from memsifter.stages.collect import available_steps, checkpoint_root

    try:
        done = available_steps(checkpoint_root(train), True)
    except Exception as e:  # noqa: BLE001 - nothing saved: say so, the rest of the run goes on
        notes.append(f"grpo: no checkpoints ({e})")
        done = []
    if not done:
        notes.append("grpo: no complete checkpoint to collect")
        return
    sh(ms("run", "collect", "--checkpoints", train, "--output", collect, "--steps", str(max(done))),
       f"{a.out}/collect{sfx}.log")
    notes.append(f"collect{sfx}: step {max(done)} of {sorted(done)}")


def fill_adapter_base(adapter_dir: str, base: str) -> bool:
    """Name ``base`` in an adapter's ``adapter_config.json`` where it names no base model (``collect`` of a verl LoRA
    checkpoint wrote ``base_model_name_or_path: null`` on 2026-11-27, and the registry refuses to merge such an
    adapter); True when it wrote it."""
    path = os.path.join(adapter_dir, "adapter_config.json")
    with open(path) as f:
        cfg = json.load(f)
    if cfg.get("base_model_name_or_path"):
        return False
    cfg["base_model_name_or_path"] = base
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2)
    return True


def run_phase(a, name: str, answers: list[str], notes: list[str], ready=None) -> None:
    """One phase of ``--phases`` (answers outputs it publishes are appended to ``answers``). ``ready`` (a
    threading.Event) is set once the phase holds what it takes of the GPU: an answers phase when its vLLM server is
    up (two vLLM engines profiling the GPU's memory at the same moment can each count the other's), others at once."""
    from memsifter.store import storage

    if ready is not None and not name.endswith("answers"):
        ready.set()

    if name == "base":
        srv = vllm(a, BASE, "base")
        try:
            answers.append(answer_chat(a, "base"))
            answers.append(answer_agents(a, "base"))
        finally:
            srv.stop()
    elif name == "sft":
        if storage.exists(f"{RUN}/sft/_SUCCESS"):
            notes.append("sft: already published (restored or earlier run)")
            return
        cfg = write_yaml(f"{a.work}/sft.yaml", {
            "model": BASE, "traces": f"{RUN}/prep", "output": f"{RUN}/sft", "lora_rank": 16,
            "lr": 2e-4, "epochs": a.sft_epochs, "batch_tokens": 32768,
            "eval_generate": 0,  # the answers measure it
            **({"seed": a.seed} if getattr(a, "seed", None) is not None else {})})
        sh(ms("run", "sft", "--config", cfg), f"{a.out}/sft.log")
        for f in ("metrics.jsonl", "sft_curves.png", "eval.json"):
            if storage.exists(f"{RUN}/sft/{f}"):
                storage.copy_file(f"{RUN}/sft/{f}", f"{a.out}/sft_{f.replace('sft_', '')}")
    elif name == "sft-answers":
        local = storage.download_dir(f"{RUN}/sft/adapter", f"{a.work}/sft-adapter")
        answers += served_answers(a, local, "sft", ready, a.sft_chat)
    elif name == "grpo":
        phase_grpo(a, notes)
    elif name == "grpo-answers":
        names = grpo_names(a.grpo_round)
        src = last_adapter(names["collect"])
        if src is None:
            notes.append(f"grpo{names['suffix']}-answers: no collected adapter")
            return
        local = storage.download_dir(src, f"{a.work}/{names['answers']}-adapter")
        from memsifter.models import registry

        fill_adapter_base(local, registry.resolve(BASE))
        answers += served_answers(a, local, names["answers"], ready)


def run_group(a, names: list[str], answers: list[str], notes: list[str], phase) -> None:
    """Phases side by side ("sft-answers+grpo": one GPU, two processes), each started once the one before holds its
    share of the GPU (``run_phase``'s ``ready``); a failed one is noted and the others go on. One name: run as is.
    ``phase(name, t0)`` records each one's seconds."""
    import threading

    if len(names) == 1:
        t0 = time.time()
        run_phase(a, names[0], answers, notes)
        phase(names[0], t0)
        return

    def member(name: str, ready: threading.Event) -> None:
        t0 = time.time()
        try:
            run_phase(a, name, answers, notes, ready)
        except BaseException as e:  # noqa: BLE001 - a failed phase is noted, the others go on
            notes.append(f"{name}: failed ({type(e).__name__}: {e})")
        finally:
            ready.set()
        phase(name, t0)

    threads = []
    for n in names:
        ready = threading.Event()
        threads.append(threading.Thread(target=member, args=(n, ready)))
        threads[-1].start()
        ready.wait(900)
    for th in threads:
        th.join()


def main_run(a) -> None:
    a.started = time.time()
    os.makedirs(a.out, exist_ok=True)
    os.makedirs(a.work, exist_ok=True)
    from memsifter.store import storage
    from memsifter.testing.servers import seaweedfs

    times: dict[str, float] = {}
    notes: list[str] = []

    def phase(name: str, t0: float) -> None:
        times[name] = round(time.time() - t0, 1)
        print(f"[{time.strftime('%H:%M:%S')}] {name}: {times[name]}s", flush=True)
        with open(f"{a.out}/agents.md", "w") as f:
            f.write("| phase | seconds |\n|---|---|\n" + "".join(f"| {k} | {v} |\n" for k, v in times.items()))
            f.write("\n" + "\n".join(f"- {n}" for n in notes) + "\n")

    with seaweedfs(workdir=os.path.join(a.work, "weed")) as s3:
        os.environ.update(s3.env())
        storage.ensure_bucket("s3://memsifter/")
        for i, src in enumerate(x for x in (a.published or "").split(",") if x):  # the first one's outputs win
            restore(src, os.path.join(a.work, f"published-{i}"))
        t = time.time()
        combined(a)
        if not storage.exists(f"{RUN}/all-embed/_SUCCESS"):
            bm25(a, f"{RUN}/all")
        prep = write_yaml(f"{a.work}/prepare-agents.yaml", prepare_config(a))
        sh(ms("run", "prepare-agents", "--config", prep), f"{a.out}/prepare-agents.log")
        ids = heldout(a)
        notes.append(f"held-out questions: {len(ids)}; prepare-agents stats: "
                     f"{json.dumps(storage.read_manifest(f'{RUN}/prep').get('stats', {}))[:1500]}")
        phase("data", t)
        import secrets

        os.environ.setdefault(KEY_ENV, secrets.token_urlsafe(24))  # never printed; children inherit it
        service = Server(service_cmd(a), f"{a.out}/serve.log", a.serve_port,
                         # the service scores on the CPU; without this a library it imports (JAX's default
                         # preallocation) took 75% of the GPU's memory, and vLLM could not start
                         env={"CUDA_VISIBLE_DEVICES": "", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"})
        answers: list[str] = []
        try:
            for group in a.phases:  # in the order given: a machine's time goes to what matters first
                run_group(a, group.split("+"), answers, notes, phase)
                evaluate(a, answers)
                pack(a.out, a.pack_data)
        finally:
            service.stop()
        t = time.time()
        notes.append(f"answers published: {evaluate(a, answers)}")
        phase("evaluate", t)
        pack(a.out, a.pack_data)
    print("] done", flush=True)


# what travels between machines: answers, the SFT adapter, each GRPO round's collected adapter (its last step)
PUBLISHED = ("chat-base", "agents-base", "sft", "chat-sft", "agents-sft") + tuple(
    x for r in ROUNDS for x in (grpo_names(r)["collect"].rsplit("/", 1)[1], f"agents-{grpo_names(r)['answers']}"))
# the data phase's outputs (--pack-data): made once on a CPU machine, so that a GPU machine's lease goes to training
DATA = ("all", "all-embed", "prep", "heldout", "heldout-embed")
PART = 15 * 2 ** 20  # the device returns files of at most 16 MiB


def prepare_config(a: argparse.Namespace) -> dict:
    """The prepare-agents config of the data phase: both splits' rows and SFT traces (``--search-traces`` opening
    queries per question for the search agent, ``--search-retry``: searching again when a search missed)."""
    return {"datasets": [f"{RUN}/all"], "embeddings": [f"{RUN}/all-embed"], "output": f"{RUN}/prep",
            "agents": a.agents, "recipe": {"test": json.loads(a.test), "train": json.loads(a.train)},
            "max_chunks": a.max_chunks, "tokenizer": BASE, "search_traces": a.search_traces,
            "search_retry": a.search_retry}


def pack(out: str, data: bool = False) -> list[str]:
    """Everything in PUBLISHED so far (and with ``data`` the data phase's outputs, DATA), as one tar split into
    ``pub.NN`` parts of at most 15 MiB under ``out`` (the parts come back from the machine; ``--published DIR`` of
    the next run joins and restores them)."""
    import glob
    import io
    import tarfile

    from memsifter.store import storage

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name in (DATA if data else ()) + PUBLISHED:
            if not storage.exists(f"{RUN}/{name}/_SUCCESS"):
                continue
            for rel in storage.list_files(f"{RUN}/{name}"):
                if rel.startswith("_work/"):
                    continue  # a stage's scratch (response cache, episode shards): 80% of an answers output
                if name == "sft" and not (rel.startswith("adapter/") or rel in ("_SUCCESS", "_manifest.json")):
                    continue  # the adapter is what the next machine needs
                data = storage.read_bytes(storage.join(f"{RUN}/{name}", rel))
                info = tarfile.TarInfo(f"{name}/{rel}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    for old in glob.glob(os.path.join(out, "pub.[0-9][0-9]")):
        os.remove(old)
    data, parts = buf.getvalue(), []
    for i in range(0, len(data), PART):
        path = os.path.join(out, f"pub.{i // PART:02d}")
        with open(path + ".tmp", "wb") as f:
            f.write(data[i:i + PART])
        os.replace(path + ".tmp", path)
        parts.append(path)
    return parts


def restore(src: str, work: str) -> None:
    """Outputs published on another machine (``pub.NN`` parts in ``src``, or a directory of output folders),
    back into this run's store (never over one already there; each output's marker last)."""
    import glob
    import tarfile

    from memsifter.store import storage

    parts = sorted(glob.glob(os.path.join(src, "pub.[0-9][0-9]")))
    if parts:
        os.makedirs(work, exist_ok=True)
        joined, src = os.path.join(work, "published.tar"), os.path.join(work, "published")
        with open(joined, "wb") as f:
            for p in parts:
                f.write(open(p, "rb").read())
        shutil.rmtree(src, ignore_errors=True)
        with tarfile.open(joined) as tar:
            tar.extractall(src, filter="data")
    for name in DATA + PUBLISHED:
        d = os.path.join(src, name)
        if os.path.isfile(os.path.join(d, "_SUCCESS")) and not storage.exists(f"{RUN}/{name}/_SUCCESS"):
            for rel in sorted(storage.list_files(d), key=lambda r: r == "_SUCCESS"):  # the marker last
                storage.copy_file(os.path.join(d, rel), storage.join(f"{RUN}/{name}", rel))
            print(f"restored {name} from {src}", flush=True)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["run"], help="run here (detached: benchmarks/gpu/configs/agents.yaml)")
    ap.add_argument("--lme", help="a LongMemEval_S-format file (.json or .json.gz)")
    ap.add_argument("--locomo", help="a LoCoMo-format file")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    ap.add_argument("--work", default="/root/gpu-agents")
    ap.add_argument("--phases", default=",".join(PHASES), help=f"run in the order given, of {', '.join(PHASES)} "
                    "(a phase whose output is already published, e.g. restored with --published, is skipped); "
                    "A+B runs A and B side by side, e.g. sft-answers+grpo: the answers while verl starts")
    ap.add_argument("--agents", default=",".join(AGENTS))
    ap.add_argument("--test", default='{"longmemeval_s": 110, "locomo": 150}', help="held-out recipe (JSON)")
    ap.add_argument("--train", default='{"longmemeval_s": 210, "locomo": 200}', help="train recipe (JSON)")
    ap.add_argument("--max-chunks", type=int, default=12)
    ap.add_argument("--search-traces", type=int, default=1, help="prepare-agents: search-agent SFT traces per "
                    "question, each opening with another query (keywords, the question, its halves)")
    ap.add_argument("--search-retry", action="store_true", help="prepare-agents: the search oracle searches again "
                    "while its hits miss the evidence")
    ap.add_argument("--seed", type=int, default=None, help="a repeat under another seed: the SFT stage's, verl's "
                    "data order and vLLM's sampling in GRPO (default: each stage's own)")
    ap.add_argument("--sft-epochs", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--save-freq", type=int, default=0, help="GRPO checkpoint every N steps (default: steps // 2)")
    ap.add_argument("--train-timeout-s", type=float, default=1500,
                    help="stop GRPO after this long and collect its last saved step")
    ap.add_argument("--train-stop-at-s", type=float, default=0,
                    help="stop GRPO at the latest this many seconds after the run started (a machine's lease)")
    ap.add_argument("--lr", type=float, default=5e-5, help="GRPO's LoRA learning rate")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--mini-batch", type=int, default=0,
                    help="GRPO's prompts per optimizer update (default: --batch, one update a step)")
    ap.add_argument("--max-prompt", type=int, default=6144, help="GRPO's max_prompt_length (an episode's first "
                    "prompt; rows are padded to it: 1024 fits the search agent's, the memory agent's need 6144)")
    ap.add_argument("--max-response", type=int, default=2048,
                    help="GRPO's max_response_length (an episode's replies and observations)")
    ap.add_argument("--sft-chat", default="", help="sft-answers: the SFT adapter also answers in one call, from the "
                    "first stage and these chat baselines (e.g. none,random: the reference rows with the same weights)")
    ap.add_argument("--test-freq", type=int, default=-1, help="GRPO: verl validation on the held-out rows every N "
                    "steps and before the first (the held-out reward curve); -1: none")
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--serve-port", type=int, default=8100)
    ap.add_argument("--llm-port", type=int, default=8200)
    ap.add_argument("--published", help="folders (comma-separated) with the pub.NN parts other machines' runs "
                    "returned (answers, adapters; with --pack-data the data phase): restored, their phases skipped, "
                    "evaluated with the rest")
    ap.add_argument("--train-dry-run", action="store_true", help="grpo: print verl's composed config and stop")
    ap.add_argument("--grpo-round", type=int, default=1, choices=list(ROUNDS),
                    help="grpo, grpo-answers: round R > 1 continues from round R-1's collected adapter (restored "
                    "with --published from the machine that ran it; a fresh optimizer) into train-rR, collect-rR, "
                    "agents-grpo-rR; each round's steps count from 1")
    ap.add_argument("--format-score", type=float, default=None,
                    help="GRPO's reward weight f of the format term: (1 - f) x answer F1 + f x well formed "
                    "(default: the train stage's, 0.1)")
    ap.add_argument("--evidence-score", type=float, default=None,
                    help="GRPO's reward weight g of the evidence term: + g x (a search hit was a gold session); "
                    "the answer's weight is then 1 - f - g (default: the train stage's, 0)")
    ap.add_argument("--pack-data", action="store_true",
                    help="the pub.NN parts also carry the data phase's outputs (run it on a CPU machine with "
                    "--phases '' and start the GPU machine's run from them with --published)")
    return ap


def main() -> None:
    ap = build_parser()
    a = ap.parse_args()
    a.agents = [x for x in a.agents.split(",") if x]
    a.phases = [x for x in a.phases.split(",") if x]
    a.sft_chat = [x for x in a.sft_chat.split(",") if x]
    if set(a.sft_chat) - {"none", "oracle", "random"}:
        ap.error(f"--sft-chat: unknown {sorted(set(a.sft_chat) - {'none', 'oracle', 'random'})}; known: none, oracle, "
                 "random")
    unknown = {n for g in a.phases for n in g.split("+")} - set(PHASES)
    if unknown:
        ap.error(f"--phases: unknown {sorted(unknown)}; known: {', '.join(PHASES)} (A+B: side by side)")
    main_run(a)


if __name__ == "__main__":
    main()
