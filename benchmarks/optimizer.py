"""AdamW kernels on the trainer's fp32 master (SmolLM2-135M): torch's default (foreach) against the fused kernel that
the trainer uses where it can (`rl/precision.make_adamw`), side by side in one run.

1. One optimizer step over the model's parameters with random gradients (mean of --steps, after one warm-up step).
2. A whole `policy_update` (bf16 compute copy, fp32 master) of 2 prompts x 8 default-like sequences (65-token prompts,
   30-96-token responses), 4 optimizer steps as in the default run (mini-batches of 4 here), the two optimizers
   interleaved per repeat; best of --repeats after a warm-up.

    .venv/bin/python benchmarks/optimizer.py [--steps 3 --repeats 3]
"""

from __future__ import annotations

import argparse
import random
import time
from types import SimpleNamespace

import torch

from tailrl.config import AlgoCfg
from tailrl.model import load_model
from tailrl.rl.actor.forward import make_batch
from tailrl.rl.actor.precision import Precision, make_adamw
from tailrl.rl.actor.update import policy_update


def default_like_batch(seed: int = 0):
    rng = random.Random(seed)
    comps = []
    for _ in range(2):
        prompt = [rng.randrange(1000, 40000) for _ in range(65)]
        for _ in range(8):
            resp = [rng.randrange(1000, 40000) for _ in range(rng.randint(30, 96))]
            comps.append(SimpleNamespace(prompt_token_ids=prompt, token_ids=resp, logprobs=[-1.0] * len(resp),
                                         finish_reason="stop"))
    return make_batch(comps, 0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.manual_seed(0)
    model, _ = load_model("smollm2-135m", device="cpu", dtype=torch.float32)
    model.requires_grad_(True)
    params = list(model.parameters())
    n = sum(p.numel() for p in params)

    def optimizers():
        return {"foreach (default)": torch.optim.AdamW(params, lr=1e-6, betas=(0.9, 0.99)),
                "fused": make_adamw(params, lr=1e-6, betas=(0.9, 0.99))}

    step_s = {}
    for name, opt in optimizers().items():
        for p in params:
            p.grad = torch.randn_like(p) * 1e-3
        opt.step()
        t = time.perf_counter()
        for _ in range(args.steps):
            opt.step()
        step_s[name] = (time.perf_counter() - t) / args.steps
    for p in params:
        p.grad = None
    batch = default_like_batch()
    adv = torch.randn(len(batch), generator=torch.Generator().manual_seed(1))
    algo = AlgoCfg(mini_batch_size=4, micro_batch_size=8)
    prec = Precision(model, "bfloat16")
    opts = optimizers()
    upd = {k: [] for k in opts}
    for rep in range(args.repeats + 1):
        for name, opt in opts.items():
            t = time.perf_counter()
            policy_update(prec, opt, None, batch, adv, algo, 0.7, random.Random(0), {})
            if rep:
                upd[name].append(time.perf_counter() - t)
    print(f"SmolLM2-135M fp32 master, {n / 1e6:.1f}M parameters; threads {torch.get_num_threads()}; update batch: "
          f"{len(batch)} sequences, {batch.tokens} tokens, 4 AdamW steps\n")
    print("| AdamW | step s | update s (each) | update best s | tokens/s |")
    print("|---|---|---|---|---|")
    for name in opts:
        best = min(upd[name])
        print(f"| {name} | {step_s[name]:.3f} | {', '.join(f'{x:.2f}' for x in upd[name])} | {best:.2f} | "
              f"{batch.tokens / best:.0f} |")
    a, b = list(opts)
    print(f"\nfused against foreach: step {step_s[a] / step_s[b]:.1f}x, update {min(upd[a]) / min(upd[b]):.2f}x")


if __name__ == "__main__":
    main()
