"""The GPU drivers' pure parts (benchmarks/gpu): repeat statistics, the rank roofline, the --full inputs.

CPU only and fast: the drivers' GPU runs are smoke-tested by hand (``--tiny``), not here."""

from __future__ import annotations

import contextlib
import gzip
import importlib
import json
import math
import os
import subprocess
import sys
import tarfile
import time

import pytest
from conftest import REPO, SHARED

sys.path.insert(0, str(REPO / "benchmarks" / "gpu"))
run_embed = importlib.import_module("run_embed")
run_rank = importlib.import_module("run_rank")
prepare_inputs = importlib.import_module("prepare_inputs")


def test_spread_median_and_range():
    assert run_embed.spread([3.0, 1.0, 2.0]) == {"n": 3, "median": 2.0, "min": 1.0, "max": 3.0}
    assert run_embed.spread([4, 1, 3, 2])["median"] == 2.5
    assert run_embed.spread([])["n"] == 0 and math.isnan(run_embed.spread([])["median"])
    assert run_embed.fmt_spread(run_embed.spread([1, 2, 3])) == "2.00 (1.00-3.00)"
    assert run_embed.fmt_spread(run_embed.spread([1.5])) == "1.50"
    assert run_embed.fmt_spread(run_embed.spread([])) == "-"


def test_rate_row_rates_come_from_the_seconds():
    r = run_embed.rate_row("x", [2.0, 4.0, 5.0], texts=100, tokens=1000, flops=8e12, peak=1e12)
    assert r["seconds"] == 4.0 and r["repeats"] == 3
    assert r["texts_s"] == 25.0
    assert r["texts_s_spread"]["min"] == 20.0 and r["texts_s_spread"]["max"] == 50.0  # slowest / fastest run
    assert r["mfu"] == pytest.approx(2.0) and r["mfu_spread"]["max"] == pytest.approx(4.0)
    assert r["mfu_datasheet"] == pytest.approx(8e12 / 4.0 / run_embed.H100_SXM_BF16_DENSE_FLOPS)
    assert run_embed.H100_SXM_BF16_DENSE_FLOPS == 989e12


def test_prefill_flops_of_qwen3_4b():
    from memsifter.models.tiny import QWEN3_4B

    p = run_rank.model_params(QWEN3_4B)
    assert 3.55e9 < p["body"] < 3.7e9  # Qwen3-4B's model card: 3.6B non-embedding parameters
    assert p["q_dim"] == 4096 and p["layers"] == 36
    L = 20480
    want = 2 * p["body"] * L + 4 * 36 * 4096 * L**2 / 2 + 2 * 2560 * 151936
    assert run_rank.prefill_flops(QWEN3_4B, L) == pytest.approx(want)
    # the attention term is quadratic: at 131k tokens it outweighs the linear layers
    big = 131072
    assert 4 * 36 * 4096 * big**2 / 2 > 2 * p["body"] * big
    rf = run_rank.roofline(QWEN3_4B, [L, L], 800e12, new=256)
    assert rf["prefill_ceiling_prompts_s"] == pytest.approx(800e12 / want)
    assert rf["ceiling_with_decode_prompts_s"] < rf["prefill_ceiling_prompts_s"]
    assert rf["mean_tokens"] == L


def test_summarize_reports_start_apart_and_skips_runs_without_time():
    def mk(gen, busy):
        return {"name": "ours", "rc": 0, "gen_s": gen, "busy_s": busy, "status": {"ok": 0, "fallback": 4},
                "tokens": {"prompt_tokens": 400, "generated_tokens": 8}}
    s = run_rank.summarize([mk(100.0, 10.0), mk(90.0, 8.0), mk(120.0, 12.0),
                            {**mk(0.0, None), "gen_s": 0.0}, {"name": "original", "rc": "timeout"}])
    o = s["ours"]
    assert o["runs"] == 3 and o["busy"]["median"] == 10.0 and o["pipeline"]["median"] == 100.0
    assert o["start"] == {"n": 3, "median": 90.0, "min": 82.0, "max": 108.0}
    assert o["prompts_s"] == pytest.approx(0.4) and o["prompts_s_spread"]["max"] == pytest.approx(0.5)
    assert o["failed"] == ["nothing generated: None"]
    assert "busy" not in s["original"]


def test_runs_accumulate_per_workload(tmp_path):
    path = tmp_path / "runs.jsonl"
    k1, k2 = {"workload": "locomo", "prompts": 256}, {"workload": "lme", "prompts": 64}
    path.write_text("\n".join(json.dumps({"name": n, "key": k}) for n, k in
                              [("ours", k1), ("original", k1), ("ours", k2)]) + "\nnot json\n")
    assert [r["name"] for r in run_rank.load_runs(str(path), k1)] == ["ours", "original"]
    assert run_rank.load_runs(str(tmp_path / "none.jsonl"), k1) == []


def _rank_doc(name, busy, hf_full, peak, workload="lme", device="NVIDIA H100 80GB HBM3"):
    args = {"workload": workload, "questions": 4, "history_tokens": 131072, "max_tokens": 256, "tiny": False,
            "work": "/nonexistent"}
    run = {"name": name, "rc": 0, "gen_s": busy + 170.0, "busy_s": busy, "status": {"ok": 0, "fallback": 4},
           "tokens": {"prompt_tokens": 4 * 114000, "generated_tokens": 1024}, "prompt_lengths": [114000] * 4}
    hf = {"name": "hf-generate", "prompts": 2, "batch": 1, "prompt_tokens": 228000, "prompt_lengths": [114000] * 2,
          "full_s": hf_full, "prefill_s": 18.0, "gpu_mib_torch_peak": 30000.0}
    return {"results": [run], "hf": hf, "args": args, "peak": {"peak": peak, "device": device}}


def test_combine_pools_runs_of_two_machines_into_one_table(tmp_path):
    """--combine: ours measured on one machine and the original's settings on the next (a 64-prompt
    LongMemEval run each fills a machine): one table, both HF samples as one row with their spread, the
    stricter roofline (the higher peak), and a refusal to pool different workloads or devices."""
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(_rank_doc("ours", 40.0, 60.0, 780e12)))
    b.write_text(json.dumps(_rank_doc("original", 50.0, 70.0, 790e12)))
    args, results, hf, peak, mcfg = run_rank.combine([str(a), str(b)])
    assert [r["name"] for r in results] == ["ours", "original"] and peak == 790e12
    assert hf["full_s_spread"] == {"n": 2, "median": 65.0, "min": 60.0, "max": 70.0}
    out = tmp_path / "out"
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu" / "run_rank.py"), "--combine", str(a), str(b),
                    "--out", str(out)], check=True, capture_output=True, cwd=REPO)
    text = (out / "rank.md").read_text()
    assert "ours vs original engine settings: 1.25x" in text
    m13 = tmp_path / "m13"
    m13.mkdir()
    (m13 / "rank.json").write_text(a.read_text())
    before = a.read_text()
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu" / "run_rank.py"), "--combine",
                        str(m13 / "rank.json"), str(b), "--out", str(m13)], capture_output=True, text=True, cwd=REPO)
    assert r.returncode != 0 and "would overwrite" in r.stderr
    assert (m13 / "rank.json").read_text() == before and not (m13 / "rank.md").exists()  # 4/40 over 4/50 prompts/s
    assert "65.0 (60.0-70.0)" in text and "at the measured peak 790.00 TFLOP/s" in text
    c = tmp_path / "c.json"
    c.write_text(json.dumps(_rank_doc("original", 50.0, 70.0, 790e12, workload="locomo")))
    with pytest.raises(SystemExit, match="different workloads"):
        run_rank.combine([str(a), str(c)])
    d = tmp_path / "d.json"
    d.write_text(json.dumps(_rank_doc("original", 50.0, 70.0, 790e12, device="NVIDIA H200")))
    with pytest.raises(SystemExit, match="different devices"):
        run_rank.combine([str(a), str(d)])
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"results": [{"rc": 0}], "args": {}, "peak": {}}))
    with pytest.raises(SystemExit, match=r"bad.json: results\[0\]: field 'name' missing"):
        run_rank.combine([str(a), str(bad)])
    with pytest.raises(SystemExit, match="missing.json: not a readable rank.json"):
        run_rank.combine([str(tmp_path / "missing.json")])


def test_chunk_runs_name_their_prefill_chunk(tmp_path):
    assert run_rank.chunk_tokens("chunk16384") == 16384
    with pytest.raises(SystemExit, match="chunkN"):
        run_rank.chunk_tokens("chunkbig")
    with pytest.raises(SystemExit, match="under 256"):
        run_rank.chunk_tokens("chunk8")
    a = tmp_path / "a.json"
    doc = _rank_doc("ours", 40.0, 60.0, 780e12)
    doc["results"].append({**doc["results"][0], "name": "ours-chunk16384", "busy_s": 32.0})
    a.write_text(json.dumps(doc))
    args, results, hf, peak, mcfg = run_rank.combine([str(a)])
    import types
    text = run_rank.table(types.SimpleNamespace(**args), results, hf, peak, mcfg)
    assert "ours-chunk16384 vs ours (vLLM's default chunk): 1.25x" in text


def test_count_lme_sessions_dedupes_by_id(tmp_path):
    items = [{"haystack_session_ids": ["a", "b", "c"]}, {"haystack_session_ids": ["b", "d"]}]
    f = tmp_path / "x.json.gz"
    with gzip.open(f, "wt") as fh:
        json.dump(items, fh)
    assert prepare_inputs.count_lme_sessions(str(f)) == {"questions": 2, "session_refs": 5, "distinct_sessions": 4}


def test_full_inputs_have_ten_thousand_real_sessions(tmp_path):
    """prepare_inputs --full's embed workload: the LongMemEval_S training split, imported by the
    platform, keeps every distinct session (>= 10,000, issue 20) and fits one device call's carry."""
    src = SHARED / "data" / prepare_inputs.LME_TRAIN
    if not src.exists():
        pytest.skip(f"{src} absent")
    raw = prepare_inputs.count_lme_sessions(str(src))
    assert raw["questions"] == 348 and raw["distinct_sessions"] >= 10_000
    out = tmp_path / "full"
    subprocess.run([sys.executable, "-m", "memsifter.cli", "run", "import", "--format", "longmemeval", "--source",
                    str(src), "--output", str(out), "--dataset-name", "lme_train348", "-q"], check=True, cwd=REPO,
                   capture_output=True)
    from memsifter.data.model import read_dataset

    ds = read_dataset(str(out))
    assert len(ds.sessions) == raw["distinct_sessions"] and len(ds.questions) == 348
    assert prepare_inputs.dir_bytes(str(out)) < prepare_inputs.CARRY_LIMIT - 8 * 2**20  # room for the rest
    assert os.path.exists(out / "_SUCCESS")


def test_data_pieces_split_and_join_round_trip(tmp_path, monkeypatch):
    """Inputs over one call's carry travel as pieces (stage.split), recv.sh stages them and
    ``stage.py join`` rebuilds the folder; a damaged piece is refused."""
    import io
    import shutil
    import tarfile

    stage = importlib.import_module("stage")
    src = tmp_path / "full"
    src.mkdir()
    (src / "sessions.parquet").write_bytes(os.urandom(3 * 1024 * 1024 + 17))
    (src / "_SUCCESS").write_text("{}")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as t:
        t.add(src, arcname="full")
    monkeypatch.setattr(stage, "WORK", tmp_path / "work")
    monkeypatch.setattr(stage, "PIECE", 1024 * 1024)
    names = stage.split(buf.getvalue(), "y")
    assert len(names) == 4 and all(json.loads((tmp_path / "work" / n.split("/")[-1] / "piece.json").read_text())
                                   ["bytes"] <= 1024 * 1024 for n in names)
    staged = tmp_path / "staged"
    staged.mkdir()
    for n in names:  # what recv.sh does on the machine
        d = tmp_path / "work" / n.split("/")[-1]
        shutil.copy(d / "piece", staged / d.name)
        shutil.copy(d / "piece.json", staged / f"{d.name}.json")
    env = {**os.environ, "MEMSIFTER_GPU_STAGE": str(staged)}
    script = str(REPO / "benchmarks" / "gpu" / "stage.py")
    r = subprocess.run([sys.executable, script, "join", "y", str(tmp_path / "out")], env=env,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "out" / "full" / "sessions.parquet").read_bytes() == (src / "sessions.parquet").read_bytes()
    piece = (staged / "y01").read_bytes()
    (staged / "y01").write_bytes(bytes([piece[0] ^ 0xFF]) + piece[1:])
    r = subprocess.run([sys.executable, script, "join", "y", str(tmp_path / "out2")], env=env,
                       capture_output=True, text=True)
    assert r.returncode != 0 and "sha256" in r.stderr
    (staged / "y03.json").unlink()
    r = subprocess.run([sys.executable, script, "join", "y", str(tmp_path / "out3")], env=env,
                       capture_output=True, text=True)
    assert r.returncode != 0 and "3 of 4 pieces" in r.stderr


def test_extra_wheels_carry_nltk_and_what_it_needs_beyond_the_host():
    """Issue 44: evaluate's LoCoMo F1 on the GPU host stems with nltk (memsifter.retrieval.benchmark_metrics); the
    host has no nltk, so ``stage.py extra`` (no specs: stage.EXTRA) packs it, pinned, with each of its requirements
    the host lacks (extra wheels install with --no-deps)."""
    import re
    from importlib.metadata import requires, version

    stage = importlib.import_module("stage")
    pins = {stage.norm(s.partition("==")[0]): s.partition("==")[2] for s in stage.EXTRA}
    assert all("==" in s for s in stage.EXTRA), stage.EXTRA
    assert pins.get("nltk") == version("nltk")  # the version this checkout's tests stem with
    assert "nltk" not in set(map(stage.norm, stage.DEVICE_HAS))
    for req in requires("nltk"):
        spec, _, marker = req.partition(";")
        if "extra ==" in marker:
            continue
        name = stage.norm(re.split(r"[<>=!~ \[]", spec.strip())[0])
        assert name in pins or name in set(map(stage.norm, stage.DEVICE_HAS)), f"nltk needs {name}"


# What each FA4 wheel declares (Requires-Dist of the staged wheels, extras and Python < 3.11 markers left out),
# written out here because the tests cannot download: stage.FA4 must cover each, or the host must have it.
FA4_REQUIRES = {
    "flash-attn-4": ["nvidia-cutlass-dsl>=4.6.2", "torch", "einops", "typing_extensions", "apache-tvm-ffi<0.2,>=0.1.11",
                     "torch-c-dlpack-ext", "quack-kernels>=0.5.3"],
    "nvidia-cutlass-dsl": ["nvidia-cutlass-dsl-libs-base==4.8.1", "nvidia-cutlass-dsl-libs-cu12==4.8.1"],
    "nvidia-cutlass-dsl-libs-base": ["typing-extensions>=4.10.0", "cuda-bindings>=12.8", "protobuf>=4.21.12",
                                     "nvidia-cutlass-dsl-libs-core==4.8.1"],
    "nvidia-cutlass-dsl-libs-core": ["typing-extensions>=4.10.0", "cuda-bindings>=12.8", "protobuf>=4.21.12"],
    "nvidia-cutlass-dsl-libs-cu13": ["typing-extensions>=4.10.0", "cuda-bindings>=12.8", "protobuf>=4.21.12",
                                     "nvidia-cutlass-dsl-libs-base==4.8.1"],
    "apache-tvm-ffi": ["typing-extensions>=4.13"],
    "torch-c-dlpack-ext": ["torch"],
    "quack-kernels": ["nvidia-cutlass-dsl>=4.7", "torch", "apache-tvm-ffi<0.2,>=0.1.6", "torch-c-dlpack-ext", "einops"],
}
FA4_INSTEAD = {"nvidia-cutlass-dsl-libs-cu12": "nvidia-cutlass-dsl-libs-cu13"}  # the host's torch is CUDA 13


def test_fa4_group_is_pinned_and_needs_nothing_beyond_the_host():
    """Issue 43: `stage.py extra @fa4` packs FlashAttention-4 (the varlen attention Ulysses runs on where flash-attn
    2 is missing) with everything it needs that the host lacks, pinned (extra wheels install with --no-deps); a
    group name expands, several groups and plain specs pack together, no argument is EXTRA as before."""
    from packaging.requirements import Requirement

    stage = importlib.import_module("stage")
    assert all("==" in s for s in stage.FA4), stage.FA4
    pins = {stage.norm(s.partition("==")[0]): s.partition("==")[2] for s in stage.FA4}
    assert pins["flash-attn-4"] == "4.0.0b36" and pins["nvidia-cutlass-dsl"] == "4.8.1"
    assert stage.extra_specs(["@fa4"]) == stage.FA4
    assert stage.extra_specs([]) == stage.EXTRA == stage.extra_specs(["@agents"])
    both = stage.extra_specs(["@fa4", "@agents", "gguf==0.19.0", "x==1", "@fa4"])
    assert both == stage.FA4 + stage.EXTRA + ["x==1"]
    with pytest.raises(SystemExit, match="@fa4"):
        stage.extra_specs(["@fa5"])
    assert set(FA4_REQUIRES) == set(pins), "a requirement list for each FA4 wheel"
    host = set(map(stage.norm, stage.DEVICE_HAS))
    for wheel, reqs in FA4_REQUIRES.items():
        for text in reqs:
            r = Requirement(text)
            name = stage.norm(r.name)
            if name in FA4_INSTEAD:
                assert FA4_INSTEAD[name] in pins, (wheel, text)
            elif name in pins:
                assert r.specifier.contains(pins[name], prereleases=True), (wheel, text, pins[name])
            else:
                assert name in host, f"{wheel} needs {name}: neither in FA4 nor on the host"


def test_install_sh_puts_what_pth_files_add_on_pythonpath(tmp_path):
    """nvidia-cutlass-dsl puts its `cutlass` on sys.path through a .pth file, which Python reads in site directories
    only, not in the PYTHONPATH entries install.sh installs into: install.sh's lines (pth_paths.py) append the paths
    the .pth files of $SITE and $SITE-extra add; without .pth files, or with a broken one, PYTHONPATH stays as it
    was."""
    lines = (REPO / "benchmarks" / "gpu" / "install.sh").read_text().splitlines()
    start = next(i for i, x in enumerate(lines) if x.startswith("PTH_PATHS="))
    snippet = "\n".join(lines[start:start + 2])
    assert "pth_paths.py \"$SITE\" \"$SITE-extra\"" in snippet and lines[start + 1].startswith("if ")
    assert lines[start - 3].startswith("export PYTHONPATH=")  # after the sites are on PYTHONPATH
    site_dir, extra = tmp_path / "site", tmp_path / "site-extra"
    site_dir.mkdir()
    pkg = extra / "fake_dsl"
    (pkg / "dsl_packages" / "fake_cutlass").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "dsl_packages" / "fake_cutlass" / "__init__.py").write_text("OK = 42\n")
    check = "\n".join([f"cd {REPO}", f"SITE={site_dir}", 'export PYTHONPATH="$SITE:$SITE-extra:/x"', snippet,
                       'echo "PYTHONPATH=$PYTHONPATH"',
                       "python3 -c 'import fake_cutlass; print(\"imported\", fake_cutlass.OK)'"])

    def run():
        return subprocess.run(["bash", "-c", check], capture_output=True, text=True, timeout=60)

    r = run()  # no .pth file: unchanged, and fake_cutlass is not importable
    assert f"PYTHONPATH={site_dir}:{extra}:/x\n" in r.stdout and "imported" not in r.stdout, r.stdout + r.stderr
    (extra / "fake_dsl_packages.pth").write_text(
        "import sys, os, fake_dsl; sys.path.insert(0, os.path.join(fake_dsl.__path__[0], 'dsl_packages'))\n")
    r = run()
    assert r.returncode == 0 and "imported 42" in r.stdout, r.stdout + r.stderr
    assert f"PYTHONPATH={site_dir}:{extra}:/x:{pkg / 'dsl_packages'}\n" in r.stdout
    (site_dir / "broken.pth").write_text("import no_such_module_here\n")
    r = run()  # a broken .pth adds nothing and stops nothing
    assert r.returncode == 0 and "imported 42" in r.stdout, r.stdout + r.stderr
    pth = importlib.import_module("pth_paths")
    assert pth.pth_paths([str(tmp_path / "missing")]) == []


def test_pieces_fit_beside_the_checkout_in_one_call():
    """A piece and the checkout travel together in one device call (64 MiB): 33 MiB pieces stopped fitting once
    the checkout reached 38 MB. The size follows the checkout; a checkout that leaves too little is refused."""
    stage = importlib.import_module("stage")
    now = stage.checkout_bytes()
    assert now > 10 * 2 ** 20   # the shipped adapters alone are ~20 MB
    size = stage.piece_size()
    assert size + now + stage.MARGIN <= stage.CALL and size % 2 ** 20 == 0
    assert stage.piece_size(18 * 10 ** 6) == 40 * 2 ** 20
    assert stage.piece_size(38 * 10 ** 6) == 23 * 2 ** 20
    with pytest.raises(SystemExit, match="leaves"):
        stage.piece_size(55 * 2 ** 20)


def test_ranker_test_datasets_are_named_and_prepared_once(tmp_path):
    """run_ranker.py --test FORMAT:FILE: the dataset name, a clear error for a bad spec, and import +
    first stage run only while the first stage is not published (the CPU prepares, the GPU reuses)."""
    prepare_ranker = importlib.import_module("prepare_ranker")
    assert prepare_ranker.test_name("locomo:/data/locomo-10.json.gz") == ("locomo", "/data/locomo-10.json.gz",
                                                                          "test_locomo_10")
    with pytest.raises(SystemExit, match="FORMAT:FILE"):
        prepare_ranker.test_name("/data/locomo10.json")
    calls = []

    def run(args, name):
        calls.append(name)
        if args[1] == "embed":  # what a published first stage leaves
            out = args[args.index("--output") + 1]
            os.makedirs(out)
            open(os.path.join(out, "_SUCCESS"), "w").close()

    assert prepare_ranker.add_test("longmemeval:/x/lme_test.json", str(tmp_path), run) == "test_lme_test"
    assert calls == ["import-test_lme_test", "embed-test_lme_test"]
    prepare_ranker.add_test("longmemeval:/x/lme_test.json", str(tmp_path), run)
    assert calls == ["import-test_lme_test", "embed-test_lme_test"]  # published: nothing ran again


def test_ranker_train_settings_parse_as_yaml():
    """run_ranker.py --set KEY=VALUE (an A/B of one train setting on one machine, e.g. fast_logprobs=false)."""
    run_ranker = importlib.import_module("run_ranker")
    assert run_ranker.train_setting("fast_logprobs=false") == ("fast_logprobs", False)
    assert run_ranker.train_setting("verl.actor_rollout_ref.rollout.n=4") == ("verl.actor_rollout_ref.rollout.n", 4)
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        run_ranker.train_setting("fast_logprobs")


def test_ranker_listing_orders_name_their_rows_and_rankers(tmp_path, monkeypatch):
    """Issue 34: a phase may name its listing order (``sft@shuffled``); the shuffled listing's rows and rankers
    are kept apart from the first-stage listing's, and each trained ranker is ranked with its own order."""
    run_ranker = importlib.import_module("run_ranker")
    prepare_ranker = importlib.import_module("prepare_ranker")
    assert prepare_ranker.rl_name("first_stage") == "rl" and prepare_ranker.rl_name("shuffled") == "rl-shuffled"
    with pytest.raises(SystemExit, match="history order"):
        prepare_ranker.rl_name("chronological")
    assert run_ranker.phase_order("sft@shuffled", "first_stage") == ("sft", "shuffled")
    assert run_ranker.phase_order("dcg", "shuffled") == ("dcg", "shuffled")
    assert run_ranker.phase_order("dcg@", "first_stage") == ("dcg", "first_stage")
    for bad in ("sft@random", "train"):
        with pytest.raises(SystemExit, match="--phases item"):
            run_ranker.phase_order(bad, "first_stage")
    # adapters on disk decide which rankers the eval phase ranks, and with which listing
    monkeypatch.setattr(run_ranker, "RUNS", str(tmp_path / "runs"))
    monkeypatch.setattr(run_ranker, "STATE", str(tmp_path / "state"))
    assert [r[0] for r in run_ranker.rankers()] == ["base-free", "base-structured"]
    for kind in ("sft", "sft-shuf", "dcg-shuf"):
        d = tmp_path / "runs" / f"adapter-{kind}"
        d.mkdir(parents=True)
        (d / "adapter_config.json").write_text("{}")
    got = {r[0]: (r[1] is not None, r[2], r[3]) for r in run_ranker.rankers()}
    assert got == {"base-free": (False, False, "first_stage"), "base-structured": (False, True, "first_stage"),
                   "sft": (True, False, "first_stage"), "base-free-shuf": (False, False, "shuffled"),
                   "base-structured-shuf": (False, True, "shuffled"), "sft-shuf": (True, False, "shuffled"),
                   "dcg-shuf": (True, False, "shuffled")}


def test_dapo_ab_table_ratios(tmp_path):
    """dapo_ab.py: medians over training steps only (validation-only rows skipped), times as baseline/run."""
    dapo_ab = importlib.import_module("dapo_ab")
    base, run = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    base.write_text("\n".join(json.dumps(r) for r in [{"val-core/x": 0.8}, {"timing_s/step": 60.0, "perf/throughput": 1000.0},
                                                        {"timing_s/step": 70.0, "perf/throughput": 900.0},
                                                        {"timing_s/step": 66.0, "perf/throughput": 950.0}]))
    run.write_text("\n".join(json.dumps(r) for r in [{"timing_s/step": 22.0, "perf/throughput": 2850.0}]))
    text = dapo_ab.table(dapo_ab.steps(str(base)), dapo_ab.steps(str(run)), ("a", "b"))
    assert "| step s | 66.0 (60.0–70.0) | 22.0 (22.0–22.0) | 3.00x faster |" in text
    assert "| tokens/s (whole step) | 950.0 (900.0–1,000.0) | 2,850.0 (2,850.0–2,850.0) | 3.00x |" in text
    assert "(3 steps)" in text and "(1 steps)" in text


def test_collapse_compare_finds_the_guard_stop_from_the_runs_config(tmp_path):
    """collapse_compare.py: the stop step comes from the train stage's collapse_guard with the run's own
    dapo settings (configs/train-<kind>.yaml beside the metrics), not a copy of the bound."""
    cc = importlib.import_module("collapse_compare")
    yaml = pytest.importorskip("yaml")
    run = tmp_path / "m1"
    (run / "configs").mkdir(parents=True)
    # bound: 4 x 8 - 4 = 28 discarded groups
    (run / "configs" / "train-dcg_x.yaml").write_text(yaml.safe_dump(
        {"dapo": {"lr": 5e-5, "max_num_gen_batches": 4, "gen_batch_size": 8, "train_batch_size": 4}}))
    rows = [{"step": 0, "val-aux/memsifter_a/ndcg10/mean@1": 0.9},
            {"step": 1, "training/filter_groups/evicted_samples": 3, "actor/entropy": 0.2, "critic/score/mean": 0.5},
            {"step": 2, "training/filter_groups/evicted_samples": 28, "actor/entropy": 0.1},  # = bound: goes on
            {"step": 3, "training/filter_groups/evicted_samples": 29, "actor/entropy": 0.05}]
    (run / "train_dcg_x_metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    other = tmp_path / "train_y_metrics.jsonl"  # no config beside it: the stage's defaults (10 x 32 - 16 = 304)
    other.write_text(json.dumps({"step": 1, "training/filter_groups/evicted_samples": 29}) + "\n")
    out = tmp_path / "out"
    assert cc.main([f"small={run / 'train_dcg_x_metrics.jsonl'}", f"defaults={other}", "--out", str(out)]) == 0
    text = (out / "collapse.md").read_text()
    assert "| 3 | **29 / 0.050 / - / -: guard stop** | - |" in text
    assert "| 2 | 28 / 0.100 / - / - | - |" in text
    assert "| 1 | 3 / 0.200 / 0.500 / - | 29 / - / - / - |" in text
    assert "past 28 discarded groups (4 x 8 - 4); stopped at step 3; greedy validation NDCG@10" in text
    assert "past 304 discarded groups (10 x 32 - 16); no guard stop" in text
    data = json.loads((out / "collapse.json").read_text())
    assert [d["guard_stop_step"] for d in data] == [3, None]
    assert (out / "collapse.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_collapse_compare_names_the_file_and_line_of_bad_metrics(tmp_path):
    cc = importlib.import_module("collapse_compare")
    bad = tmp_path / "train_z_metrics.jsonl"
    bad.write_text(json.dumps({"step": 1}) + "\n" + json.dumps({"step": "two"}) + "\n")
    with pytest.raises(SystemExit, match=r"train_z_metrics.jsonl: line 2: field 'step'"):
        cc.read_run(f"z={bad}")
    bad.write_text("{not json\n")
    with pytest.raises(SystemExit, match=r"line 1: not JSON"):
        cc.read_run(f"z={bad}")
    with pytest.raises(SystemExit, match="LABEL=METRICS_JSONL"):
        cc.read_run(str(bad))


def test_agents_driver_configs_carry_the_key_and_the_chunk_budget():
    """run_agents.py: the agents stage reads the memory service with the run's key (by variable name) and reads
    at most --max-chunks sessions per memory episode, the budget its training rows were built with (a GPU run
    without them got HTTP 401 on every search and read 25.6 sessions per episode); both validate as the stage's
    own config."""
    import argparse

    from memsifter.stages.agents import AgentsConfig

    run_agents = importlib.import_module("run_agents")
    a = argparse.Namespace(agents=["agent:search", "agent:memory"], max_chunks=8, llm_port=8200, serve_port=8100,
                           concurrency=4, work="/tmp/w")
    cfg = run_agents.agents_config(a, "base")
    assert cfg["search_api_key_env"] == run_agents.KEY_ENV
    assert cfg["agent_options"] == {"agent:memory": {"max_chunks": 8}}
    parsed = AgentsConfig(**cfg)
    assert parsed.agent_options["agent:memory"]["max_chunks"] == 8 and parsed.output.endswith("/agents-base")
    cmd = run_agents.service_cmd(a)
    assert f"auth.keys.{run_agents.KEY_ENV}.read=['*']" in cmd and "--no-ray" in cmd


def test_agents_driver_prepares_several_search_traces_when_asked():
    """run_agents.py --search-traces / --search-retry reach prepare-agents' config, which validates them."""
    from memsifter.stages.prepare_agents import PrepareAgentsConfig

    run_agents = importlib.import_module("run_agents")
    a = run_agents.build_parser().parse_args(["run", "--search-traces", "3", "--search-retry", "--agents", "x"])
    a.agents = ["agent:search"]
    cfg = run_agents.prepare_config(a)
    assert cfg["search_traces"] == 3 and cfg["search_retry"] is True
    parsed = PrepareAgentsConfig(**cfg)
    assert parsed.search_traces == 3 and parsed.search_retry
    d = run_agents.prepare_config(run_agents.build_parser().parse_args(["run"]))
    assert d["search_traces"] == 1 and d["search_retry"] is False


def _published(run: str, name: str, files: dict[str, bytes], done: bool = True) -> None:
    from memsifter.store import storage

    for rel, data in files.items():
        storage.write_bytes(storage.join(f"{run}/{name}", rel), data)
    if done:
        storage.write_bytes(storage.join(f"{run}/{name}", "_SUCCESS"), b"")


def test_agents_driver_packs_what_the_next_machine_needs_in_parts_and_restores_it(tmp_path, monkeypatch):
    """run_agents.py: the outputs a second machine continues from travel as pub.NN parts (the device returns files
    of at most 16 MiB): finished outputs only, the SFT output's adapter only; restore joins the parts and never
    writes over an output the run already has."""
    import os

    from memsifter.store import storage

    run_agents = importlib.import_module("run_agents")
    src = str(tmp_path / "a")
    monkeypatch.setattr(run_agents, "RUN", src)
    monkeypatch.setattr(run_agents, "PART", 1000)
    big = os.urandom(2500)
    _published(src, "agents-sft", {"answers.parquet": big, "_manifest.json": b"{}", "_work/llm-cache/x": b"c" * 9000})
    _published(src, "sft", {"adapter/adapter_model.safetensors": b"w" * 300, "metrics.jsonl": b"m" * 5000})
    _published(src, "collect", {"global_step_8/adapter/adapter_config.json": b"{}",
                                "global_step_10/adapter/adapter_config.json": b"{}"})
    _published(src, "agents-grpo", {"answers.parquet": b"half"}, done=False)
    out = tmp_path / "out"
    out.mkdir()
    (out / "pub.99").write_bytes(b"stale")
    parts = run_agents.pack(str(out))
    assert [os.path.basename(p) for p in parts] == [f"pub.{i:02d}" for i in range(len(parts))] and len(parts) >= 3
    assert all(os.path.getsize(p) <= 1000 for p in parts) and not (out / "pub.99").exists()

    dst = str(tmp_path / "b")
    monkeypatch.setattr(run_agents, "RUN", dst)
    _published(dst, "collect", {"kept.txt": b"mine"})
    run_agents.restore(str(out), str(tmp_path / "work"))
    assert storage.read_bytes(f"{dst}/agents-sft/answers.parquet") == big
    assert storage.exists(f"{dst}/sft/adapter/adapter_model.safetensors")
    assert not storage.exists(f"{dst}/sft/metrics.jsonl")  # not needed on the next machine
    assert not storage.exists(f"{dst}/agents-sft/_work/llm-cache/x")  # a stage's scratch stays behind
    assert not storage.exists(f"{dst}/agents-grpo/answers.parquet")  # unfinished: not packed
    assert sorted(storage.list_files(f"{dst}/collect")) == ["_SUCCESS", "kept.txt"]  # never overwritten
    assert run_agents.last_adapter(src + "/collect").endswith("global_step_10/adapter")  # by number, not name


def test_agents_driver_deadline_stops_the_whole_process_group(tmp_path):
    """run_agents.py: GRPO is cut at --train-timeout-s with every process it started (a Ray cluster's workers
    would otherwise hold the GPU the answers need next)."""
    import os
    import sys
    import time

    run_agents = importlib.import_module("run_agents")
    pidfile = tmp_path / "child.pid"
    code = (f"import subprocess,sys,time; p=subprocess.Popen([sys.executable,'-c','import time; time.sleep(120)']); "
            f"open({str(pidfile)!r},'w').write(str(p.pid)); time.sleep(120)")
    t = time.time()
    rc, dt = run_agents.run_deadline([sys.executable, "-c", code], str(tmp_path / "log"), 3,
                                     after=[sys.executable, "-c", "print('after ran')"])
    assert rc is None and dt < 60 and time.time() - t < 60
    child = int(pidfile.read_text())
    for _ in range(50):
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        raise AssertionError("the grandchild outlived the deadline")
    assert "after ran" in (tmp_path / "log").read_text()
    rc, _ = run_agents.run_deadline([sys.executable, "-c", "raise SystemExit(3)"], str(tmp_path / "log2"), 30)
    assert rc == 3


def test_agents_driver_grpo_config_is_a_valid_train_config(tmp_path, monkeypatch):
    """run_agents.py: the GRPO config validates as the train stage's, continues the SFT adapter once one is
    published, and its verl block's keys are verl's own (the stage's composition check)."""
    import argparse

    from memsifter.stages.train import TrainConfig
    from memsifter.store import storage

    run_agents = importlib.import_module("run_agents")
    monkeypatch.setattr(run_agents, "RUN", str(tmp_path / "run"))
    a = argparse.Namespace(serve_port=8100, work=str(tmp_path), batch=16, n=4, lr=5e-5, steps=8, save_freq=0,
                           mini_batch=0, max_prompt=6144, max_response=2048, test_freq=-1, grpo_round=1)
    cfg = run_agents.grpo_config(a)
    assert "init_adapter" not in cfg and cfg["verl"]["trainer"]["save_freq"] == 4
    storage.write_bytes(str(tmp_path / "run" / "sft" / "_SUCCESS"), b"")
    cfg = run_agents.grpo_config(a)
    assert cfg["init_adapter"].endswith("/sft/adapter")
    parsed = TrainConfig(**cfg)
    assert parsed.search_api_key_env == run_agents.KEY_ENV and parsed.agent.format_score == 0.1
    assert TrainConfig(**run_agents.grpo_config(argparse.Namespace(**{**vars(a), "format_score": 0.0}))
                       ).agent.format_score == 0.0  # --format-score 0: the answer's F1 alone
    both = TrainConfig(**run_agents.grpo_config(argparse.Namespace(**{**vars(a), "format_score": 0.0,
                                                                     "evidence_score": 0.3}))).agent
    assert (both.format_score, both.evidence_score) == (0.0, 0.3)
    assert "seed" not in cfg["verl"]["data"] and "seed" not in cfg["verl"]["actor_rollout_ref"]["rollout"]
    seeded = run_agents.grpo_config(argparse.Namespace(**{**vars(a), "seed": 7}))   # --seed: a repeat of the run
    assert seeded["verl"]["data"]["seed"] == 7 and seeded["verl"]["actor_rollout_ref"]["rollout"]["seed"] == 7
    TrainConfig(**seeded)   # verl's own keys (the stage's composition check)
    # the first GPU update ran out of memory with 4 padded 8k rows per micro-batch and no recomputation
    v = cfg["verl"]
    rows = v["actor_rollout_ref"]["actor"]["ppo_max_token_len_per_gpu"] // (
        v["data"]["max_prompt_length"] + v["data"]["max_response_length"])
    assert rows <= 2 and v["actor_rollout_ref"]["model"]["enable_gradient_checkpointing"] is True


def test_agents_driver_grpo_search_only_sizes_rows_and_validates_on_the_held_out_rows(tmp_path, monkeypatch):
    """run_agents.py: GRPO of the search agent alone pads rows to its short first prompt (--max-prompt), can take
    several optimizer updates a step (--mini-batch) and validates on the held-out rows before training and every
    --test-freq steps (the held-out reward curve); the composed config is still a valid train config. verl fills an
    update micro-batch by real tokens, so a micro-batch of short episodes holds several padded rows: at 3,072-token
    rows that is at most 16,384 / 3,072 rows' worth of score matrices per layer even if every row were full."""
    import argparse

    from memsifter.stages.train import TrainConfig

    run_agents = importlib.import_module("run_agents")
    monkeypatch.setattr(run_agents, "RUN", str(tmp_path / "run"))
    p = run_agents.build_parser()
    a = p.parse_args(["run", "--agents", "agent:search", "--max-prompt", "1024", "--mini-batch", "8",
                      "--test-freq", "2", "--n", "5", "--lr", "1e-4", "--steps", "4", "--save-freq", "1"])
    a.work = str(tmp_path)
    v = run_agents.grpo_config(a)["verl"]
    assert v["data"]["max_prompt_length"] + v["data"]["max_response_length"] == 3072
    assert v["actor_rollout_ref"]["actor"]["ppo_mini_batch_size"] == 8 and v["actor_rollout_ref"]["rollout"]["n"] == 5
    assert v["trainer"]["test_freq"] == 2 and v["trainer"]["val_before_train"] is True
    assert v["trainer"]["save_freq"] == 1 and v["trainer"]["total_training_steps"] == 4
    TrainConfig(**run_agents.grpo_config(a))
    d = run_agents.grpo_config(argparse.Namespace(**{**vars(p.parse_args(["run"])), "work": str(tmp_path)}))["verl"]
    assert d["data"]["max_prompt_length"] == 6144 and d["trainer"]["test_freq"] == -1
    assert d["trainer"]["val_before_train"] is False and d["actor_rollout_ref"]["actor"]["ppo_mini_batch_size"] == 16


def test_agents_driver_runs_a_group_side_by_side_the_second_once_the_first_holds_the_gpu(monkeypatch):
    """run_agents.py --phases sft-answers+grpo: both phases run at once, GRPO (verl) starting only once the answers'
    vLLM server is up (two vLLM engines measuring free GPU memory at the same moment can each count the other's);
    a failure in one is noted and the other still ends. The phases themselves need the GPU: replaced here by
    stand-ins that record when they start and when they report ready."""
    import threading
    import time

    run_agents = importlib.import_module("run_agents")
    log, lock = [], threading.Lock()

    def fake(a, name, answers, notes, ready=None):
        with lock:
            log.append(("start", name))
        if name == "sft-answers":
            time.sleep(0.3)  # the server starting
            with lock:
                log.append(("ready", name))
            ready.set()
            time.sleep(0.3)  # the episodes
            answers.append("agents-sft")
        else:
            ready.set()
            raise RuntimeError("verl failed")

    monkeypatch.setattr(run_agents, "run_phase", fake)
    answers, notes, times = [], [], {}
    run_agents.run_group(None, ["sft-answers", "grpo"], answers, notes, lambda n, t0: times.setdefault(n, t0))
    assert log == [("start", "sft-answers"), ("ready", "sft-answers"), ("start", "grpo")]
    assert answers == ["agents-sft"] and notes == ["grpo: failed (RuntimeError: verl failed)"]
    assert set(times) == {"sft-answers", "grpo"}
    p = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu" / "run_agents.py"), "run", "--phases",
                        "sft,sft-answers+grop"], capture_output=True, text=True)
    assert p.returncode == 2 and "grop" in p.stderr


def test_agents_driver_sft_chat_reference_rows_are_a_valid_chat_config(tmp_path, monkeypatch):
    """run_agents.py --sft-chat none,random: the SFT adapter answers in one call from the first stage, no memory and
    random sessions (the reference rows with the same weights); the config it runs validates as chat's, and an
    unknown baseline is refused when the command line is read."""
    import yaml

    from memsifter.stages.chat import ChatConfig

    run_agents = importlib.import_module("run_agents")
    monkeypatch.setattr(run_agents, "sh", lambda *a, **k: (0, 0.0))
    a = run_agents.build_parser().parse_args(["run", "--sft-chat", "none,random", "--work", str(tmp_path),
                                              "--out", str(tmp_path)])
    out = run_agents.answer_chat(a, "sft", ["none", "random"])
    cfg = ChatConfig(**yaml.safe_load(open(tmp_path / "chat-sft.yaml")))
    assert out.endswith("/chat-sft") and cfg.baselines == ["none", "random"] and cfg.rankings
    p = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu" / "run_agents.py"), "run", "--sft-chat",
                        "none,randm"], capture_output=True, text=True)
    assert p.returncode == 2 and "randm" in p.stderr


def _agent_rows(method: str, f1s: list[float], datasets: list[str], **extra) -> list[dict]:
    return [{"question_id": f"q{i}", "method": method, "dataset": d, "status": "ok", "f1": f, "answer": "x",
             "format_ok": True, "searches": 1, "llm_calls": 2, "prompt_tokens": 100, "completion_tokens": 10,
             "seconds": 1.0, **extra} for i, (f, d) in enumerate(zip(f1s, datasets))]


def test_agents_grpo_table_pairs_the_same_questions_by_dataset_and_metric(tmp_path):
    """agents_grpo_table.py: GRPO − SFT and each agent − the one-call first stage, paired on the questions both
    answered (a failed row is left out, as evaluate counts), overall and per dataset; LoCoMo's F1 only where the
    rows carry it; labels from the three answer files."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    t = importlib.import_module("agents_grpo_table")
    ds = ["longmemeval_s", "locomo", "locomo", "longmemeval_s"]
    (tmp_path / "answers").mkdir()
    sft = _agent_rows("agent:search", [0.0, 0.5, 0.0, 0.2], ds)
    grpo = _agent_rows("agent:search", [0.5, 0.5, 0.25, 0.2], ds)
    grpo[3]["status"] = "failed"
    chat = _agent_rows("embed:bm25", [0.1, 0.1, 0.1, 0.1], ds) + _agent_rows("no memory", [0, 0, 0, 0], ds)
    for name, rows in (("agents-sft", sft), ("agents-grpo", grpo), ("chat-sft", chat)):
        pq.write_table(pa.Table.from_pylist(rows), tmp_path / "answers" / f"{name}.parquet")
    by = t.rows_by_label(str(tmp_path / "answers"))
    assert sorted(by) == ["agent:search, GRPO", "agent:search, SFT", "one call, embed:bm25", "one call, no memory"]
    for rs in by.values():  # evaluate's locomo_scores sets it on LoCoMo rows only
        for r in rs:
            r["locomo_f1"] = r["f1"] if r["dataset"] == "locomo" else None
    rows = {(r["a"], r["b"], r["metric"], r["dataset"]): r for r in t.paired_rows(
        by, [("agent:search, GRPO", "agent:search, SFT"), ("agent:search, SFT", "one call, embed:bm25")])}
    g = rows[("agent:search, GRPO", "agent:search, SFT", "f1", "all")]
    assert g["n"] == 3 and g["diff"] == round((0.5 + 0 + 0.25) / 3, 4) and g["mean_b"] == round(0.5 / 3, 4)
    assert rows[("agent:search, GRPO", "agent:search, SFT", "f1", "longmemeval_s")]["n"] == 1
    lo = rows[("agent:search, GRPO", "agent:search, SFT", "locomo_f1", "locomo")]
    assert lo["n"] == 2 and lo["diff"] == 0.125
    assert rows[("agent:search, SFT", "one call, embed:bm25", "f1", "all")]["n"] == 4
    md = t.markdown(list(rows.values()))
    assert md[2].startswith("| agent:search, GRPO − agent:search, SFT | F1 (SQuAD-style) | all | 3 |")
    ep = t.episodes(by)
    assert len(ep) == 4 and "| agent:search, SFT | 4 | 100.0% | 100.0% | 100.0% | 2.00 |" in ep[2]


def test_agents_grpo_table_counts_gold_sessions_shown_and_how_firm_the_difference_is():
    """agents_grpo_table.py: an episode counts as shown a gold session only when one of its context sessions is
    gold; questions without gold are left out; no-memory rows are not listed; GRPO − SFT is paired on the same
    questions; robustness counts the questions that went up, down or stayed and gives a permutation p in (0, 1]."""
    t = importlib.import_module("agents_grpo_table")
    ds = ["longmemeval_s", "locomo", "locomo", "longmemeval_s"]
    gold = {"q0": ["s1"], "q1": ["s2", "s3"], "q2": ["s9"], "q3": []}
    by = {"agent:search, SFT": _agent_rows("agent:search", [0.0, 0.5, 0.0, 0.2], ds),
          "agent:search, GRPO": _agent_rows("agent:search", [0.5, 0.5, 0.25, 0.0], ds),
          "one call, no memory": _agent_rows("no memory", [0, 0, 0, 0], ds, context_session_ids=[])}
    for r, ctx in zip(by["agent:search, SFT"], (["s0"], ["s3", "s4"], ["s1"], ["s1"])):
        r["context_session_ids"] = ctx
    for r, ctx in zip(by["agent:search, GRPO"], (["s1"], ["s2"], ["s9", "s0"], ["x"])):
        r["context_session_ids"] = ctx
    lines = t.gold_shown(by, gold)
    assert "| agent:search, SFT | all | 3 | 1.33 | 0.333 [" in "\n".join(lines)   # q1 only; q3 has no gold
    assert "| agent:search, GRPO | all | 3 | 1.33 | 1.000 [" in "\n".join(lines)
    assert not any("no memory" in ln for ln in lines)
    assert any(ln.startswith("| agent:search, GRPO − agent:search, SFT | gold session shown | all | 3 | +0.667 [")
               for ln in lines)
    rob = t.robustness(by, flips=2000, seeds=(0, 1), resamples=500)
    row = rob[2].split(" | ")
    assert row[1:4] == ["4", "2 / 1 / 1", f"{(0.5 + 0.25 - 0.2) / 4:+.4f}"] and 0 < float(row[4]) <= 1
    assert rob[0].endswith("500 resamples, seeds 0–1 |") and row[5].count("[") == 2
    by["agent:search, GRPO"][1]["answer"] = " X "
    by["agent:search, GRPO"][2]["answer"] = ""
    spread = t.answer_spread(by)   # answers x, X, (none), x: one distinct answer, 75% of the questions
    assert "| agent:search, GRPO | all | 4 | 1 | 'x' | 75.0% | 25.0% |" in spread
    assert not any("no memory" in ln for ln in spread)


def test_agents_grpo_curves_read_steps_and_the_held_out_points(tmp_path):
    """agents_grpo_curves.py: per-step metrics from train_metrics.jsonl, the step collect took from agents.md, and
    the held-out F1 of the SFT start (step 0) and of that step from the answers."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    c = importlib.import_module("agents_grpo_curves")
    (tmp_path / "answers").mkdir()
    (tmp_path / "train_metrics.jsonl").write_text("\n".join(json.dumps(
        {"step": s, "critic/score/mean": 0.1 * s, "actor/entropy": 4.0 - s}) for s in (1, 2)) + "\n")
    (tmp_path / "agents.md").write_text("| phase | seconds |\n\n- collect: step 2 of [1, 2]\n")
    ds = ["locomo"] * 2
    pq.write_table(pa.Table.from_pylist(_agent_rows("agent:search", [0.0, 0.5], ds)),
                   tmp_path / "answers" / "agents-sft.parquet")
    pq.write_table(pa.Table.from_pylist(_agent_rows("agent:search", [0.5, 0.5], ds)),
                   tmp_path / "answers" / "agents-grpo.parquet")
    assert sorted(c.steps(str(tmp_path))) == [1, 2] and c.steps(str(tmp_path))[2]["actor/entropy"] == 2.0
    assert c.collected_step(str(tmp_path)) == 2
    assert c.heldout_f1(str(tmp_path)) == {"agent:search": {"sft": {"n": 2, "f1": 0.25}, "grpo": {"n": 2, "f1": 0.5}}}


def test_snapshot_freezes_the_commit_whatever_the_working_tree_holds(tmp_path):
    """snapshot.py: the host's copy of the checkout is the commit's content (edited files put back, deleted ones
    restored, files added since the commit removed, untracked ones kept), checked file by file against git's blob
    ids; a file that still differs is named."""
    snapshot = importlib.import_module("snapshot")
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "a.py").write_text("A = 1\n")
    (src / "pkg" / "b.py").write_text("B = 1\n")
    (src / "c.txt").write_text("c\n")
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    for cmd in (["init", "-q"], ["add", "."], ["commit", "-qm", "x"]):
        subprocess.run(["git", *cmd], cwd=src, check=True, env=env)
    (src / "pkg" / "a.py").write_text("A = 'half-done edit'\n")
    (src / "c.txt").unlink()
    (src / "pkg" / "new.py").write_text("N = 1\n")
    subprocess.run(["git", "add", "pkg/new.py"], cwd=src, check=True)
    (src / "scratch.txt").write_text("untracked\n")
    doc = snapshot.pack(str(src))
    assert sorted(doc["restore"]) == ["c.txt", "pkg/a.py"] and doc["remove"] == ["pkg/new.py"]
    dest = tmp_path / "snap"
    snapshot.make(str(dest), str(src))
    assert (dest / "pkg" / "a.py").read_text() == "A = 1\n" and (dest / "c.txt").read_text() == "c\n"
    assert not (dest / "pkg" / "new.py").exists() and (dest / "scratch.txt").exists()
    assert not (dest / ".git").exists() and not (dest / ".gpu").exists()
    assert (src / "pkg" / "a.py").read_text() == "A = 'half-done edit'\n"  # the checkout itself is untouched
    (dest / "pkg" / "b.py").write_text("B = 2\n")
    assert snapshot.verify(str(dest), doc["files"]) == ["pkg/b.py"]


def test_agents_driver_names_the_base_of_a_collected_adapter_that_names_none(tmp_path):
    """run_agents.py: GRPO's collected adapter (verl's LoRA checkpoint through collect) said
    base_model_name_or_path: null and the registry refused to serve it (2026-11-27); the driver names the base it
    trained from, and leaves an adapter that names one as it is."""
    run_agents = importlib.import_module("run_agents")
    cfg = tmp_path / "adapter_config.json"
    cfg.write_text(json.dumps({"peft_type": "LORA", "base_model_name_or_path": None, "r": 16}))
    assert run_agents.fill_adapter_base(str(tmp_path), "/models/base") is True
    assert json.loads(cfg.read_text()) == {"peft_type": "LORA", "base_model_name_or_path": "/models/base", "r": 16}
    assert run_agents.fill_adapter_base(str(tmp_path), "/other") is False
    assert json.loads(cfg.read_text())["base_model_name_or_path"] == "/models/base"


def test_agents_driver_refuses_an_unknown_phase():
    import subprocess
    import sys

    p = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu" / "run_agents.py"), "run", "--phases", "sft,grop"],
                       capture_output=True, text=True)
    assert p.returncode == 2 and "grop" in p.stderr


def test_dapo_4b_update_flops_by_hand():
    """dapo_4b_table.train_flops: 3 forward passes of 2 FLOPs per weight per token (LM head on every position)
    plus causal attention 2 * layers * q_dim * L^2, on a shape small enough to count by hand."""
    t = importlib.import_module("dapo_4b_table")
    shape = dict(hidden_size=4, intermediate_size=8, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=2, vocab_size=10)
    # per layer: q and o 2*4*4, k and v 2*4*2, mlp 3*4*8 = 144; 2 layers = 288; LM head 4*10 = 40
    assert t.train_flops(shape, [3]) == 3 * (2 * (288 + 40) * 3 + 2 * 2 * 4 * 3 * 3)
    assert t.train_flops(shape, [3, 5]) == t.train_flops(shape, [3]) + t.train_flops(shape, [5])
    from memsifter.models.tiny import QWEN3_4B
    # Qwen3-4B: ~4.02B matmul weights with the tied LM head; one 33,024-token row's update is ~1.76 PFLOP
    assert abs(t.train_flops(QWEN3_4B, [33024]) / 1.762e15 - 1) < 0.01


def test_dapo_4b_table_rows_come_from_the_raw_files(tmp_path):
    t = importlib.import_module("dapo_4b_table")
    run = {"tag": "8k", "config": "memsifter/configs/train_4b_8k_1gpu.yaml", "gpus": 1, "batch": 8, "n": 4,
           "exit": 0, "wall_s": 400.0, "steps_logged": 1, "gpu_peak_mib_nvidia_smi": 70000,
           "matmul_peak_flops": 800e12, "device": "NVIDIA H100 80GB HBM3", "dynamic_sampling": False}
    step = {"tag": "8k", "config": run["config"], "step": 1, "prompt_length/mean": 8000.0,
            "response_length/mean": 256.0, "timing_s/step": 90.0, "timing_s/gen": 16.0,
            "timing_s/update_actor": 50.0, "actor/perf/max_memory_allocated_gb": 40.0}
    failed = {**run, "tag": "32k", "config": "memsifter/configs/train_4b_32k_1gpu.yaml", "exit": 1, "steps_logged": 0}
    (tmp_path / "runs.jsonl").write_text(json.dumps(run) + "\n" + json.dumps(failed) + "\n")
    (tmp_path / "steps.jsonl").write_text(json.dumps(step) + "\n")
    runs, steps = t.load(str(tmp_path))
    text, rows = t.table(runs, steps)
    (r,) = rows
    assert r["rows"] == 32 and r["rollout_gen_tok_s"] == 32 * 256 / 16 and r["rollout_prompt_tok_s"] == 8 * 8000 / 16
    flops = t.train_flops(t.QWEN3_4B, [8256.0] * 32)
    assert r["mfu"] == flops / 50.0 / 800e12 and 0 < r["mfu"] < 1 and r["mem_alloc_gb"] == 40.0
    assert f"{100 * r['mfu']:.1f}%" in text and "no step logged (exit 1" in text and "68.4" in text
    assert "random weights" in text and "4.02B" in text


def test_dapo_4b_mfu_counts_every_gpu_and_scaling_compares_like_steps():
    """On g GPUs the update's MFU divides by g peaks; the scaling rows compare each phase with the one-GPU run of
    the same prompt budget, over the steps after the first (warm-up) when a run logged more."""
    t = importlib.import_module("dapo_4b_table")
    base = {"config": "c", "batch": 8, "n": 4, "exit": 0, "wall_s": 1.0, "steps_logged": 2,
            "gpu_peak_mib_nvidia_smi": 1, "matmul_peak_flops": 800e12, "device": "d"}
    step = {"prompt_length/mean": 8000.0, "response_length/mean": 256.0, "timing_s/gen": 10.0}
    one, two = {**base, "tag": "8k", "gpus": 1}, {**base, "tag": "8k", "gpus": 2, "config": "c2"}
    rows = [t.step_row(one, {**step, "step": 1, "timing_s/step": 500.0, "timing_s/update_actor": 400.0}),
            t.step_row(one, {**step, "step": 2, "timing_s/step": 300.0, "timing_s/update_actor": 200.0}),
            t.step_row(two, {**step, "step": 1, "timing_s/step": 999.0, "timing_s/update_actor": 999.0}),
            t.step_row(two, {**step, "step": 2, "timing_s/step": 200.0, "timing_s/update_actor": 50.0})]
    assert rows[3]["mfu"] == rows[3]["update_flops"] / 50.0 / (2 * 800e12)
    assert rows[1]["mfu"] == pytest.approx(rows[3]["mfu"] / 2)  # the same FLOPs: 1 GPU in 200 s, 2 GPUs in 50 s
    (sc,) = t.scaling(rows)
    assert sc["gpus"] == 2 and sc["step_s"] == {"1": 300.0, "2": 200.0, "speedup": 1.5, "efficiency": 0.75}
    assert sc["update_s"]["efficiency"] == 2.0 and sc["gen_s"]["efficiency"] == 0.5
    assert t.device_peaks({"gpu_peak_mib_nvidia_smi": 2048, "gpu_peak_mib_per_gpu": [1024, 2048]}) == "1.0 / 2.0"
    assert t.scaling(rows[:2]) == []  # one GPU only: nothing to compare


def test_gpu_memory_peaks_are_read_for_the_visible_gpus_only():
    """Runs side by side on one host each watch their own GPUs: nvidia-smi lists all, CUDA_VISIBLE_DEVICES picks."""
    rr = importlib.import_module("run_rank")
    m = rr.GpuMem(visible="2,3")
    m.sample("100\n200\n300\n400\n")
    m.sample("900\n100\n350\n10\n")
    assert m.peaks == [350, 400] and m.peak == 400
    everything = rr.GpuMem(visible="")
    everything.sample("5\n7\n")
    assert everything.peaks == [5, 7]


def test_dapo_4b_train_rows_past_8k_keep_their_whole_synthetic_haystacks(tmp_path):
    """The driver's synthetic data (20 questions of 800 sessions): prepare-rl's split lets the split asking for the
    fewest questions choose first and cuts the texts it shows out of the others' haystacks, and synth's fillers
    repeat (333 distinct texts). Past 8k the driver's recipe lets train choose first, so a 64k row has a whole
    haystack to fill its budget from; 8k data (2 test rows first) stays as measured."""
    from memsifter.data import splits
    from memsifter.stages.synth import SynthConfig, generate

    drv = importlib.import_module("run_dapo_4b")
    ds = generate(SynthConfig(output=str(tmp_path / "synth"), questions=20, sessions_per_question=800,
                              turns_per_session=6, seed=0))
    assert drv.rl_recipe(8192, 16) == {"train": {"synth": 16}, "test": {"synth": 2}}
    assert drv.rl_recipe(32768, 2) == {"train": {"synth": 2}, "test": {"synth": 2}}
    assert drv.rl_recipe(65536, 4) == {"train": {"synth": 4}, "test": {"synth": 4}}
    kept = {}
    for prompt, rows in ((8192, 16), (65536, 4)):
        plan = splits.choose(ds.questions, ds.sessions, drv.rl_recipe(prompt, rows), 0)
        assert len(plan.chosen["train"]) == rows
        kept[prompt] = min(len(q.haystack_session_ids) for q in plan.chosen["train"])
    assert kept[65536] == 800 and kept[8192] < 100
    a = drv.resolve(drv.build_parser().parse_args(
        ["run", "--configs", str(REPO / "memsifter" / "configs" / "train_4b_64k_4gpu.yaml")]))
    assert a.questions == 20 and a.steps_each == [2]  # 4 train + 4 test rows


def test_dapo_4b_runs_side_by_side_stop_only_their_own_ray(tmp_path, monkeypatch):
    """With RAY_TMPDIR set the driver stops only the Ray processes under that folder (``ray stop`` would end the
    other runs' clusters on the host); names: the prompt budget, and the GPU count past one."""
    drv = importlib.import_module("run_dapo_4b")
    killed, ran = [], []
    monkeypatch.setattr("memsifter.testing.servers._kill_matching", killed.append)
    monkeypatch.setattr(drv.subprocess, "run", lambda *a, **k: ran.append(a[0]))
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path / "rt"))
    drv.stop_own_ray()
    assert killed == [str(tmp_path / "rt" / "ray")] and ran == []
    monkeypatch.delenv("RAY_TMPDIR")
    drv.stop_own_ray()
    assert ran == [["ray", "stop", "--force"]]
    assert drv.run_tag({"prompt": 8192, "gpus": 1}) == "8k" and drv.run_tag({"prompt": 8192, "gpus": 4}) == "8k-4gpu"


@pytest.mark.parametrize("name,prompt,gpus,tokens_per_micro_batch,offload",
                         [("train_4b_8k_1gpu.yaml", 8192, 1, 33792, True),
                          ("train_4b_32k_1gpu.yaml", 32768, 1, 33024, True),
                          ("train_4b_8k_1gpu_gpu_adam.yaml", 8192, 1, 8448, False),
                          ("train_4b_8k_2gpu.yaml", 8192, 2, 16896, False),
                          ("train_4b_8k_4gpu.yaml", 8192, 4, 16896, False),
                          ("train_4b_8k_1gpu_lora.yaml", 8192, 1, 8448, False),
                          ("train_4b_8k_4gpu_lora.yaml", 8192, 4, 16896, False),
                          ("train_4b_8k_2x2gpu.yaml", 8192, 4, 16896, False),
                          ("train_4b_64k_4gpu.yaml", 65536, 4, 16448, False)])
def test_dapo_4b_example_configs_compose_in_verl_with_the_drivers_settings(name, prompt, gpus, tokens_per_micro_batch,
                                                                           offload, tmp_path, capsys):
    """The committed 4B train configs, with exactly what run_dapo_4b.py adds on the command line, compose and
    validate as verl's config (`memsifter run train --dry-run`): FSDP2 with host offload on one GPU, sharded on
    the GPUs without offload on several, recomputation, no Ulysses and SDPA up to 32k; at 64k Ulysses over the four
    GPUs on a varlen attention (remove padding), one whole row per micro-batch of the update and of the old log-prob
    pass; dynamic sampling on in the file, off only by the driver's flag."""
    import argparse

    import yaml

    from memsifter.cli import main

    drv = importlib.import_module("run_dapo_4b")
    path = str(REPO / "memsifter" / "configs" / name)
    facts = drv.config_facts(path)
    assert facts["prompt"] == prompt and facts["gpus"] == gpus and facts["config"] == f"memsifter/configs/{name}"
    a = argparse.Namespace(work=str(tmp_path), steps=2, set=[], dynamic_sampling=False)
    args = drv.train_args(a, f"{prompt // 1024}k", str(tmp_path / "model"), drv.run_tag(facts))
    assert f"data=s3://memsifter/dapo4b/rl-{prompt // 1024}k" in args
    assert f"output=s3://memsifter/dapo4b/train-{drv.run_tag(facts)}" in args
    assert "verl.algorithm.filter_groups.enable=false" in args
    main(["run", "train", "--config", path, "--dry-run", *args])
    text = capsys.readouterr().out
    cfg = yaml.safe_load(text)
    actor, model = cfg["actor_rollout_ref"]["actor"], cfg["actor_rollout_ref"]["model"]
    assert actor["strategy"] == "fsdp2" and actor["fsdp_config"]["offload_policy"] is offload
    nodes = 2 if "2x2" in name else 1
    assert facts["nodes"] == nodes and cfg["trainer"]["nnodes"] == nodes
    assert cfg["trainer"]["n_gpus_per_node"] * nodes == gpus
    assert actor["ppo_max_token_len_per_gpu"] == tokens_per_micro_batch and actor["use_dynamic_bsz"] is True
    assert model["enable_gradient_checkpointing"] is True
    if prompt <= 32768:
        assert actor["ulysses_sequence_parallel_size"] == 1
        assert model["override_config"]["attn_implementation"] == "sdpa"
    else:  # auto: flash-attn 2 where installed, else flash-attn-4, else (Ulysses) flash_attention_2 with a warning
        sp = actor["ulysses_sequence_parallel_size"]
        assert sp == gpus == 4 and model["use_remove_padding"] is True
        assert model["override_config"]["attn_implementation"] in ("flash_attention_2", "flash_attention_4")
        assert yaml.safe_load(open(path))["verl"]["actor_rollout_ref"]["model"]["override_config"] == \
            {"attn_implementation": "auto"}
        row = prompt + cfg["data"]["max_response_length"]
        rollout = cfg["actor_rollout_ref"]["rollout"]
        # verl packs up to max_token_len_per_gpu x sp tokens before the split, and refuses a longer row
        assert actor["ppo_max_token_len_per_gpu"] * sp == row == rollout["log_prob_max_token_len_per_gpu"] * sp
        assert rollout["max_model_len"] == row and rollout["tensor_model_parallel_size"] == 1
    assert cfg["data"]["max_prompt_length"] == prompt and cfg["trainer"]["total_training_steps"] == 2
    assert cfg["algorithm"]["filter_groups"]["enable"] is False
    assert cfg["actor_rollout_ref"]["rollout"]["mode"] == "async" and cfg["actor_rollout_ref"]["rollout"]["name"] == "vllm"
    file_cfg = yaml.safe_load(open(path))
    assert "filter_groups" not in file_cfg["verl"].get("algorithm", {}), "the file keeps the recipe's dynamic sampling"
    if "lora" in name:  # issue 43 item 5: an adapter of rank 32 on every linear layer, merged for each weight sync
        assert model["lora_rank"] == 32 and model["lora_alpha"] == 64 and model["target_modules"] == "all-linear"
        assert model["lora"]["merge"] is True and cfg["actor_rollout_ref"]["rollout"]["load_format"] == "safetensors"
        assert actor["fsdp_config"]["param_offload"] is False and actor["fsdp_config"]["optimizer_offload"] is False
    else:
        assert model["lora_rank"] == 0


# --- one vLLM launcher, one detached-run helper (issue 45 item 3) ---

GPU_CONFIGS = REPO / "benchmarks" / "gpu" / "configs"


def test_one_vllm_launcher_no_other_module_builds_a_vllm_command_line():
    """memsifter.models.vllm_server is the only place that names vLLM's OpenAI server entrypoint: the tests' and
    the demo's servers (testing/servers.py), `models serve` (registry.py) and the GPU drivers build their argv
    there (before: four launchers, each with its own command line)."""
    entry = "vllm.entrypoints" + ".openai.api_server"  # split: this file does not name it
    found = []
    for root in ("memsifter", "benchmarks", "tests"):
        for path in (REPO / root).rglob("*.py"):
            if "results" in path.parts:
                continue
            if entry in path.read_text(errors="replace"):
                found.append(str(path.relative_to(REPO)))
    assert found == ["memsifter/models/vllm_server.py"]


def test_every_vllm_caller_gets_its_argv_from_the_launcher(monkeypatch, tmp_path):
    """The CPU servers (testing.servers.vllm_server, `models serve`) and the GPU drivers' servers (run_agents,
    run_ranker) start exactly the argv and environment the launcher builds from their config."""
    import argparse

    from memsifter.models import registry, vllm_server
    from memsifter.testing import servers

    started = []

    class Stop(Exception):
        pass

    def popen(cmd, **kw):
        started.append((cmd, kw["env"]))
        raise Stop

    monkeypatch.setattr(vllm_server.subprocess, "Popen", popen)
    with pytest.raises(Stop), servers.vllm_server(str(tmp_path), "tiny", port=4321, extra_args=["--seed", "1"]):
        pass
    cmd, env = started[-1]
    want = vllm_server.VllmServerConfig(model=str(tmp_path), served_name="tiny", port=4321, extra_args=["--seed", "1"])
    assert cmd == vllm_server.argv(want) and env["VLLM_TARGET_DEVICE"] == "cpu"
    assert cmd[cmd.index("--dtype") + 1] == "float32" and cmd[-2:] == ["--seed", "1"]

    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 2048}))
    with pytest.raises(Stop):
        registry.serve(str(tmp_path), "127.0.0.1", 4322, None, "m")
    cmd, _ = started[-1]
    assert cmd[cmd.index("--max-model-len") + 1] == "2048" and cmd[cmd.index("--served-model-name") + 1] == "m"

    run_agents = importlib.import_module("run_agents")
    run_ranker = importlib.import_module("run_ranker")
    monkeypatch.setattr(registry, "resolve", lambda name, s3=False: f"/models/{name}")
    a = argparse.Namespace(llm_port=8200, out=str(tmp_path))
    with pytest.raises(Stop):
        run_agents.vllm(a, "smollm2-135m-instruct", "base")
    cmd, env = started[-1]
    assert cmd == vllm_server.argv(run_agents.vllm_config(a, "smollm2-135m-instruct", "base"))
    assert cmd[cmd.index("--model") + 1] == "/models/smollm2-135m-instruct"
    assert cmd[cmd.index("--gpu-memory-utilization") + 1] == "0.3" and "VLLM_TARGET_DEVICE" not in env
    monkeypatch.setattr(run_ranker, "RES", str(tmp_path))
    with pytest.raises(Stop):
        with run_ranker.served("/m", "ranker", 8300, 0.5, lora=True):
            pass
    cmd, env = started[-1]
    assert cmd == vllm_server.argv(run_ranker.served_config("/m", "ranker", 8300, 0.5, lora=True))
    assert "--enable-lora" in cmd and env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    assert cmd[cmd.index("--dtype") + 1] == "bfloat16"


# A stand-in for vLLM's server (no model here): answers /v1/models on the port it is given, like the real one.
STANDIN_SERVER = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/v1/models" else 404); self.end_headers(); self.wfile.write(b"{}")
    def log_message(self, *a):
        print("GET", self.path, flush=True)
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_vllm_launcher_waits_for_models_logs_and_stops_the_group(monkeypatch, tmp_path):
    """start -> wait_ready (on /v1/models) -> url -> stop: the server's process group is gone after stop, its output
    in log_path; a server that exits before it is ready is an error naming its log. The server is a stand-in
    (a loopback HTTP server answering /v1/models): the real vLLM CPU server is test_models_serve's."""
    import psutil

    from memsifter.models import vllm_server

    monkeypatch.setattr(vllm_server, "argv", lambda cfg, port=None: [sys.executable, "-c", STANDIN_SERVER, str(port)])
    log = tmp_path / "logs" / "server.log"
    srv = vllm_server.VllmServer(vllm_server.VllmServerConfig(model="m", served_name="s", log_path=str(log),
                                                              poll_s=0.1, timeout_s=30)).start()
    url = srv.wait_ready()
    import urllib.request

    assert url == f"http://127.0.0.1:{srv.port}/v1"
    assert urllib.request.urlopen(url + "/models", timeout=5).status == 200
    pid = srv.proc.pid
    srv.stop()
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert "GET /v1/models" in log.read_text()

    monkeypatch.setattr(vllm_server, "argv", lambda cfg, port=None: [sys.executable, "-c", "raise SystemExit(3)"])
    with pytest.raises(RuntimeError, match=r"exited with 3.*server\.log"):
        with vllm_server.serve(vllm_server.VllmServerConfig(model="m", served_name="s", log_path=str(log),
                                                            poll_s=0.1)):
            pass


def _standin(tmp_path, name: str, code: str, **sets) -> "object":
    """A committed run config with its command replaced by a tiny stand-in (the GPU drivers cannot run here) and
    its work folder under tmp_path."""
    from memsifter.runs import detached

    extra = [f"work={tmp_path / 'work'}", "command=['{python}', '-c', " + json.dumps(code) + ", '{dir}']"]
    return detached.load(str(GPU_CONFIGS / name), extra + [f"{k}={v}" for k, v in sets.items()])


def test_committed_gpu_run_configs_start_their_driver_with_arguments_it_accepts():
    """Each committed GPU run config names a driver in benchmarks/gpu and arguments its own parser accepts; its
    run writes into the run folder that `wait` collects from."""
    from memsifter.runs import detached

    drivers = {"dapo_4b.yaml": "run_dapo_4b", "agents.yaml": "run_agents", "multigpu.yaml": "run_multigpu",
               "train.yaml": "run_train", "ranker.yaml": "run_ranker", "rank.yaml": "run_rank",
               "ranker_improve.yaml": "run_ranker", "serve_ranked.yaml": "run_serve_ranked"}
    assert sorted(p.name for p in GPU_CONFIGS.glob("*.yaml")) == sorted(drivers)
    for name, driver in drivers.items():
        cfg = detached.load(str(GPU_CONFIGS / name))
        argv = detached.argv(cfg)
        assert argv[0] == sys.executable and (REPO / argv[1]).is_file() and argv[1].endswith(f"{driver}.py")
        a = importlib.import_module(driver).build_parser().parse_args(argv[2:])
        if driver == "run_ranker":  # its folders come from the environment; `poll` writes what comes back
            assert a.action == "run" and cfg.env["MEMSIFTER_RANKER_WORK"] == "{work}"
            assert set(cfg.env) <= {"MEMSIFTER_RANKER_WORK", "MEMSIFTER_RANKER_DATA"}
            assert detached._subst(cfg, cfg.before_collect[-1]) == os.path.join(cfg.dir, "collected")
            for token in a.phases.split(","):  # every phase is one the driver knows (issue 44: improve@shuffled)
                importlib.import_module(driver).phase_order(token, a.order)
        else:
            assert getattr(a, "what", "run") == "run" and a.out == cfg.dir and a.work == cfg.work
    dapo = detached.load(str(GPU_CONFIGS / "dapo_4b.yaml"))
    for c in importlib.import_module("run_dapo_4b").build_parser().parse_args(detached.argv(dapo)[2:]).configs.split(","):
        assert (REPO / c).is_file(), c


def test_dapo_4b_two_nodes_start_as_raylets_on_their_own_gpus_behind_the_rayjob_entrypoint():
    """Issue 43 item 3: a config of 2 nodes of 2 GPUs runs on a Ray cluster of two raylets on the host (a head and
    a worker, as KubeRay's pods), each seeing only its 2 GPUs, and the train stage behind the entrypoint the RayJob
    runs it with (await-capacity for 2 nodes of 2 GPUs, then exec)."""
    drv = importlib.import_module("run_dapo_4b")
    f = drv.config_facts(str(REPO / "memsifter" / "configs" / "train_4b_8k_2x2gpu.yaml"))
    assert f["nodes"] == 2 and f["gpus"] == 4 and drv.run_tag(f) == "8k-2x2gpu"
    (env0, head), (env1, worker) = drv.ray_node_commands(["4", "5", "6", "7"], 2, 6390)
    assert env0["CUDA_VISIBLE_DEVICES"] == "4,5" and env1["CUDA_VISIBLE_DEVICES"] == "6,7"
    assert head[:3] == ["ray", "start", "--head"] and "--port" in head and "6390" in head
    assert worker[:4] == ["ray", "start", "--address", "127.0.0.1:6390"]
    for argv in (head, worker):
        assert argv[argv.index("--num-gpus") + 1] == "2" and argv[argv.index("--num-cpus") + 1] == "16"
    with pytest.raises(ValueError, match="do not split"):
        drv.ray_node_commands(["0", "1", "2"], 2, 1)
    cmd = drv.train_command("/c.yaml", ["--set", "x=1"], f, keep_output=False)
    i = cmd.index("await-capacity")
    assert cmd[i + 1:i + 5] == ["--nodes", "2", "--gpus-per-node", "2"]
    rest = cmd[cmd.index("--") + 1:]
    assert rest[-6:] == ["run", "train", "--config", "/c.yaml", "--set", "x=1"]
    one = drv.train_command("/c.yaml", [], {**f, "nodes": 1, "gpus": 4}, keep_output=True)
    assert "await-capacity" not in one and one[-1] == "--replace"


@pytest.mark.slow
def test_dapo_4b_two_raylets_form_one_cluster_that_await_capacity_accepts(monkeypatch):
    """The two raylets the driver starts (real `ray start`, logical GPUs here) join one cluster of 2 nodes with 2
    GPUs each: the RayJob's entrypoint (`memsifter k8s await-capacity --nodes 2 --gpus-per-node 2 -- CMD`) finds
    them and execs CMD, which sees both nodes; the driver's stop ends only this cluster's processes."""
    import shutil
    import tempfile

    drv = importlib.import_module("run_dapo_4b")
    tmp_path = tempfile.mkdtemp(prefix="r2", dir="/tmp")  # Ray's socket paths must stay under 108 bytes
    monkeypatch.setenv("RAY_TMPDIR", os.path.join(tmp_path, "rt"))
    os.makedirs(os.path.join(tmp_path, "rt", "ray"))
    monkeypatch.setenv("PATH", os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    try:
        address = drv.start_ray_nodes(["0", "1", "2", "3"], 2)
        probe = ("import ray; ray.init(); ns = [n for n in ray.nodes() if n['Alive']]; "
                 "print('nodes', len(ns), sorted(n['Resources'].get('GPU', 0) for n in ns))")
        cmd = drv.ms("k8s", "await-capacity", "--nodes", "2", "--gpus-per-node", "2", "--timeout", "120",
                     "--poll", "1", "--", sys.executable, "-c", probe)
        p = subprocess.run(cmd, env={**os.environ, "RAY_ADDRESS": address, "RAY_AUTH_MODE": "disabled"},
                           capture_output=True, text=True, timeout=300, cwd=REPO)
        assert p.returncode == 0, p.stderr[-2000:]
        assert "nodes 2 [2.0, 2.0]" in p.stdout
    finally:
        drv.stop_own_ray()
    import psutil

    time.sleep(2)
    left = [q for q in psutil.process_iter(["cmdline"])
            if any(os.path.join(tmp_path, "rt") in c for c in q.info["cmdline"] or [])]
    shutil.rmtree(tmp_path, ignore_errors=True)
    assert not left


def test_committed_layouts_run_configs_on_the_gpus_they_name():
    """Each committed side-by-side layout names a committed run config and arguments its driver accepts; a 4B
    train config asks for no more GPUs than its line names; runs of one layout use disjoint GPUs; the runs started
    beside x4_resize.layout's 2-GPU part (the first two of its GPUs) use none of those, nor those started beside
    x4_nodes_then_resize.layout's or x4_resize_fast.layout's."""
    from memsifter.runs import detached

    drv = importlib.import_module("run_dapo_4b")
    used = {}
    for path in sorted(GPU_CONFIGS.glob("*.layout")):
        lines = [x.split() for x in path.read_text().splitlines() if x.strip() and not x.lstrip().startswith("#")]
        assert lines, path.name
        gpus_of = []
        for name, cfg, gpus, *args in lines:
            assert (REPO / cfg).is_file(), (path.name, cfg)
            ids = [int(g) for g in gpus.split(",")]
            gpus_of.append(set(ids))
            if cfg.endswith("dapo_4b.yaml"):
                base = drv.build_parser().parse_args(detached.argv(detached.load(str(REPO / cfg)))[2:] + args)
                a = drv.resolve(base)
                for c in a.configs:
                    assert os.path.isfile(c), c
                    assert drv.config_facts(c)["gpus"] <= len(ids), (path.name, name, c)
        assert sum(map(len, gpus_of)) == len(set().union(*gpus_of)), f"{path.name}: two runs share a GPU"
        used[path.stem] = (lines, gpus_of)
    for first, beside in [("x4_resize", "x4_after_resize"), ("x4_nodes_then_resize", "x4_tp2_beside_resize"),
                          ("x4_resize_fast", "x4_tp2_beside_resize"), ("x4_resize_fast", "x4_after_resize")]:
        resize_lines, _ = used[first]
        a = drv.resolve(drv.build_parser().parse_args(
            detached.argv(detached.load(str(REPO / resize_lines[0][1])))[2:] + resize_lines[0][3:]))
        last = drv.own_gpus(drv.config_facts(a.configs[-1])["gpus"], resize_lines[0][2])
        assert {int(g) for g in last.split(",")}.isdisjoint(set().union(*used[beside][1])), (first, beside)


def test_a_detached_run_from_a_committed_config_reaches_done_and_is_collected(tmp_path):
    """start -> poll -> wait -> collect, the CLI as a GPU call runs it, from the committed DAPO config (the command
    a tiny stand-in writing the driver's result files): state done, exit 0, the collected files in --out and the
    run folder archived without what the config excludes; a second start clears the last run's result files."""
    from memsifter.runs import detached

    code = ("import json, os, sys, time; d = sys.argv[1]; time.sleep(0.5)\n"
            "open(os.path.join(d, 'steps.jsonl'), 'a').write(json.dumps({'step': 1}) + '\\n')\n"
            "open(os.path.join(d, 'runs.jsonl'), 'a').write(json.dumps({'exit': 0}) + '\\n')\n"
            "print('] done', flush=True)")
    cfg = _standin(tmp_path, "dapo_4b.yaml", code)
    sets = ["--set", f"work={cfg.work}", "--set", f"command={json.dumps(cfg.command)}"]
    cfg_path = str(GPU_CONFIGS / "dapo_4b.yaml")
    out = tmp_path / "out"
    cli = [sys.executable, "-m", "memsifter.runs.detached"]
    r = subprocess.run([*cli, "start", cfg_path, *sets], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert r.returncode == 0, r.stderr
    assert detached.poll(cfg)["state"] in ("starting", "running", "done")
    r = subprocess.run([*cli, "wait", cfg_path, *sets, "--out", str(out), "--max-s", "60", "--poll-s", "0.2"],
                       capture_output=True, text=True, cwd=REPO, timeout=90)
    assert r.returncode == 0, r.stdout + r.stderr
    st = json.loads(r.stdout.strip().splitlines()[-1])
    assert st["state"] == "done" and st["rc"] == 0 and "] done" in r.stdout
    detached.start(cfg)  # again, in-process: the same helper the CLI calls
    assert detached.wait(cfg, str(out), 60, poll_s=0.2)["state"] == "done"
    assert len((out / "steps.jsonl").read_text().splitlines()) == 1, "start clears the last run's rows"
    assert (out / "runs.jsonl").is_file() and "] done" in (out / "driver.log").read_text()
    import tarfile

    with tarfile.open(out / "logs.tar.gz") as tar:
        names = tar.getnames()
    assert "run.json" in names and "steps.jsonl" in names and "driver.log" not in names


def test_a_detached_run_records_failure_death_and_stop(tmp_path):
    """The supervisor records a failing command's exit code (state failed, wait exits 1); a run whose supervisor
    is killed is 'died'; stop ends the command's whole group ('stopped'); a second start while one runs is
    refused; a bad config is one line naming the file and the field, exit 2."""
    import psutil

    from memsifter.runs import detached

    cfg = _standin(tmp_path, "agents.yaml", "print('boom'); raise SystemExit(5)")
    detached.start(cfg)
    st = detached.wait(cfg, str(tmp_path / "out"), 30, poll_s=0.1)
    assert st["state"] == "failed" and st["rc"] == 5 and (tmp_path / "out" / "results.tar.gz").is_file()

    cfg = _standin(tmp_path, "agents.yaml", "import time; time.sleep(60)")
    detached.start(cfg)
    with pytest.raises(SystemExit, match="still going"):
        detached.start(cfg)
    t = time.time()
    while detached.poll(cfg).get("command_pid") is None and time.time() - t < 20:
        time.sleep(0.1)
    child = detached.poll(cfg)["command_pid"]
    st = detached.stop(cfg, grace_s=10)
    assert st["state"] == "stopped"
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE

    detached.start(cfg)
    os.kill(int((tmp_path / "work" / "detached" / "pid").read_text()), 9)
    t = time.time()
    while detached.poll(cfg)["state"] != "died" and time.time() - t < 10:
        time.sleep(0.1)
    assert detached.poll(cfg)["state"] == "died"
    assert detached.wait(cfg, None, 1)["state"] == "died"
    with contextlib.suppress(Exception):  # the orphaned stand-in (its supervisor was killed above)
        os.kill(detached.poll(cfg)["command_pid"], 9)

    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nwork: /tmp/x\ncommand: []\n")
    r = subprocess.run([sys.executable, "-m", "memsifter.runs.detached", "poll", str(bad)], capture_output=True,
                       text=True, cwd=REPO, timeout=60)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and f"{bad}: command:" in r.stderr
    r = subprocess.run([sys.executable, "-m", "memsifter.runs.detached", "wait", str(GPU_CONFIGS / "train.yaml"),
                        "--set", f"work={tmp_path / 'never'}", "--max-s", "0"], capture_output=True, text=True,
                       cwd=REPO, timeout=60)
    assert r.returncode == 1 and json.loads(r.stdout.strip().splitlines()[-1])["state"] == "none"


def test_the_ranker_run_brings_back_what_its_driver_polls_into_the_run_folder(tmp_path):
    """The committed ranker config: the command sees its work folder through the environment ({work}
    substituted), and `wait` first runs the real `run_ranker.py poll` (before_collect), then brings back its
    ranker.tgz, status.json and table.md. The command is a stand-in writing what the ranker's run writes."""
    import tarfile

    from memsifter.runs import detached

    code = ("import json, os; r = os.path.join(os.environ['MEMSIFTER_RANKER_WORK'], 'results'); os.makedirs(r)\n"
            "json.dump({'state': 'finished'}, open(os.path.join(r, 'status.json'), 'w'))\n"
            "open(os.path.join(r, 'table.md'), 'w').write('| ranker | ndcg |')")
    cfg = _standin(tmp_path, "ranker.yaml", code)
    detached.start(cfg)
    st = detached.wait(cfg, str(tmp_path / "out"), 60, poll_s=0.2)
    assert st["state"] == "done", (tmp_path / "work" / "detached" / "driver.log").read_text()
    out = tmp_path / "out"
    assert json.loads((out / "status.json").read_text())["state"] == "finished"
    assert (out / "table.md").read_text() == "| ranker | ndcg |"
    with tarfile.open(out / "ranker.tgz") as tar:
        assert "results/table.md" in tar.getnames()


def test_side_by_side_runs_get_their_own_gpus_ray_folder_and_work(tmp_path):
    """side_by_side.sh starts each run of a layout through the detached helper with its own CUDA_VISIBLE_DEVICES,
    RAY_TMPDIR (made, with Ray's folder in it) and work folder, waits for all, and brings each back as one file."""
    cfg = tmp_path / "echo.yaml"
    cfg.write_text(
        "name: echo\nwork: /nonexistent\n"
        "command: [\"{python}\", \"-c\", \"import os,sys,json; json.dump({k: os.environ.get(k) for k in "
        "('CUDA_VISIBLE_DEVICES','RAY_TMPDIR')} | {'argv': sys.argv[1:], 'ray_dir': os.path.isdir(os.environ['RAY_TMPDIR'] + '/ray')}, "
        "open('{dir}/seen.json','w'))\"]\n"
        "collect: [seen.json]\narchive: null\n")
    layout = tmp_path / "two.layout"
    layout.write_text(f"# a comment\na  {cfg}  0,1  --x 1\n\nb  {cfg}  3\n")
    env = {**os.environ, "SBS_ROOT": str(tmp_path / "root"), "PYTHON": sys.executable, "PYTHONPATH": str(REPO)}
    script = str(REPO / "benchmarks" / "gpu" / "side_by_side.sh")
    out = tmp_path / "out"
    out.mkdir()
    for args in (["start"], ["wait", "60"], ["collect", str(out)]):
        p = subprocess.run(["bash", script, args[0], str(layout), *args[1:]], env=env, capture_output=True, text=True,
                           cwd=REPO, timeout=120)
        assert p.returncode == 0, p.stderr
    assert "collected a" in p.stdout and "collected b" in p.stdout
    p = subprocess.run(["bash", script, "poll", str(layout)], env=env, capture_output=True, text=True, cwd=REPO,
                       timeout=120)
    assert p.returncode == 0 and p.stdout.splitlines()[0].startswith("a: done exit 0 "), p.stdout + p.stderr
    seen = {}
    for name in ("a", "b"):
        with tarfile.open(out / f"{name}.tgz") as t:
            seen[name] = json.load(t.extractfile(f"{name}/seen.json"))
    root = tmp_path / "root"
    assert seen["a"] == {"CUDA_VISIBLE_DEVICES": "0,1", "RAY_TMPDIR": f"{root}/rt-a", "argv": ["--x", "1"], "ray_dir": True}
    assert seen["b"] == {"CUDA_VISIBLE_DEVICES": "3", "RAY_TMPDIR": f"{root}/rt-b", "argv": [], "ray_dir": True}
    assert (root / "sbs-a" / "detached" / "run.json").exists() and (root / "sbs-b" / "detached" / "run.json").exists()


def test_dapo_4b_table_reads_side_by_side_runs_and_an_unfinished_one(tmp_path):
    """A results folder of runs side by side (one sub-folder each, named after the run) gives rows named by run;
    a run collected before its driver ended counts from its train log, with no exit; scaling compares each
    multi-GPU run with each one-GPU run of the same prompt budget."""
    import shutil

    t = importlib.import_module("dapo_4b_table")
    base = {"config": "memsifter/configs/train_4b_8k_1gpu.yaml", "prompt": 8192, "response": 256, "batch": 8, "n": 4,
            "gpus": 1, "tag": "8k", "exit": 0, "wall_s": 300.0, "steps_logged": 2, "gpu_peak_mib_nvidia_smi": 70000,
            "matmul_peak_flops": 800e12, "device": "H100", "dynamic_sampling": False}
    step = {"prompt_length/mean": 7000.0, "response_length/mean": 256.0, "timing_s/gen": 10.0}
    for name, gpus, cfg, upd in (("one", 1, "train_4b_8k_1gpu.yaml", 40.0), ("two", 2, "train_4b_8k_2gpu.yaml", 25.0)):
        d = tmp_path / name
        d.mkdir()
        run = {**base, "gpus": gpus, "config": f"memsifter/configs/{cfg}"}
        (d / "runs.jsonl").write_text(json.dumps(run) + "\n")
        (d / "steps.jsonl").write_text("".join(json.dumps({**step, "tag": "8k", "config": run["config"], "step": i,
                                                           "timing_s/step": 2 * upd, "timing_s/update_actor": upd}) + "\n"
                                               for i in (1, 2)))
    late = tmp_path / "late"
    late.mkdir()
    argv = ["python3", "benchmarks/gpu/run_dapo_4b.py", "run", "--out", "/x", "--work", "/w", "--configs",
            "memsifter/configs/train_4b_8k_1gpu.yaml", "--steps", "2", "--set", "verl.actor_rollout_ref.actor.x=1"]
    (late / "run.json").write_text(json.dumps({"argv": argv, "env": {"CUDA_VISIBLE_DEVICES": "3"}, "state": "running"}))
    (late / "driver.log").write_text("model ready\nmatmul peak 790.5 TFLOP/s on NVIDIA H100 80GB HBM3\n")
    (late / "train-8k.log").write_text("(TaskRunner pid=1) step:1 - timing_s/step:100.0 - timing_s/update_actor:80.0 - "
                                       "timing_s/gen:10.0 - prompt_length/mean:7000.0 - response_length/mean:256.0\n")
    runs, steps = t.load(str(tmp_path))
    assert sorted(r["run"] for r in runs) == ["late", "one", "two"] and len(steps) == 5
    (lr,) = [r for r in runs if r["run"] == "late"]
    assert lr["exit"] is None and lr["matmul_peak_flops"] == 790.5e12 and lr["cuda_visible_devices"] == "3"
    assert lr["overrides"] == ["--set", "verl.actor_rollout_ref.actor.x=1"] and lr["steps_logged"] == 1
    text, rows = t.table(runs, steps)
    assert "8k (late)" in text and "**not finished**" in text and "`verl.actor_rollout_ref.actor.x=1`" in text
    sc = {(r["run"], r["base"]): r for r in t.scaling(rows)}
    assert set(sc) == {("two", "one"), ("two", "late")}
    assert sc[("two", "one")]["update_s"]["efficiency"] == 40.0 / (2 * 25.0)
    assert sc[("two", "late")]["update_s"]["1"] == 80.0  # its only step
    assert "8k: two vs one" in text
    c = {r["run"]: r for r in t.cost(runs, rows)}
    assert c["8k (two)"]["step_s"] == 50.0 and c["8k (two)"]["gpu_hours"] == 100 * 50.0 * 2 / 3600
    assert c["8k (one)"]["start_s"] == 300.0 - 160.0 and c["8k (late)"]["start_s"] is None
    t.plot(runs, rows, str(tmp_path / "steps.png"))
    assert (tmp_path / "steps.png").stat().st_size > 0
    shutil.rmtree(late)


def test_dapo_4b_table_a_resumed_run_and_a_checkpoint(tmp_path):
    """A run resumed at another GPU count logs steps 3-4: its warm-up is its own first step (3), not step 1; a
    checkpoint verl saved inside a step is left out of the step's seconds and shown beside them."""
    t = importlib.import_module("dapo_4b_table")
    base = {"prompt": 8192, "response": 256, "batch": 8, "n": 4, "tag": "8k", "exit": 0, "wall_s": 900.0,
            "steps_logged": 2, "gpu_peak_mib_nvidia_smi": 70000, "matmul_peak_flops": 800e12, "device": "H100",
            "dynamic_sampling": False, "run": "resize"}
    four = {**base, "gpus": 4, "config": "memsifter/configs/train_4b_8k_4gpu.yaml"}
    two = {**base, "gpus": 2, "config": "memsifter/configs/train_4b_8k_2gpu.yaml"}
    one = {**base, "gpus": 1, "config": "memsifter/configs/train_4b_8k_1gpu_gpu_adam.yaml", "run": "scale1"}
    step = {"prompt_length/mean": 7000.0, "response_length/mean": 256.0, "timing_s/gen": 10.0, "tag": "8k",
            "timing_s/update_actor": 20.0}
    steps = [{**step, "config": four["config"], "run": "resize", "step": 1, "timing_s/step": 90.0},
             {**step, "config": four["config"], "run": "resize", "step": 2, "timing_s/step": 70.0,
              "timing_s/save_checkpoint": 40.0},
             {**step, "config": two["config"], "run": "resize", "step": 3, "timing_s/step": 200.0},
             {**step, "config": two["config"], "run": "resize", "step": 4, "timing_s/step": 45.0,
              "timing_s/save_checkpoint": 5.0},
             {**step, "config": one["config"], "run": "scale1", "step": 1, "timing_s/step": 150.0},
             {**step, "config": one["config"], "run": "scale1", "step": 2, "timing_s/step": 60.0}]
    text, rows = t.table([four, two, one], steps)
    by = {(r["gpus"], r["step"]): r for r in rows}
    assert by[(4, 2)]["step_s"] == 30.0 and by[(4, 2)]["checkpoint_s"] == 40.0 and by[(4, 1)]["step_s"] == 90.0
    assert "| 30.0 (+ 40.0 checkpoint) |" in text
    sc = {r["gpus"]: r for r in t.scaling(rows)}
    assert sc[2]["step_s"]["2"] == 40.0, "step 3 is the resumed run's warm-up; step 4 less its checkpoint"
    assert sc[4]["step_s"]["efficiency"] == 60.0 / (4 * 30.0)
    c = {r["gpus"]: r for r in t.cost([four, two, one], rows)}
    assert c[2]["step_s"] == 40.0 and c[2]["first_step_only"] is None
    # the resize, timed from the train log's lines (the stage's, then verl's)
    log = ("16:47:31 INFO memsifter.stages.train: train: step 2 was written by 4 GPU processes and this run has 2: "
           "collecting its weights -> s3://b/x/_work/resized-from-2\n"
           "16:53:26 INFO memsifter.stages.train: staged on 1 node(s); going on from step 2's model\n"
           "(TaskRunnerV1 pid=1) INFO:2026-11-27 16:58:34,095:all initialize finished, ready to fit\n")
    assert t.resize_events(log) == {"from_step": 2, "written_by_gpus": 4, "gpus": 2, "collect_s": 355,
                                    "start_to_ready_s": 308}
    assert t.resize_events("16:47:31 INFO memsifter.stages.train: staged on 1 node(s); resuming from step 2") is None
    text, _ = t.table([{**two, "resize": t.resize_events(log)}], steps)
    assert "went on from step 2, written by 4 GPU processes, on 2: collecting that step's weights took 355 s" in text


def test_ranker_paired_differences_come_from_the_per_question_files(tmp_path):
    """ranker_paired.py: each pair A:B is the mean per-question difference over the questions both ranked, per
    held-out part and pooled (ids kept apart by part), with a paired interval; it writes paired.md / paired.json."""
    (tmp_path / "ndcg10-per-question-a.json").write_text(json.dumps(
        {"x": {"q1": 1.0, "q2": 0.5, "q3": 0.0}, "y": {"q1": 0.5, "q2": 0.5, "q9": 1.0}}))
    (tmp_path / "ndcg10-per-question-b.json").write_text(json.dumps({"x": {"q1": 0.2}, "y": {"q1": 0.1}}))
    p = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu" / "ranker_paired.py"), str(tmp_path), "x:y"],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    res = json.load(open(tmp_path / "paired.json"))
    assert res["a"]["pairs"]["x:y"]["n"] == 2 and res["a"]["pairs"]["x:y"]["diff"] == 0.25
    assert res["pooled"]["pairs"]["x:y"]["n"] == 3 and res["pooled"]["pairs"]["x:y"]["diff"] == round(0.6 / 3, 4)
    assert res["a"]["ndcg10"]["x"]["n"] == 3 and "| pooled | x − y | 3 |" in (tmp_path / "paired.md").read_text()
    bad = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu" / "ranker_paired.py"), str(tmp_path), "xy"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "A:B expected" in bad.stderr


def test_dapo_4b_resume_at_another_size_runs_share_one_output(tmp_path, monkeypatch):
    """Issue 43 item 4 on the GPU: two configs in one driver run (one SeaweedFS) write one train output
    (--output-tag) and the second keeps the first's checkpoints (--keep-output) with its own step count (--steps
    2,4); logs stay per config. The driver's train calls are recorded instead of run."""
    drv = importlib.import_module("run_dapo_4b")
    a = drv.resolve(drv.build_parser().parse_args(
        ["run", "--configs", "memsifter/configs/train_4b_8k_4gpu.yaml,memsifter/configs/train_4b_8k_2gpu.yaml",
         "--steps", "2,4", "--output-tag", "resize", "--keep-output", "--work", str(tmp_path), "--out", str(tmp_path)]))
    assert a.steps_each == [2, 4] and a.max_steps == 4
    # 8 prompts a step for 4 steps: 32 train rows, 2 test rows, 2 to spare (20 questions gave 18 rows: 2 steps)
    assert a.questions == 36
    calls, deleted = [], []

    class Store:
        def exists(self, uri):
            return True

        def read_manifest(self, uri):
            return {"stats": {}}

        def delete(self, uri):
            deleted.append(uri)

        def copy_file(self, src, dst):
            pass

    import memsifter.store as store_pkg
    monkeypatch.setattr(store_pkg, "storage", Store())
    seen_gpus = []
    monkeypatch.setattr(drv, "sh", lambda cmd, log, env=None, check=True: (
        calls.append((cmd, log)), seen_gpus.append(env["CUDA_VISIBLE_DEVICES"]), (0, 1.0))[2])
    monkeypatch.setattr(drv, "verl_steps", lambda log: [])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    for path, n in zip(a.configs, a.steps_each):
        drv.one(importlib.import_module("argparse").Namespace(**{**vars(a), "steps": n}), path, "/m",
                {"peak": 1.0, "device": "d"})
    (c1, log1), (c2, log2) = calls
    assert "output=s3://memsifter/dapo4b/train-resize" in c1 and "output=s3://memsifter/dapo4b/train-resize" in c2
    assert "verl.trainer.total_training_steps=2" in c1 and "verl.trainer.total_training_steps=4" in c2
    assert "--replace" in c2, "the 4-GPU config published the output: the 2-GPU one goes on from its checkpoints"
    assert log1.endswith("train-8k-4gpu.log") and log2.endswith("train-8k-2gpu.log") and deleted == []
    # the 2-GPU config runs on the first two of the driver's GPUs and leaves the others to another run
    assert seen_gpus == ["0,1,2,3", "0,1"]
    assert [json.loads(x)["cuda_visible_devices"] for x in open(tmp_path / "runs.jsonl")] == ["0,1,2,3", "0,1"]
    assert drv.own_gpus(2, "") is None and drv.own_gpus(1, "3") == "3" and drv.own_gpus(2, "2, 3") == "2,3"
    bad = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu" / "run_dapo_4b.py"), "run", "--configs",
                          "memsifter/configs/train_4b_8k_4gpu.yaml", "--steps", "2,4"], capture_output=True, text=True,
                         cwd=REPO)
    assert bad.returncode == 2 and "one per config" in bad.stderr


def test_agents_driver_carries_the_data_phase_and_continues_grpo_from_the_last_round(tmp_path, monkeypatch):
    """run_agents.py: ``--pack-data`` also packs the data phase's outputs (made on a CPU machine, so that a GPU
    machine's lease goes to training), and ``--grpo-round 2`` continues GRPO from round 1's collected adapter
    into outputs of its own (train-r2, collect-r2, agents-grpo-r2), which travel and are evaluated like round 1's."""
    import argparse
    import os

    from memsifter.store import storage

    run_agents = importlib.import_module("run_agents")
    src = str(tmp_path / "a")
    monkeypatch.setattr(run_agents, "RUN", src)
    for name in run_agents.DATA:
        _published(src, name, {"part.parquet": name.encode()})
    _published(src, "collect", {"global_step_7/adapter/adapter_config.json": b"{}"})
    _published(src, "collect-r2", {"global_step_3/adapter/adapter_config.json": b"{}"})
    _published(src, "agents-grpo-r2", {"answers.parquet": b"r2"})
    out = tmp_path / "out"
    out.mkdir()
    run_agents.pack(str(out))  # without data: what a GPU machine returns
    dst = str(tmp_path / "b")
    monkeypatch.setattr(run_agents, "RUN", dst)
    run_agents.restore(str(out), str(tmp_path / "w1"))
    assert not storage.exists(f"{dst}/prep/_SUCCESS")
    assert storage.read_bytes(f"{dst}/agents-grpo-r2/answers.parquet") == b"r2"
    assert storage.exists(f"{dst}/collect-r2/global_step_3/adapter/adapter_config.json")

    monkeypatch.setattr(run_agents, "RUN", src)
    for old in out.iterdir():
        os.remove(old)
    run_agents.pack(str(out), data=True)
    dst = str(tmp_path / "c")
    monkeypatch.setattr(run_agents, "RUN", dst)
    run_agents.restore(str(out), str(tmp_path / "w2"))
    for name in run_agents.DATA:
        assert storage.read_bytes(f"{dst}/{name}/part.parquet") == name.encode()

    monkeypatch.setattr(run_agents, "RUN", src)
    a = argparse.Namespace(**{**vars(run_agents.build_parser().parse_args(["run"])), "grpo_round": 2})
    names = run_agents.grpo_names(2)
    assert (names["train"], names["collect"], names["answers"]) == (f"{src}/train-r2", f"{src}/collect-r2",
                                                                     "grpo-r2")
    cfg = run_agents.grpo_config(a)
    assert cfg["output"] == f"{src}/train-r2"
    assert cfg["init_adapter"] == f"{src}/collect/global_step_7/adapter"  # round 1's last step, by number
    a3 = argparse.Namespace(**{**vars(a), "grpo_round": 3})
    assert run_agents.grpo_config(a3)["init_adapter"] == f"{src}/collect-r2/global_step_3/adapter"
    with pytest.raises(SystemExit, match="collect-r3"):
        run_agents.grpo_config(argparse.Namespace(**{**vars(a), "grpo_round": 4}))
    assert f"{src}/agents-grpo-r2" in run_agents.answers_outputs()


def test_agents_driver_evaluates_again_when_more_answers_are_published(tmp_path, monkeypatch):
    """run_agents.py: each phase adds answers outputs, so the evaluate config changes between calls; the driver
    must replace the earlier table (on the host, 2026-11-27, the final evaluate exited 2: 'holds this stage's
    output for another config')."""
    import argparse

    from memsifter.store import storage

    run_agents = importlib.import_module("run_agents")
    src = str(tmp_path / "a")
    monkeypatch.setattr(run_agents, "RUN", src)
    _published(src, "agents-sft", {"answers.parquet": b"x"})
    calls = []
    monkeypatch.setattr(run_agents, "sh", lambda cmd, log, check=True: calls.append(cmd))
    a = argparse.Namespace(work=str(tmp_path), out=str(tmp_path))
    assert run_agents.evaluate(a, []) == [f"{src}/agents-sft"]
    assert "--replace" in calls[-1] and "--force" in calls[-1]
    assert not storage.exists(f"{src}/evaluate/_SUCCESS")


def test_verl_steps_reads_a_step_line_the_cluster_log_repeats_once(tmp_path):
    """On a Ray cluster of two raylets (issue 43's two-node run) the train log shows each of verl's step lines twice:
    the driver keeps one row a step; the same step number with other values (a resumed run) stays a second row; the
    table reading steps.jsonl written before this drops rows repeated word for word."""
    drv = importlib.import_module("run_train")
    line = "\x1b[36m(TaskRunnerV1 pid=1)\x1b[0m step:{n} - timing_s/step:{t} - critic/score/mean:-1.0\n"
    log = tmp_path / "train.log"
    log.write_text(line.format(n=1, t=81.3) * 2 + "noise\n" + line.format(n=2, t=33.7) * 2 + line.format(n=2, t=40.0))
    rows = drv.verl_steps(str(log))
    assert [(r["step"], r["timing_s/step"]) for r in rows] == [(1, 81.3), (2, 33.7), (2, 40.0)]
    table = importlib.import_module("dapo_4b_table")
    (tmp_path / "runs.jsonl").write_text(json.dumps({"config": "c.yaml", "gpus": 4}) + "\n")
    row = json.dumps({"config": "c.yaml", "step": 1, "timing_s/step": 81.3})
    (tmp_path / "steps.jsonl").write_text(row + "\n" + row + "\n")
    runs, steps = table.load(str(tmp_path))
    assert len(runs) == 1 and len(steps) == 1


def test_install_sh_sets_up_the_bundle_while_extra_pieces_are_still_arriving(tmp_path):
    """Extra pieces (``stage.py extra``) staged while a run goes on: ``source install.sh`` with some of them missing
    says how many are there, exports the environment and returns 0 (it used to return 1 before any export, so a
    poll of the running job could not even import memsifter); a wrong checksum still returns 1. The bundle here is
    marked installed and smoked (no wheels needed); run from a folder without .gpu/ so that recv.sh copies nothing.
    Before this, the same source returned 1 with nothing exported."""
    import hashlib

    work, stage_dir, site = tmp_path / "work", tmp_path / "stage", tmp_path / "site"
    (work / "benchmarks" / "gpu").mkdir(parents=True)
    for f in ("install.sh", "recv.sh", "pth_paths.py"):
        (work / "benchmarks" / "gpu" / f).write_text((REPO / "benchmarks" / "gpu" / f).read_text())
    stage_dir.mkdir()
    site.mkdir()
    (site / ".installed").write_text("")
    (site / ".smoked").write_text("")
    (site / "bin").mkdir()
    for exe in ("weed", "ray"):   # the bundle's binaries, which install.sh's last line looks for
        (site / "bin" / exe).write_text("#!/bin/sh\n")
        (site / "bin" / exe).chmod(0o755)
    data = b"x" * 10
    total = hashlib.sha256(data).hexdigest()
    for i, chunk in enumerate((data[:5], data[5:])):
        (stage_dir / f"x{i:02d}").write_bytes(chunk)
        (stage_dir / f"x{i:02d}.json").write_text(json.dumps({"index": i, "count": 2, "bytes": 5,
                                                             "sha256": hashlib.sha256(chunk).hexdigest(),
                                                             "bundle_sha256": total, "bundle_bytes": 10}))
    (stage_dir / "x01.json").unlink()
    script = ("source benchmarks/gpu/install.sh; rc=$?; echo \"rc=$rc\"; echo \"PYTHONPATH=$PYTHONPATH\"")
    env = {**os.environ, "MEMSIFTER_GPU_STAGE": str(stage_dir), "MEMSIFTER_GPU_SITE": str(site)}

    def run():
        return subprocess.run(["bash", "-c", script], cwd=work, env=env, capture_output=True, text=True, timeout=120)

    r = run()
    assert "rc=0" in r.stdout and f"PYTHONPATH={site}:{site}-extra:{work}" in r.stdout, r.stdout + r.stderr
    assert "extra pieces 1 of 2 staged: not installed yet" in r.stdout
    assert not (site / ".extra-installed").exists()
    (stage_dir / "x01.json").write_text(json.dumps({"index": 1, "count": 2, "bytes": 5, "sha256": "0",
                                                    "bundle_sha256": total, "bundle_bytes": 10}))
    (stage_dir / "x01").write_bytes(b"y" * 5)   # all pieces there, one of them wrong
    r = run()
    assert "rc=1" in r.stdout and "extra sha256 mismatch" in r.stderr, r.stdout + r.stderr
