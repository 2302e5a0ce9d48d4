"""Which kernel reads a paged KV cache fastest for decode on this machine: the engine's gather into SDPA against
PyTorch's FlexAttention over the pool with a paged block mask (issue 34's "choose the kernel by measurement").

SmolLM2-135M's attention shapes (9 query heads, 3 K/V heads, head dim 64), bf16, one decode token per sequence,
16-token blocks handed out in shuffled order (as a pool looks after a few rollouts). Per (batch, context):
- gather + SDPA: each sequence's blocks up to the longest gathered into [B, kv_heads, S, D], a length mask, SDPA
  (the engine's dense pass, engine/kv_cache.py `keys`);
- FlexAttention: the pool viewed as one sequence [1, kv_heads, blocks * 16, D] (no copy: our pools are head-major),
  the logical length mask turned into a physical block mask through the block tables
  (`torch.nn.attention.experimental._paged_attention.PagedAttention`), `flex_attention` under `torch.compile`.
Both results are checked against each other before timing.

    .venv/bin/python benchmarks/paged_attention.py [--threads 2] [--cases 64x150 16x1000 1x4000]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch.nn.attention.experimental._paged_attention import PagedAttention
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

H, KVH, D, BLOCK = 9, 3, 64, 16


def setup(B: int, L: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    per = -(-L // BLOCK)
    n = B * per + 1
    pool_k = torch.randn(KVH, n, BLOCK, D, generator=g).to(torch.bfloat16)
    pool_v = torch.randn(KVH, n, BLOCK, D, generator=g).to(torch.bfloat16)
    perm = torch.randperm(n - 1, generator=g) + 1
    tables = perm.view(B, per)
    lens = torch.randint(max(L // 2, 1), L + 1, (B,), generator=g)
    q = torch.randn(B, H, 1, D, generator=g).to(torch.bfloat16)
    return q, pool_k, pool_v, tables, lens


def gather_sdpa(q, pool_k, pool_v, tables, lens):
    B, per = tables.shape
    idx = tables.reshape(-1)
    k = pool_k.index_select(1, idx).view(KVH, B, per * BLOCK, D).transpose(0, 1)
    v = pool_v.index_select(1, idx).view(KVH, B, per * BLOCK, D).transpose(0, 1)
    mask = (torch.arange(per * BLOCK) < lens.view(-1, 1)).view(B, 1, 1, -1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def flex_setup(tables, lens, n_blocks):
    B, per = tables.shape
    pa = PagedAttention(n_blocks, BLOCK, B, device="cpu")
    pa.page_table[:, :per] = tables
    for b in range(B):
        pa.physical_to_logical[b, tables[b]] = torch.arange(per)
    pa.capacity[:] = per * BLOCK

    def length(b, h, q_idx, kv_idx):
        return kv_idx < lens[b]

    logical = create_block_mask(length, B, None, 1, per * BLOCK, device="cpu", BLOCK_SIZE=(1, BLOCK))
    return pa.convert_logical_block_mask(logical), pa.get_mask_mod(length)


def timed(fn, reps: int) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps * 1000


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cases", nargs="+", default=["64x150", "16x1000", "1x4000"])
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    flex = torch.compile(flex_attention, dynamic=False)
    print("| batch x context | gather + SDPA ms | FlexAttention ms (compiled) | flex / gather | max abs diff | compile s |")
    print("|---|---|---|---|---|---|")
    for case in args.cases:
        B, L = map(int, case.split("x"))
        q, pk, pv, tables, lens = setup(B, L)
        n = pk.shape[1]
        with torch.inference_mode():
            ref = gather_sdpa(q, pk, pv, tables, lens)
            mask, mod = flex_setup(tables, lens, n)
            kf, vf = pk.view(1, KVH, n * BLOCK, D), pv.view(1, KVH, n * BLOCK, D)
            t = time.perf_counter()
            out = flex(q, kf, vf, block_mask=mask, enable_gqa=True)
            compile_s = time.perf_counter() - t
            diff = float((out.float() - ref.float()).abs().max())
            g_ms = timed(lambda: gather_sdpa(q, pk, pv, tables, lens), args.reps)
            f_ms = timed(lambda: flex(q, kf, vf, block_mask=mask, enable_gqa=True), args.reps)
        print(f"| {B} x {L} | {g_ms:.2f} | {f_ms:.2f} | {f_ms / g_ms:.2f}x | {diff:.3g} | {compile_s:.0f} |", flush=True)


if __name__ == "__main__":
    main()
