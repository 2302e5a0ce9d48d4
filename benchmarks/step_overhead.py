"""The engine's host-side work per decode step, against the model forward inside it (SmolLM2-135M, CPU).

For plain decoding and for a tree-verify pass (a 4-token chain per sequence), at batch 1 and 32: engine step
time, the bare model forward inside it, and the rest (scheduling, input building, sampling, acceptance, KV
compaction, bookkeeping). A cProfile of the verify steps names the top five costs outside the forward.

    .venv/bin/python benchmarks/step_overhead.py [--steps 24] [--dtype float32]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

from tailrl.engine import Engine, EngineConfig, SamplingParams
from tailrl.model import load_model
from tailrl.speculative.config import SpecConfig
from tailrl.speculative.drafters import ModelFreeDrafter
from tailrl.speculative.speculator import Speculator
from tailrl.speculative.tree import DraftTree


class ChainDrafter(ModelFreeDrafter):
    """Always drafts a chain of its budget: verification costs the same whatever is accepted."""

    name = "chain"

    def start(self, seq) -> None:
        pass

    def accept(self, seq, tokens) -> None:
        pass

    def propose_one(self, seq, budget, depth):
        return DraftTree.chain([(seq.output_ids[-1] + 1 + i) % 1000 for i in range(budget)], self.name)


def measure(model, tok, B: int, verify: bool, steps: int, profile: cProfile.Profile | None, temperature: float = 1.0):
    spec = SpecConfig(mode="ngram", budgets=(4,), init_depth=4, min_depth=4, max_depth=4)
    eng = Engine(model, tok, EngineConfig(kv_cache_gb=2.0, spec=spec if verify else SpecConfig(mode="off")),
                 Speculator(spec, [ChainDrafter()]) if verify else None)
    prompt = [{"role": "user", "content": "Tell me a long story about a robot who learns to paint."}]
    eng.add_requests([prompt], SamplingParams(n=B, temperature=temperature, max_tokens=steps * 6 + 16, seed=0, ignore_eos=True))
    eng.step()  # prefill
    for _ in range(3):  # warm-up
        eng.step()
    total = fwd = 0.0
    for _ in range(steps):
        if profile is not None:
            profile.enable()
        t = time.perf_counter()
        out = eng.step()
        total += time.perf_counter() - t
        if profile is not None:
            profile.disable()
        fwd += eng.runner.last_forward_s
        assert out.record.kind == "decode" and out.record.batch == B
    return 1000 * total / steps, 1000 * fwd / steps


OUTSIDE = ("tailrl/engine/", "tailrl/speculative/", "tailrl/model/step.py")
INSIDE = ("_forward", "step", "decode_pass", "decode", "prefill_pass")  # functions that contain the forward


def top_host_costs(profile: cProfile.Profile, n: int = 5) -> list[tuple[str, float]]:
    st = pstats.Stats(profile)
    rows = []
    for (fname, line, func), (_, _, _, cum, _) in st.stats.items():
        if any(p in fname for p in OUTSIDE) and func not in INSIDE:
            rows.append((f"{fname.split('tailrl/')[-1]}:{func}", cum))
    rows.sort(key=lambda r: -r[1])
    out, seen = [], set()
    for name, cum in rows:  # skip a function already counted inside a bigger one of the list
        if name not in seen:
            out.append((name, cum))
            seen.add(name)
    return out[:n]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--temperature", type=float, default=1.0, help="0 = greedy (no sampling noise)")
    args = ap.parse_args()
    torch.set_num_threads(2)
    model, tok = load_model("smollm2-135m", device="cpu", dtype=getattr(torch, args.dtype))
    prof = cProfile.Profile()
    print(f"\nSmolLM2-135M {args.dtype}, CPU, T={args.temperature}, {args.steps} steps per cell (verify: a 4-token chain "
          "per sequence)\n")
    print("| pass | batch | engine step ms | model forward ms | host work ms | host share |")
    print("|---|---|---|---|---|---|")
    for verify in (False, True):
        for B in (1, 32):
            step_ms, fwd_ms = measure(model, tok, B, verify, args.steps, prof if verify and B == 32 else None,
                                      args.temperature)
            host = step_ms - fwd_ms
            print(f"| {'verify' if verify else 'decode'} | {B} | {step_ms:.1f} | {fwd_ms:.1f} | {host:.1f} | {100 * host / step_ms:.1f}% |")
    print(f"\nTop host-side costs in the batch-32 verify steps (cumulative ms per step, {args.steps} steps):\n")
    for name, cum in top_host_costs(prof):
        print(f"- {name}: {1000 * cum / args.steps:.2f} ms")


if __name__ == "__main__":
    main()
