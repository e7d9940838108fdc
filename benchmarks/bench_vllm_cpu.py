"""vLLM on a small CPU: the scheduler's reserved core (vLLM's default) vs none (memsifter's default).

One vLLM (CPU) OpenAI-compatible server of the real SmolLM2-135M-Instruct (`memsifter models`) per
setting (alternating, --repeats times), the same 16 distinct ~900-token prompts (no shared prefix, so prefix caching cannot help),
24 new tokens each, 8 in flight; two warm-up requests first. Prints the median, the spread and the
ratio of the medians.

    python benchmarks/bench_vllm_cpu.py
"""

from __future__ import annotations

import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main() -> int:
    from memsifter.models import registry as models
    from memsifter.models.llm import ChatClient, LLMEndpoint
    from memsifter.testing.servers import vllm_server

    text = "".join(open(os.path.join(ROOT, p)).read() for p in ("README.md", "benchmarks/README.md"))
    msgs = [[{"role": "user", "content": f"{i} {text[i * 1500:i * 1500 + 3500]}\n\nQuestion {i}: what is "
                                         "memsifter? Answer in a few words."}] for i in range(18)]
    model = models.resolve("smollm2-135m-instruct")
    import argparse
    import statistics

    a = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    a.add_argument("--repeats", type=int, default=3, help="server starts per setting, alternating")
    args = a.parse_args()
    settings = (("vLLM default (1 core reserved for the scheduler)", "1"),
                ("memsifter default (VLLM_CPU_NUM_OF_RESERVED_CPU=0)", "0"))
    times: dict[str, list[float]] = {label: [] for label, _ in settings}
    for rep in range(args.repeats):
        for label, reserved in settings:  # alternating, so drift on a shared machine hits both
            os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = reserved
            with vllm_server(model, "s", extra_args=["--max-model-len", "8192"]) as url:
                c = ChatClient(LLMEndpoint(base_url=url, model="s", max_tokens=24, temperature=0,
                                           concurrency=8, api_key_env=None))
                c.complete_many(msgs[16:])
                t = time.time()
                out = c.complete_many(msgs[:16])
                assert all(o.ok for o in out), [o.error for o in out if not o.ok][:1]
                times[label].append(time.time() - t)
                print(f"[bench] repeat {rep + 1}: {label}: {times[label][-1]:.1f}s", flush=True)
    base = statistics.median(times[settings[0][0]])
    print(f"cores: {len(os.sched_getaffinity(0))}, repeats: {args.repeats}\n\n"
          "| setting | median s (16 requests) | min–max s | speed-up (medians) |\n|---|---:|---:|---:|")
    for label, _ in settings:
        xs = times[label]
        print(f"| {label} | {statistics.median(xs):.1f} | {min(xs):.1f}–{max(xs):.1f} | "
              f"{base / statistics.median(xs):.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
