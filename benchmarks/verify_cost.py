"""What a verify pass costs on this CPU as the engine runs it: SmolLM2-135M in bf16, batch-invariant passes
(engine/invariant.py: row tiles, attention over each sequence's own keys in fixed chunks), B sequences each verifying a
chain of k draft tokens after --ctx cached tokens, relative to a plain decode step (k = 0) of the same B. Rounds
over every (B, k) are interleaved, the first two dropped, the median kept: the machine is shared and drifts.

The selector's cost model learns the same curve online; this is the table to read the speculation results against
(a chain of k tokens pays where the tokens it emits per sequence, 1 + accepted, exceed its cost ratio).

    .venv/bin/python benchmarks/verify_cost.py [--batches 1 4 16 32 64] [--ks 1 2 4 8] [--rounds 7] [--sample]
        [--deep 4 --deep-k 16] [--plain]

--deep N: N of each batch's sequences verify a chain of --deep-k tokens whatever k the others verify (the
per-request adaptive depth and DAS give a few requests deep drafts; in the chunked passes they add query blocks).
--plain: each cell also timed with the plain (not invariant) passes: invariant / plain.
"""

from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace

import torch

from tailrl.engine.runner import ModelRunner
from tailrl.engine.sampler import decide
from tailrl.engine.sampling import SamplingParams
from tailrl.model import load_model
from tailrl.speculative.tree import DraftTree


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 32, 64])
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--ctx", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--deep", type=int, default=0)
    ap.add_argument("--deep-k", type=int, default=16)
    ap.add_argument("--plain", action="store_true", help="also time the plain (not invariant) passes")
    ap.add_argument("--sample", action="store_true",
                    help="time the step as the engine does: the pass, then sampling and acceptance at T=0.7 (decide)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, _ = load_model("smollm2-135m", device="cpu", dtype=torch.bfloat16)
    runner = ModelRunner(model, 2**31, max(args.batches), 2 * args.ctx, invariant=True)
    runner.kv.ensure(list(range(max(args.batches))), 2 * args.ctx)
    ks = [0, *args.ks]
    params = SamplingParams(temperature=0.7, max_tokens=512)
    seqs = [SimpleNamespace(params=params, output_ids=[7] * 40, seed=i) for i in range(max(args.batches))]
    times: dict[tuple, list[float]] = {}
    chain = lambda k: DraftTree.chain(list(range(11, 11 + k))) if k else None  # noqa: E731
    splits = (True, False) if args.plain else (True,)
    with torch.inference_mode():  # as the engine runs it (grad mode would keep every pass's graph alive)
        for _ in range(args.rounds):
            for B in args.batches:
                for k in ks:
                    for split in splits:
                        runner.invariant = split
                        deep = min(args.deep, B) if k else 0
                        trees = [chain(k) for _ in range(B - deep)] + [chain(args.deep_k)] * deep if k else None
                        t = time.perf_counter()
                        logits, _, q_lens, depths = runner.decode([5] * B, [args.ctx] * B, trees)
                        if args.sample:
                            decide(logits, seqs[:B], trees, q_lens, depths)
                        times.setdefault((B, k, split), []).append(time.perf_counter() - t)
    med = {key: statistics.median(v[2:] if len(v) > 3 else v) for key, v in times.items()}
    print(f"SmolLM2-135M bf16, batch-invariant passes, {args.ctx} cached tokens, {args.threads} threads, "
          f"median of {args.rounds} rounds{', with sampling at T=0.7' if args.sample else ''}\n")
    if args.deep:
        print(f"{args.deep} sequences of each batch verify {args.deep_k} tokens\n")
    if args.plain:
        print("cells: invariant / plain passes, each against the invariant plain step\n")
    print("| batch | plain step ms | " + " | ".join(f"k={k}" for k in args.ks) + " |")
    print("|---|---|" + "---|" * len(args.ks))
    for B in args.batches:
        base = med[(B, 0, True)]
        cell = lambda k: " / ".join(f"{med[(B, k, s)] / base:.2f}x" for s in splits)  # noqa: E731
        print(f"| {B} | {base * 1e3:.1f} | " + " | ".join(cell(k) for k in args.ks) + " |")


if __name__ == "__main__":
    main()
