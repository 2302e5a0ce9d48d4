"""What a decode step costs on this engine and CPU, by batch size, draft rows and context, and how well the selector's
step-time model (speculative/step_cost.py) predicts it.

    .venv/bin/python benchmarks/step_time.py [--batches 1 2 4 8 16 32 64] [--depths 0 1 3 7 15] [--contexts 200 800]
                                             [--dtype bfloat16] [--reps 6]

Each cell decodes B samples of one prompt of `context` tokens on the batch-invariant engine (the CPU default), every
sequence verifying a chain of `depth` draft tokens that are never accepted (so every step has the same shape), and
times `reps` steps after one warm-up step. The model is then fitted on every other cell's steps (as the selector fits
them: all steps, in order) and predicts the cells it did not see. Prints, per cell, the measured milliseconds, the
ratio to the plain step of the same B and context, and the held-out prediction's error."""

from __future__ import annotations

import argparse
import statistics

import torch

from tailrl.engine import Engine, EngineConfig, SamplingParams
from tailrl.model import load_model
from tailrl.speculative.config import SpecConfig
from tailrl.speculative.drafters import ModelFreeDrafter
from tailrl.speculative.selector import Arm
from tailrl.speculative.speculator import Speculator
from tailrl.speculative.step_cost import StepTime
from tailrl.speculative.tree import DraftTree


class WrongChains(ModelFreeDrafter):
    """Chains of `depth` tokens no policy writes (the verifier rejects them): fixed-shape verify passes."""

    name = "fixed"

    def __init__(self):
        self.depth = 0

    def start(self, seq) -> None:
        pass

    def accept(self, seq, tokens) -> None:
        pass

    def propose_one(self, seq, budget, depth):
        d = min(self.depth, budget)
        return DraftTree.chain([3 + (seq.seq_id + k) % 7 for k in range(d)], self.name) if d else None


def cell(model, tok, B: int, depth: int, context: int, reps: int) -> list[tuple]:
    spec = SpecConfig(mode="history", budgets=(15,), min_depth=15, init_depth=15, max_depth=16, fill_tiles=False)
    drafter = WrongChains()
    sp = Speculator(spec, [drafter])
    eng = Engine(model, tok, EngineConfig(kv_cache_gb=2.0, batch_invariant=True, spec=spec, max_num_seqs=max(B, 8)), sp)
    sp.selector.choose = lambda B_, contexts=None: Arm("fixed", 15)
    drafter.depth = depth
    prompt = [5 + i % 500 for i in range(context)]
    eng.add_requests([prompt], SamplingParams(n=B, max_tokens=reps + 4, temperature=0.0, ignore_eos=True))
    out = []
    while eng.has_work() and len(out) < reps + 1:
        r = eng.step().record
        if r.kind == "decode" and r.batch == B:
            contexts = [context + len(out)] * B
            out.append((contexts, depth if depth else 0, r.total_s - r.draft_s, sp.selector.geometry))
    eng.abort(eng.unfinished_ids())
    return out[1:]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--depths", type=int, nargs="+", default=[0, 1, 3, 7, 15])
    ap.add_argument("--contexts", type=int, nargs="+", default=[200, 800])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load_model("smollm2-135m", device="cpu", dtype=getattr(torch, args.dtype))
    for B in (1, max(args.batches)):  # warm-up: the kernels' first calls (packing, the C kernel's build) are not a step
        cell(model, tok, B, max(args.depths), min(args.contexts), 2)
    cells = {(B, d, c): cell(model, tok, B, d, c, args.reps)
             for c in args.contexts for B in args.batches for d in args.depths}
    fit = StepTime()
    held = set(list(cells)[1::2])
    for key, steps in cells.items():
        if key not in held:
            for contexts, d, s, geo in steps:
                fit.record(geo.shape(contexts, [d] * len(contexts)), s)
    print(f"SmolLM2-135M {args.dtype}, batch-invariant engine, {args.threads} threads; median of {args.reps} steps\n")
    print("| context | B | draft rows a sequence | ms | / plain step | model (held out) | error |\n|---|---|---|---|---|---|---|")
    for (B, d, c), steps in cells.items():
        ms = statistics.median(s for _, _, s, _ in steps) * 1e3
        plain = statistics.median(s for _, _, s, _ in cells[(B, 0, c)]) * 1e3 if (B, 0, c) in cells else float("nan")
        contexts, _, _, geo = steps[len(steps) // 2]
        pred = fit.seconds(geo.shape(contexts, [d] * B)) * 1e3
        mark = " (held out)" if (B, d, c) in held else ""
        print(f"| {c} | {B} | {d} | {ms:.1f} | {ms / plain:.2f} | {pred:.1f}{mark} | {pred / ms - 1:+.0%} |")


if __name__ == "__main__":
    main()
