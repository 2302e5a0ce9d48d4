"""What batch-invariant decoding (engine/invariant.py) costs, and what it buys: SmolLM2-135M in bf16 on this CPU.

1. The machine: its CPU flags and the start-up probe's verdict (engine/probe.py) with its time.
2. Decode passes alone: tokens/s of a plain decode step at batch 1, 8 and 64 (context 150), invariant against plain.
3. Rollouts: four engines side by side (batch_invariant off/on x SD off/auto), the same prompts, seeds and
   sampling, epochs interleaved; epoch 0 fills the history drafter and the later epochs are timed. Per arm the
   rollout seconds, tokens and tokens/s, and per invariant setting how many sampled responses SD auto emitted
   exactly as SD off did (the property: all of them when invariant). The defaults are the default run's rollout
   shape (n=8, 96 tokens, T=0.7).

    .venv/bin/python benchmarks/invariant.py [--epochs 3] [--n 8] [--max-tokens 96] [--temperature 0.7] [--threads 2]
"""

from __future__ import annotations

import argparse
import time

import torch

from tailrl.engine import Engine, EngineConfig, SamplingParams
from tailrl.engine.kv_cache import KVCache
from tailrl.engine.probe import probe_invariance
from tailrl.model import load_model, make_step
from tailrl.speculative.config import SpecConfig

from spec_rollout import prompts  # noqa: E402  (benchmarks/ is the script's folder)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--threads", type=int, default=2, help="1 where another job shares the 2 cores")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load_model("smollm2-135m", device="cpu", dtype=torch.bfloat16)
    machine(model)
    decode_steps(model)
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


def machine(model) -> None:
    with open("/proc/cpuinfo") as f:
        flags = set(next(line for line in f if line.startswith("flags")).split(":")[1].split())
        f.seek(0)
        name = next((line.split(":")[1].strip() for line in f if line.startswith("model name")), "?")
    shown = [x for x in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if x in flags]
    verdict = probe_invariance(model)
    print(f"CPU: {name}; flags: {' '.join(shown)}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"probe: {verdict.summary()} ({verdict.seconds:.2f} s)\n")


def decode_steps(model, context: int = 150, reps: int = 5) -> None:
    print("| batch | plain tok/s | invariant tok/s | invariant / plain |")
    print("|---|---|---|---|")
    for B in (1, 8, 64):
        kv = KVCache(model.config, 2 << 30, "cpu", torch.bfloat16)
        kv.layout(B, 256)
        ids = torch.randint(0, 1000, (B,))
        rate = {}
        with torch.inference_mode():
            for inv in (False, True, False, True):  # interleaved, the second round kept
                step = make_step([context] * B, [1] * B, list(range(B)), invariant=inv)
                model(ids, step, kv)
                t = time.perf_counter()
                for _ in range(reps):
                    model(ids, make_step([context] * B, [1] * B, list(range(B)), invariant=inv), kv)
                rate[inv] = B * reps / (time.perf_counter() - t)
        print(f"| {B} | {rate[False]:.1f} | {rate[True]:.1f} | {rate[True] / rate[False]:.2f}x |")
    print()


if __name__ == "__main__":
    main()
