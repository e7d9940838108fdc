#!/usr/bin/env bash
# On the GPU host: stop a detached run_ranker.py and everything it started (verl, Ray, vLLM servers,
# SeaweedFS), so that `run_ranker.py start` can begin again. Patterns are read from this file, so the
# calling shell's own command line never matches them.
for pat in "run_ranker.py run" "memsifter.cli run" "verl.trainer.main_ppo" "vllm.entrypoints" "weed mini"; do
  for p in $(pgrep -f "$pat"); do
    [ "$p" != "$$" ] && kill -9 "$p" 2>/dev/null
  done
done
ray stop --force >/dev/null 2>&1 || true
sleep 3
nvidia-smi --query-gpu=memory.used --format=csv,noheader
