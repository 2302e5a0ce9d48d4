#!/usr/bin/env bash
# rollout.backend=vllm on a lent GPU, in one go (issue 48): the audit on CUDA (vLLM's ngram and suffix SD, and our
# history proposer, against plain decoding), then the long preset end to end with vLLM plain against vLLM with our
# proposer. Prepare first (off the GPU clock): scripts/setup.sh, then `.venv/bin/pip install "torch==2.13.0" vllm
# arctic-inference` (vllm's CUDA wheel; arctic-inference for suffix). Prints tables; writes under $OUT (default /tmp).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp}
PY=.venv/bin/python
export VLLM_ENABLE_V1_MULTIPROCESSING=0
$PY -c "import vllm, torch; print('vLLM', vllm.__version__, torch.cuda.get_device_name())"
# 1. the audit: plain arm once, then each method (bf16, k=8, 4 prompts x 64 x T 0.7/1.0, 64 tokens); ~3 min
$PY benchmarks/vllm_audit.py --dtype bfloat16 --methods ngram suffix tailrl | tee "$OUT/vllm_audit_cuda.txt"
# 2. the long preset, vLLM plain (spec off) against vLLM + our proposer (spec auto: the audit above is cached), seed 0
$PY benchmarks/e2e.py --preset long --seeds 0 --out "$OUT/e2e_vllm" --extra rollout.backend=vllm \
  | tee "$OUT/e2e_vllm.txt"
# 3. vLLM's suffix SD as the rollout, audit skipped (speed only: its samples may not be the policy's)
TAILRL_VLLM_AUDIT=skip $PY benchmarks/e2e.py --preset long --seeds 0 --out "$OUT/e2e_vllm_suffix" \
  --extra rollout.backend=vllm rollout.vllm_spec=suffix | tee "$OUT/e2e_vllm_suffix.txt"
