"""What batch-invariant decoding (engine/invariant.py) costs, and what it buys: SmolLM2-135M in bf16 on this CPU,
four engines side by side (batch_invariant off/on x SD off/auto), the same prompts, seeds and sampling, epochs
interleaved. Epoch 0 fills the history drafter; the later epochs are timed.

Prints per arm the rollout seconds, tokens and tokens/s, and per invariant setting how many sampled responses
SD auto emitted exactly as SD off did (the property: all of them when invariant).

    .venv/bin/python benchmarks/invariant.py [--epochs 3] [--n 4] [--max-tokens 128]
"""

from __future__ import annotations

import argparse
import time

import torch

from tailrl.engine import Engine, EngineConfig, SamplingParams
from tailrl.model import load_model
from tailrl.spec.config import SpecConfig

from spec_rollout import prompts  # noqa: E402  (benchmarks/ is the script's folder)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=1.0)
    args = ap.parse_args()
    torch.set_num_threads(2)
    model, tok = load_model("smollm2-135m", device="cpu", dtype=torch.bfloat16)
    chats = prompts(tok)
    arms = {(inv, sd): Engine(model, tok, EngineConfig(kv_cache_gb=1.0, batch_invariant=inv,
                                                       spec=SpecConfig(mode=sd)))
            for inv in (False, True) for sd in ("off", "auto")}
    secs = {a: 0.0 for a in arms}
    toks = {a: 0 for a in arms}
    same = {inv: [0, 0] for inv in (False, True)}
    for epoch in range(args.epochs):
        params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, n=args.n, seed=100 + epoch)
        outs = {}
        for a, eng in arms.items():
            t = time.perf_counter()
            outs[a] = eng.generate(chats, params)
            if epoch:
                secs[a] += time.perf_counter() - t
                toks[a] += sum(len(o.token_ids) for o in outs[a])
        for inv in (False, True):
            pairs = list(zip(outs[(inv, "off")], outs[(inv, "auto")]))
            same[inv][0] += sum(p.token_ids == q.token_ids for p, q in pairs)
            same[inv][1] += len(pairs)
    print(f"\nSmolLM2-135M bf16, {len(chats)} prompts x {args.n}, max {args.max_tokens} tokens, T={args.temperature}; "
          f"epochs 1..{args.epochs - 1} timed (epoch 0 fills the history)\n")
    print("| batch_invariant | SD | rollout s | tokens | tokens/s | SD auto = SD off, responses |")
    print("|---|---|---|---|---|---|")
    for (inv, sd), s in secs.items():
        eq = f"{same[inv][0]} of {same[inv][1]}" if sd == "auto" else ""
        print(f"| {'on' if inv else 'off'} | {sd} | {s:.1f} | {toks[(inv, sd)]} | {toks[(inv, sd)] / s:.1f} | {eq} |")
    for sd in ("off", "auto"):
        r_on, r_off = toks[(True, sd)] / secs[(True, sd)], toks[(False, sd)] / secs[(False, sd)]
        print(f"\nSD {sd}: invariant / plain tokens/s = {r_on / r_off:.2f}x")


if __name__ == "__main__":
    main()
