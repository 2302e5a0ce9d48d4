"""The audit's scorer (engine/score.py): a prompt's responses in one forward with the prompt computed once, against
one forward per response (engine/score.py's per_response, the computation it replaced), on SmolLM2 in fp32.

    python benchmarks/audit_scorer.py [--responses 16] [--reps 3]

Prints one table: per path the mean seconds to score one audit prompt's responses (random tokens, 8-64 each; the
arms interleaved per repetition), the ratio, and the largest |difference| of a token's log p between the paths."""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--responses", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--temperature", type=float, default=0.7)
    args = ap.parse_args()

    import torch

    from tailrl.cli_audit import audit_prompts
    from tailrl.engine.requests import encode
    from tailrl.engine.score import model_scorer, per_response
    from tailrl.model import load_model

    model, tok = load_model("smollm2-135m", device="cpu", dtype=torch.float32)
    prompt = audit_prompts(lambda m: encode(tok, m), 1, 0)[0]
    rng = random.Random(0)
    rs = [[rng.randrange(100, 40000) for _ in range(rng.randint(8, 64))] for _ in range(args.responses)]
    scorer = model_scorer(model)
    spent = {"shared": 0.0, "per response": 0.0}
    err = 0.0
    for _ in range(args.reps):
        t0 = time.perf_counter()
        a = scorer.score(prompt, rs, args.temperature)
        spent["shared"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        b = per_response(model, prompt, rs, args.temperature)
        spent["per response"] += time.perf_counter() - t0
        err = max(err, max(abs(x - y) for p, q in zip(a, b) for x, y in zip(p, q)))
    print(f"SmolLM2-135M fp32, prompt {len(prompt)} tokens, {len(rs)} responses of {sum(map(len, rs))} tokens, "
          f"T {args.temperature}, {torch.get_num_threads()} threads, {args.reps} reps\n")
    print("| path | s per prompt | vs per response | max abs log p difference |")
    print("|---|---|---|---|")
    base = spent["per response"] / args.reps
    for name, s in spent.items():
        print(f"| {name} | {s / args.reps:.2f} | {base / (s / args.reps):.2f}x | {err if name == 'shared' else 0:.2g} |")


if __name__ == "__main__":
    main()
