"""vLLM on a small CPU: the engine environment memsifter sets against vLLM's defaults, side by side.

Two comparisons (``--compare``):

- ``reserved``: the scheduler's reserved core (vLLM's default) vs none (``VLLM_CPU_NUM_OF_RESERVED_CPU=0``);
- ``wait``: OpenMP threads that spin while they wait (libgomp's default) vs ``OMP_WAIT_POLICY=PASSIVE``, on idle
  cores and with ``--busy N`` processes spinning beside the server (another job, a second test process, the
  demo's embed stage sharing the cores).

One vLLM (CPU) OpenAI-compatible server of the real SmolLM2-135M-Instruct (`memsifter models`) per setting
(alternating, --repeats times), the same 16 distinct ~900-token prompts (no shared prefix, so prefix caching
cannot help), 24 new tokens each, 8 in flight; two warm-up requests first. Prints the median, the spread and the
ratio of the medians, with the machine's load average when each measurement ended; ``--json FILE`` keeps every
measurement.

    python benchmarks/bench_vllm_cpu.py --compare wait --busy 0 2
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SETTINGS = {
    "reserved": (("vLLM default (1 core reserved for the scheduler)", {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}),
                 ("memsifter default (VLLM_CPU_NUM_OF_RESERVED_CPU=0)", {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"})),
    "wait": (("libgomp default (threads spin while waiting)", {"OMP_WAIT_POLICY": "ACTIVE"}),
             ("memsifter default (OMP_WAIT_POLICY=PASSIVE)", {"OMP_WAIT_POLICY": "PASSIVE"})),
}


def _spin() -> None:   # a process that keeps one core busy: the other job sharing the machine
    while True:
        pass


@contextlib.contextmanager
def busy(n: int):
    procs = [mp.Process(target=_spin, daemon=True) for _ in range(n)]
    for p in procs:
        p.start()
    try:
        yield
    finally:
        for p in procs:
            p.terminate()
            p.join()


def main() -> int:
    import argparse
    import statistics

    from memsifter.models import registry as models
    from memsifter.models.llm import ChatClient, LLMEndpoint
    from memsifter.models.vllm_server import VllmServerConfig, serve

    a = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    a.add_argument("--compare", choices=sorted(SETTINGS), default="reserved")
    a.add_argument("--busy", type=int, nargs="+", default=[0], help="busy processes beside the server (each a run)")
    a.add_argument("--repeats", type=int, default=3, help="server starts per setting, alternating")
    a.add_argument("--json", default=None, help="write every measurement here")
    args = a.parse_args()

    text = "".join(open(os.path.join(ROOT, p)).read() for p in ("README.md", "benchmarks/README.md"))
    msgs = [[{"role": "user", "content": f"{i} {text[i * 1500:i * 1500 + 3500]}\n\nQuestion {i}: what is "
                                         "memsifter? Answer in a few words."}] for i in range(18)]
    model = models.resolve("smollm2-135m-instruct")
    settings = SETTINGS[args.compare]
    rows = []
    for n_busy in args.busy:
        for rep in range(args.repeats):
            for label, env in settings:  # alternating, so drift on a shared machine hits both
                cfg = VllmServerConfig(model=model, served_name="s", extra_args=["--max-model-len", "8192"], env=env,
                                       timeout_s=900)
                with serve(cfg) as url:
                    c = ChatClient(LLMEndpoint(base_url=url, model="s", max_tokens=24, temperature=0,
                                               concurrency=8, api_key_env=None))
                    c.complete_many(msgs[16:])
                    with busy(n_busy):
                        t = time.time()
                        out = c.complete_many(msgs[:16])
                        secs = time.time() - t
                        load = os.getloadavg()[0]
                    assert all(o.ok for o in out), [o.error for o in out if not o.ok][:1]
                rows.append({"busy": n_busy, "setting": label, "env": env, "repeat": rep + 1, "seconds": round(secs, 2),
                             "load1": round(load, 2)})
                print(f"[bench] busy {n_busy}, repeat {rep + 1}: {label}: {secs:.1f}s (load {load:.1f})", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"compare": args.compare, "cores": len(os.sched_getaffinity(0)), "rows": rows}, f, indent=1)
    print(table(rows, settings, len(os.sched_getaffinity(0)), args.repeats))
    return 0


def table(rows: list[dict], settings, cores: int, repeats: int) -> str:
    import statistics

    out = [f"cores: {cores}, repeats: {repeats}\n",
           "| busy processes | setting | median s (16 requests) | min–max s | load (1 min) | speed-up (medians) |",
           "|---:|---|---:|---:|---:|---:|"]
    for n_busy in sorted({r["busy"] for r in rows}):
        times = {label: [r["seconds"] for r in rows if r["busy"] == n_busy and r["setting"] == label]
                 for label, _ in settings}
        loads = {label: [r["load1"] for r in rows if r["busy"] == n_busy and r["setting"] == label]
                 for label, _ in settings}
        base = statistics.median(times[settings[0][0]])
        for label, _ in settings:
            xs = times[label]
            out.append(f"| {n_busy} | {label} | {statistics.median(xs):.1f} | {min(xs):.1f}–{max(xs):.1f} | "
                       f"{statistics.median(loads[label]):.1f} | {base / statistics.median(xs):.2f}x |")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
