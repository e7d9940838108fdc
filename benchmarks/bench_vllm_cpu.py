"""vLLM on a small CPU: the scheduler's reserved core (vLLM's default) vs none (memsifter's default).

One vLLM (CPU) OpenAI-compatible server of the real SmolLM2-135M-Instruct (`memsifter models`) per
setting, the same 16 distinct ~900-token prompts (no shared prefix, so prefix caching cannot help),
24 new tokens each, 8 in flight; two warm-up requests first. Prints seconds and the ratio.

    python benchmarks/bench_vllm_cpu.py
"""

from __future__ import annotations

import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main() -> int:
    from memsifter import models
    from memsifter.llm import ChatClient, LLMEndpoint
    from memsifter.testing import vllm_server

    text = "".join(open(os.path.join(ROOT, p)).read() for p in ("README.md", "benchmarks/README.md"))
    msgs = [[{"role": "user", "content": f"{i} {text[i * 1500:i * 1500 + 3500]}\n\nQuestion {i}: what is "
                                         "memsifter? Answer in a few words."}] for i in range(18)]
    model = models.resolve("smollm2-135m-instruct")
    rows = []
    for label, reserved in (("vLLM default (1 core reserved for the scheduler)", "1"),
                            ("memsifter default (VLLM_CPU_NUM_OF_RESERVED_CPU=0)", "0")):
        os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = reserved
        with vllm_server(model, "s", extra_args=["--max-model-len", "8192"]) as url:
            c = ChatClient(LLMEndpoint(base_url=url, model="s", max_tokens=24, temperature=0, concurrency=8))
            c.complete_many(msgs[16:])
            t = time.time()
            out = c.complete_many(msgs[:16])
            rows.append((label, time.time() - t, sum(o.ok for o in out)))
    base = rows[0][1]
    print(f"cores: {len(os.sched_getaffinity(0))}\n\n| setting | seconds (16 requests) | ok | speed-up |\n|---|---:|---:|---:|")
    for label, secs, ok in rows:
        print(f"| {label} | {secs:.1f} | {ok} | {base / secs:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
