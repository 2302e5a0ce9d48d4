#!/usr/bin/env bash
# Issue 11's GPU measurements, in the order of benchmarks/RESULTS.md "The GPU path": run from the repo root on a
# CUDA machine after `bash scripts/setup.sh` (CUDA torch, the packaged SmolLM2-135M). Each step prints the table
# that goes into RESULTS.md and keeps a copy in $OUT. Steps are independent: `bash benchmarks/gpu/run.sh 3`
# runs step 3 only (each fits a 10-minute slot on an H100; step 6 may need two).
set -uo pipefail
cd "$(dirname "$0")/../.."  # the repo root, wherever it is called from
PY=${PY:-.venv/bin/python}
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
only=${1:-all}
step() { [[ $only == all || $only == "$1" ]]; }

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/device.txt"
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/device.txt"

# 1. CUDA tests: graph replay == eager padded pass (logits, KV), engine tokens graphs on == off, bf16 engine.
step 1 && $PY -m pytest -q tests/engine/test_runner.py 2>&1 | tee "$OUT/1_tests.txt"
# 2. Parity, bf16: logits vs transformers (max diff / logit std, top-1 agreement), greedy identical but at ties.
step 2 && $PY benchmarks/gpu/vs_hf.py parity --model smollm2-135m 2>&1 | tee "$OUT/2_parity_smollm.txt"
step 2 && $PY benchmarks/gpu/vs_hf.py parity --model qwen2.5-1.5b --tokens 64 2>&1 | tee "$OUT/2_parity_qwen.txt"
# 3. Decode tok/s at batch 1, 8, 64 and on the long-tailed batch: graphs on / off / transformers generate.
#    Targets: graphs >= 3x eager at batch 1; engine >= 3x transformers on the long tail.
step 3 && $PY benchmarks/gpu/vs_hf.py speed --model smollm2-135m 2>&1 | tee "$OUT/3_speed_smollm.txt"
step 3 && $PY benchmarks/gpu/vs_hf.py speed --model qwen2.5-1.5b 2>&1 | tee "$OUT/3_speed_qwen.txt"
# 4. Forward cost vs tokens per sequence (k = 1..32 at batch 1, 4, 32), graphs vs eager; prefill kernel.
step 4 && $PY benchmarks/gpu/cost.py all --model smollm2-135m 2>&1 | tee "$OUT/4_cost_smollm.txt"
step 4 && $PY benchmarks/gpu/cost.py cost --model qwen3-8b 2>&1 | tee "$OUT/4_cost_qwen3_8b.txt"
# 5. Speculation in the long tail, T=1.0 and T=0.7, SD auto vs off per batch-size bucket.
#    Targets: >= 2x in buckets 1-4, never below 0.95x.
step 5 && $PY benchmarks/spec_rollout.py --device cuda --epochs 3 --n 4 2>&1 | tee "$OUT/5_spec_rollout.txt"
# 6. End to end on a bigger step, SD auto vs off, rollout share of the step. Target: >= 1.5x on the rollout.
#    (model.dtype=auto: a bf16 engine beside fp32 master weights on CUDA)
step 6 && $PY benchmarks/e2e.py --steps 4 --seeds 0 --extra model.device=cuda \
    trainer.prompts_per_step=16 rollout.n=16 rollout.max_tokens=512 2>&1 | tee "$OUT/6_e2e.txt"
