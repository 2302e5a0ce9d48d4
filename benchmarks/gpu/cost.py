"""Forward cost on the device it runs on (issue 11): what the selector's cost model sees, and the prefill kernel.

`cost`: one decode/verify pass of B sequences with k tokens each (the root and a k-1 node chain), k = 1..32 at
batch 1, 4 and 32, after a context of --ctx tokens. Two runners side by side: on CUDA, eager against CUDA graphs;
on CPU, eager unpadded against eager padded to the bucket (the padding's own cost: graphs need CUDA).
`prefill`: whole prompts from position 0, the causal kernel (SDPA is_causal over per-sequence padded q/k/v)
against the dense [N, 1, L, L] mask over the cache (the path before issue 11).

    .venv/bin/python benchmarks/gpu/cost.py cost [--model smollm2-135m|qwen2.5-1.5b|qwen3-8b] [--device cuda] [--ctx 200]
    .venv/bin/python benchmarks/gpu/cost.py cost --reps 3 --max-pass 128      # the CPU table (passes up to 128 tokens)
    .venv/bin/python benchmarks/gpu/cost.py prefill [--device cuda]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from models import DTYPES, default_dtype, describe, load_pair, sync

from tailrl.engine.buckets import pick_bucket
from tailrl.engine.runner import ModelRunner
from tailrl.model import make_step
from tailrl.speculative.tree import DraftTree

BATCHES = (1, 4, 32)
TOKENS = (1, 2, 4, 8, 16, 32)


def runner(model, B: int, ctx: int, graphs: bool, pad: bool) -> ModelRunner:
    r = ModelRunner(model, None, B, ctx + 64, cuda_graphs=graphs, graph_budget_bytes=8 * 2**30, pad=pad)
    r.kv.ensure(list(range(B)), ctx + 40)
    g = torch.Generator().manual_seed(B)
    prompts = torch.randint(0, model.config.vocab_size, (B, ctx), generator=g).tolist()
    for i in range(0, B, 4):  # prefill in small groups: the prefill's own size must not set the memory peak
        r.prefill(prompts[i : i + 4], list(range(i, min(i + 4, B))))
    return r


def time_pass(r: ModelRunner, B: int, k: int, ctx: int, reps: int, device: str) -> float:
    """Median ms of one pass (the first calls warm up and, with graphs, capture)."""
    g = torch.Generator().manual_seed(k)
    roots = torch.randint(0, r.model.config.vocab_size, (B,), generator=g).tolist()
    trees = [DraftTree.chain(torch.randint(0, 1000, (k - 1,), generator=g).tolist(), "chain") for _ in range(B)] \
        if k > 1 else None
    times = []
    for i in range(reps + 2):
        sync(device)
        t = time.perf_counter()
        r.decode(roots, [ctx] * B, trees)  # the same positions every time: the cache does not grow
        sync(device)
        if i >= 2:
            times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times)


def cost_table(model, device: str, ctx: int, reps: int, batches: list[int], max_pass: int) -> None:
    on_cuda = device.startswith("cuda")
    names = ("eager", "graphs") if on_cuda else ("eager", "padded eager")
    print(f"\nForward cost per pass (median of {reps}), context {ctx} tokens, chain drafts of k-1 nodes\n")
    print(f"| batch | k | tokens | bucket | {names[0]} ms | {names[1]} ms | {names[1]} / {names[0]} | "
          f"{names[1]} ms vs k=1 |")
    print("|---|---|---|---|---|---|---|---|")
    for B in batches:
        runners = [runner(model, B, ctx, graphs=False, pad=False),
                   runner(model, B, ctx, graphs=on_cuda, pad=not on_cuda)]
        base = None
        for k in [k for k in TOKENS if B * k <= max_pass]:
            a, b = (time_pass(r, B, k, ctx, reps, device) for r in runners)
            base = base or b
            bucket = pick_bucket(B, k, ctx + k, runners[1].num_slots, runners[1].capacity)
            print(f"| {B} | {k} | {B * k} | {bucket} | {a:.2f} | {b:.2f} | {b / a:.2f}x | {b / base:.2f}x |")
        if on_cuda:
            print(f"|  |  |  | graph pool: {runners[1].graphs.summary()} |  |  |  |  |")
        del runners
        if on_cuda:
            torch.cuda.empty_cache()


PREFILL_CASES = {"1 x 512": [512], "8 prompts, 40..200": [40, 60, 80, 100, 120, 150, 180, 200], "16 x 64": [64] * 16}


def prefill_table(model, device: str, reps: int) -> None:
    from tailrl.engine.kv_cache import KVCache

    kv = KVCache(model.config, 2**31, device, model.dtype)
    kv.layout(16, 528)
    kv.touch(528)
    g = torch.Generator().manual_seed(0)
    print(f"\nPrefill of whole prompts (median of {reps}; logits at each prompt's last token)\n")
    print("| prompts | tokens | causal kernel ms | dense mask ms | dense / causal | max abs logit diff |")
    print("|---|---|---|---|---|---|")
    for name, lens in PREFILL_CASES.items():
        ids = torch.randint(0, model.config.vocab_size, (sum(lens),), generator=g).to(device)
        slots = [2 * i % 16 + (2 * i // 16) for i in range(len(lens))]  # not contiguous, as group leaders are
        last = torch.tensor(lens, device=device).cumsum(0) - 1
        times, outs = {True: [], False: []}, {}
        for i in range(reps + 1):
            for causal in (True, False):  # interleaved: machine noise hits both alike
                step = make_step([0] * len(lens), lens, slots, device, causal=causal)
                sync(device)
                t = time.perf_counter()
                outs[causal] = model(ids, step, kv, logits_idx=last)[0]
                sync(device)
                if i:
                    times[causal].append(1000 * (time.perf_counter() - t))
        c, d = statistics.median(times[True]), statistics.median(times[False])
        diff = float((outs[True].float() - outs[False].float()).abs().max())
        print(f"| {name} | {sum(lens)} | {c:.1f} | {d:.1f} | {d / c:.2f}x | {diff:.1e} |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["cost", "prefill", "all"])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=list(DTYPES), default=None)
    ap.add_argument("--ctx", type=int, default=200)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    ap.add_argument("--max-pass", type=int, default=1 << 30, help="skip cells with more tokens in the pass (CPU)")
    args = ap.parse_args()
    dtype = args.dtype or default_dtype(args.device)
    if args.device == "cpu":
        torch.set_num_threads(2)
    model, _, _ = load_pair(args.model, args.device, dtype, hf=False)
    print(describe(args.model, args.device, dtype))
    with torch.inference_mode():
        if args.what in ("cost", "all"):
            cost_table(model, args.device, args.ctx, args.reps, args.batches, args.max_pass)
        if args.what in ("prefill", "all"):
            prefill_table(model, args.device, args.reps)


if __name__ == "__main__":
    main()
