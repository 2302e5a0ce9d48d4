"""The update's LM head: token log-probabilities and entropy for M response rows through SmolLM2's 49152 x 576 head,
forward and backward, as the update runs it (rl/actor/logprobs.py: chunks of rows, bf16 matmuls, fp32 log-softmax),
against the full-logits reference (one [M, V] fp32 log-softmax, algos.token_logprobs). Two losses: the
log-probabilities alone (the default: entropy is only logged) and with an entropy term. Interleaved repeats, best
kept; random weights of the real shape (the cost does not depend on their values).

    .venv/bin/python benchmarks/head.py [--rows 1856] [--repeats 3]
"""

from __future__ import annotations

import argparse
import time

import torch

from tailrl.rl.algos import token_logprobs
from tailrl.rl.actor.logprobs import head_logprobs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1856, help="response tokens (the default run: 32 x 58)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--temperature", type=float, default=0.7)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    V, H, M = 49152, 576, args.rows
    w = (torch.randn(V, H, generator=g) * 0.05).requires_grad_()
    h = torch.randn(M, H, generator=g).requires_grad_()
    y = torch.randint(0, V, (M,), generator=g)
    T = args.temperature

    def chunked(entropy: bool):
        lp, ent = head_logprobs(h, w, y, T, compute_dtype=torch.bfloat16)
        return lp.sum() + (0.01 * ent.sum() if entropy else 0.0)

    def reference(entropy: bool):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = h @ w.T
        lp, ent = token_logprobs(logits.float()[None], y[None], T)
        return lp.sum() + (0.01 * ent.sum() if entropy else 0.0)

    variants = {"full logits, fp32 log-softmax": reference, "chunked head (rl/actor/logprobs.py)": chunked}
    best: dict[tuple[str, bool], float] = {}
    for _ in range(args.repeats):
        for entropy in (False, True):
            for name, fn in variants.items():
                h.grad = w.grad = None
                t = time.perf_counter()
                fn(entropy).backward()
                s = time.perf_counter() - t
                best[(name, entropy)] = min(best.get((name, entropy), s), s)
    print(f"{M} response rows, head {V} x {H}, bf16 matmuls, {torch.get_num_threads()} threads; forward + backward, "
          f"best of {args.repeats}\n")
    print("| path | loss: logp | loss: logp + entropy |")
    print("|---|---|---|")
    for name in variants:
        print(f"| {name} | {best[(name, False)]:.2f} s | {best[(name, True)]:.2f} s |")


if __name__ == "__main__":
    main()
