"""Our paged decode/verify attention kernel (model/csrc/paged_attention.c) against the route it replaces: gather each
sequence's blocks into a dense copy, then the grouped SDPA the engine's gather path runs (model/llama.py).

SmolLM2-135M's attention shapes (9 query heads, 3 K/V heads, head dim 64), 16-token blocks handed out in shuffled
order (a pool after a few rollouts), Q query rows a sequence (1: decode; 2-17: a verify pass, causal among the
draft's rows). Per case: milliseconds of one layer's attention in process time (the figure that survives a shared
machine), the ratio, the kernel's rate of reading K and V, and the largest difference between the two routes.

    .venv/bin/python benchmarks/decode_attention.py [--threads 1] [--dtype float32] [--cases 32x1024 16x256 4x1024]
                                                    [--rows 1 2 5 9 17]
"""

from __future__ import annotations

import argparse
import time

import torch

from tailrl.model import paged_attention as PA
from tailrl.model.llama import _grouped_attention

H, KVH, D, BLOCK = 9, 3, 64, 16


def setup(B: int, K: int, Q: int, dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    per = -(-K // BLOCK)
    n = B * per + 1
    pool_k = torch.randn(KVH, n, BLOCK, D, generator=g).to(dtype)
    pool_v = torch.randn(KVH, n, BLOCK, D, generator=g).to(dtype)
    table = (torch.randperm(n - 1, generator=g) + 1).view(B, per)
    q = torch.randn(B, Q, H, D, generator=g).to(dtype)
    mask = torch.ones(B, Q, K, dtype=torch.bool)
    for i in range(Q):  # the draft's rows: causal among the last Q keys
        mask[:, i, K - Q + i + 1:] = False
    return q, pool_k, pool_v, table, torch.arange(B), mask


def gather_sdpa(q, pool_k, pool_v, table, mask):
    B, Q, _, _ = q.shape
    K = mask.shape[-1]
    idx = table.reshape(-1)
    k = pool_k.index_select(1, idx).view(KVH, B, -1, D)[:, :, :K].transpose(0, 1)
    v = pool_v.index_select(1, idx).view(KVH, B, -1, D)[:, :, :K].transpose(0, 1)
    return _grouped_attention(q.transpose(1, 2), k, v, mask.unsqueeze(1)).transpose(1, 2)


def process_ms(fn, reps: int) -> float:
    fn()
    t = time.process_time()
    for _ in range(reps):
        fn()
    return (time.process_time() - t) / reps * 1000


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--cases", nargs="+", default=["32x1024", "16x256", "4x1024"], help="sequences x keys")
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 2, 5, 9, 17], help="query rows a sequence")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not PA.available():
        raise SystemExit(f"the kernel is not available: {PA._WHY[0]}")
    dtype = getattr(torch, args.dtype)
    print(f"{args.dtype}, {args.threads} thread(s); process time of one layer's attention")
    print("| sequences x keys | rows | gather + SDPA ms | our kernel ms | kernel / gather | kernel reads K+V at | max diff |")
    print("|---|---|---|---|---|---|---|")
    with torch.inference_mode():
        for case in args.cases:
            B, K = map(int, case.split("x"))
            for Q in args.rows:
                q, pk, pv, table, slots, mask = setup(B, K, Q, dtype)
                ours = PA.paged_attention(q, pk, pv, table, slots, mask)
                diff = float((ours.float() - gather_sdpa(q, pk, pv, table, mask).float()).abs().max())
                reps = max(3, 3000 // (B * Q))
                g_ms = process_ms(lambda: gather_sdpa(q, pk, pv, table, mask), reps)
                k_ms = process_ms(lambda: PA.paged_attention(q, pk, pv, table, slots, mask), reps)
                gbs = 2 * B * K * KVH * D * pk.element_size() / (k_ms / 1000) / 1e9
                print(f"| {B} x {K} | {Q} | {g_ms:.2f} | {k_ms:.2f} | {k_ms / g_ms:.2f}x | {gbs:.1f} GB/s | {diff:.2g} |",
                      flush=True)


if __name__ == "__main__":
    main()
