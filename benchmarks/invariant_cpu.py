"""Invariant rollout cost in CPU seconds, for a loaded machine where wall time measures the neighbours: SmolLM2-135M
bf16, batch_invariant=true, the start-up probe, then SD off and SD history over 8 prompts x 2 (48 tokens, T 0.7), the
second epoch timed, at 1 thread. Run it in two checkouts one after the other to compare code (benchmarks/RESULTS.md).

    PYTHONPATH=. .venv/bin/python benchmarks/invariant_cpu.py
"""

import sys
import time

import torch

from tailrl.engine import Engine, EngineConfig, SamplingParams
from tailrl.engine.probe import probe_invariance
from tailrl.model import load_model
from tailrl.speculative.config import SpecConfig

sys.path.insert(0, "benchmarks")
from spec_rollout import prompts  # noqa: E402  (benchmarks/ is the script's folder)


def main() -> None:
    torch.set_num_threads(1)
    model, tok = load_model("smollm2-135m", device="cpu", dtype=torch.bfloat16)
    c = time.process_time()
    verdict = probe_invariance(model)
    out = [f"probe {verdict.summary()} {time.process_time() - c:.1f} cpu-s"]
    chats = prompts(tok)[:8]
    params = SamplingParams(temperature=0.7, max_tokens=48, n=2, seed=1)
    for mode in ("off", "history"):
        eng = Engine(model, tok, EngineConfig(kv_cache_gb=1.0, batch_invariant=True, spec=SpecConfig(mode=mode)))
        eng.generate(chats, params)  # the history the second epoch drafts from
        c, t = time.process_time(), time.perf_counter()
        res = eng.generate(chats, params)
        n = sum(len(r.token_ids) for r in res)
        out.append(f"{mode}: {n} tok {n / (time.process_time() - c):.1f} tok/cpu-s ({time.perf_counter() - t:.0f} s wall)")
    print(" | ".join(out), flush=True)


if __name__ == "__main__":
    main()
