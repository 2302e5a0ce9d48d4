#!/usr/bin/env bash
# The checks issue 45 leaves for an Intel CPU with AMX (amx_bf16), in one run from the repository root after
# `bash scripts/setup.sh`: what no other CPU can run. Prints everything to stdout; about 30-60 minutes on 2 cores.
#
#   bash scripts/amx_check.sh [out_dir]      (default out/amx_check)
#
# 1. the invariance matrix at 1 and 2 threads, AMX and two ISA caps, on a random SmolLM2-shaped model and on the
#    installed SmolLM2-135M (the engine's start-up probe, its call sizes, prefill beside another == alone, decode ==
#    prefill): with cancelling data the probe should now size the products' calls where AMX's kernels hold, or name
#    what breaks; it must not say "holds" beside a "no";
# 2. the invariance, AMX-simulation and update tests at 2 threads, default ISA and AVX512_CORE_BF16;
# 3. the held-out checks of the issue: `tailrl generate` with --spec off, history and ngram emits the same token
#    ids (bf16, T 1.0, n 4, 2 epochs), and two steps of `tailrl train` report rollout/batch_invariant;
# 4. what it costs: rollout tok/s of the invariant passes (benchmarks/invariant.py) and the update
#    (benchmarks/update.py), default ISA against ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 (the cap the issue measured).
# Put the tables in benchmarks/RESULTS.md with `lscpu` and the commit.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${1:-out/amx_check}
mkdir -p "$OUT"
export OMP_NUM_THREADS=2
grep -q amx_bf16 /proc/cpuinfo || echo "WARNING: no amx_bf16 in /proc/cpuinfo: this CPU cannot run the AMX kernels"
git log --oneline -1
lscpu | grep -E "Model name|^CPU\(s\)|Flags" | sed 's/\(Flags:\).*\(amx[a-z_0-9 ]*\).*/\1 ... \2 .../'
$PY -c "import torch; print(torch.__version__); print(torch.__config__.show())" | grep -E "^2|oneDNN|MKL-DNN|Math Kernel"

echo "== 1. invariance matrix"
for model in random smollm2-135m; do
  $PY benchmarks/invariance_matrix.py --threads 1 2 --isas default AVX512_CORE_BF16 AVX512_CORE --model $model
done

echo "== 2. tests at 2 threads"
for isa in default AVX512_CORE_BF16; do
  if [ $isa = default ]; then unset ONEDNN_MAX_CPU_ISA; else export ONEDNN_MAX_CPU_ISA=$isa; fi
  echo "-- ONEDNN_MAX_CPU_ISA=${ONEDNN_MAX_CPU_ISA:-unset}"
  $PY -m pytest -q tests/engine/test_invariant.py tests/engine/test_invariant_amx.py tests/rl/test_update.py 2>&1 | tail -15
done
unset ONEDNN_MAX_CPU_ISA

echo "== 3. generate: SD off, history and ngram emit the same token ids"
for spec in off history ngram; do
  $PY -m tailrl.cli generate --dtype bfloat16 --temperature 1.0 --n 4 --epochs 2 --seed 0 --spec $spec \
    --out "$OUT/generate_$spec.jsonl" --quiet 2>&1 | grep -iE "invarian|warn|error" || true
done
$PY - "$OUT" <<'EOF'
import json, sys
out = sys.argv[1]
ids = {s: [json.loads(l)["token_ids"] for l in open(f"{out}/generate_{s}.jsonl")] for s in ("off", "history", "ngram")}
for s in ("history", "ngram"):
    same = sum(a == b for a, b in zip(ids["off"], ids[s]))
    print(f"{s}: {same} of {len(ids['off'])} responses identical to SD off")
EOF
echo "== 3b. train: rollout/batch_invariant"
$PY -m tailrl.cli train trainer.steps=2 trainer.eval_every=0 trainer.save_every=0 trainer.overwrite=true "trainer.out_dir=$OUT/train" 2>&1 | tail -3
grep -o '"rollout/batch_invariant": [0-9.]*' "$OUT/train/metrics.jsonl" || echo "no rollout/batch_invariant in $OUT/train/metrics.jsonl"

echo "== 4. cost: default ISA against ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16"
for isa in default AVX512_CORE_BF16 default AVX512_CORE_BF16; do
  if [ $isa = default ]; then unset ONEDNN_MAX_CPU_ISA; else export ONEDNN_MAX_CPU_ISA=$isa; fi
  echo "-- ONEDNN_MAX_CPU_ISA=${ONEDNN_MAX_CPU_ISA:-unset}"
  $PY benchmarks/invariant.py --epochs 2 --n 8 --max-tokens 96 2>&1 | tail -12
  $PY benchmarks/update.py --prompts 4 --n 8 --micro 8 --repeats 2 --variants new-bfloat16 2>&1 | tail -4
done
