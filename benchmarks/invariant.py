"""What batch-invariant decoding (engine/invariant.py) costs, and what it buys: SmolLM2-135M in bf16 on this CPU.

1. The machine: its CPU flags and the start-up probe's verdict (engine/probe.py) with its time.
2. Passes alone: tokens/s of a decode step at batch 1, 8 and 64 (context 150) and of prefills (8 x 256, 1 x 2,048),
   plain against invariant with our kernel in place (the CPU default) and invariant over key chunks (the fallback).
3. Rollouts: four engines side by side (batch_invariant off/on x SD off/auto), the same prompts, seeds and
   sampling, epochs interleaved; epoch 0 fills the history drafter and the later epochs are timed. Per arm the
   rollout seconds, tokens and tokens/s, and per invariant setting how many sampled responses SD auto emitted
   exactly as SD off did (the property: all of them when invariant). The defaults are the default run's rollout
   shape (n=8, 96 tokens, T=0.7).

    .venv/bin/python benchmarks/invariant.py [--epochs 3] [--n 8] [--max-tokens 96] [--temperature 0.7] [--threads 2]
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch

from tailrl.engine import Engine, EngineConfig, SamplingParams
from tailrl.engine.kv_cache import KVCache
from tailrl.engine.probe import probe_invariance
from tailrl.model import load_model, make_step, paged_attention
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


@contextlib.contextmanager
def chunked_route():
    """The invariant passes' attention over 256-key chunks on PyTorch's flash kernel (model/chunked.py), as where our
    C kernel cannot be built."""
    lib = paged_attention._LIB[:]
    paged_attention._LIB[:] = [None]
    try:
        yield
    finally:
        paged_attention._LIB[:] = lib


ROUTES = ("plain", "in place", "chunked")


def _rate(model, kv, ids, step_args, route, reps) -> float:
    """Tokens/s of one pass shape on a route, the second of two interleaved rounds kept by the caller."""
    inv = route != "plain"
    with chunked_route() if route == "chunked" else contextlib.nullcontext():
        model(ids, make_step(*step_args, invariant=inv), kv)
        t = time.perf_counter()
        for _ in range(reps):
            model(ids, make_step(*step_args, invariant=inv), kv)
        return len(ids) * reps / (time.perf_counter() - t)


def decode_steps(model, context: int = 150, reps: int = 5) -> None:
    """Decode passes (batch 1, 8, 64 at `context`) and prefill passes (8 prompts of 256, one of 2,048), tokens/s per
    route: plain, invariant with our kernel in place (the CPU default), invariant over key chunks (the fallback)."""
    print("| pass | plain tok/s | invariant, in place | invariant, chunked | in place / plain | chunked / plain |")
    print("|---|---|---|---|---|---|")
    shapes = [(f"decode, batch {B}", [context] * B, [1] * B) for B in (1, 8, 64)]
    shapes += [("prefill, 8 x 256", [0] * 8, [256] * 8), ("prefill, 1 x 2,048", [0], [2048])]
    for name, cache, q in shapes:
        B = len(q)
        kv = KVCache(model.config, 2 << 30, "cpu", torch.bfloat16)
        kv.layout(B, max(c + n for c, n in zip(cache, q)) + 16)
        ids = torch.randint(0, 1000, (sum(q),))
        rate = {}
        with torch.inference_mode():
            for _ in range(2):  # interleaved, the second round kept
                for route in ROUTES:
                    rate[route] = _rate(model, kv, ids, (cache, q, list(range(B))), route, reps if q[0] == 1 else 2)
        print(f"| {name} | {rate['plain']:.1f} | {rate['in place']:.1f} | {rate['chunked']:.1f} | "
              f"{rate['in place'] / rate['plain']:.2f}x | {rate['chunked'] / rate['plain']:.2f}x |")
    print()


if __name__ == "__main__":
    main()
