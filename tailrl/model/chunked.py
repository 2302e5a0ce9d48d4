"""Batch-invariant attention over each sequence's own keys, in fixed chunks at absolute offsets (split-KV with a
fixed split, as the deterministic modes of SGLang and vLLM and Thinking Machines' batch-invariant kernels do), on
library kernels: the invariant passes' route off a CPU, and on a CPU where our C kernel cannot be built (on a CPU
they read the cache in place with it, model/paged_attention.py: 1.3-2.2x this route's decode speed at 8-64
sequences, benchmarks/RESULTS.md section 5).

A row's attention must give the same bits whatever else shares its pass (other sequences, draft rows, a prefill of
the whole prompt) and however long the cache is laid out. Library kernels choose their blocking, packing and
threading from the shapes of a call (PyTorch's CPU flash kernel packs for AMX only above 64 query rows and by a
per-thread work ratio that counts the batch; its key block is min(512, keys)), so no call here has a shape that
depends on the pass:

- keys are read in chunks of CHUNK positions at absolute offsets (0..255, 256..511, ...), each chunk one kernel
  item of exactly CHUNK keys (one key block of the CPU kernel); a sequence reads only the chunks its own tokens
  reach, so the cost grows with what it holds, not with the cache's capacity or `max_tokens`;
- queries go in blocks of QUERY_BLOCK tokens (the group of query heads that share a K/V head stacked): a decode
  row, a draft row and a prefill row are each one row of such a block, at the same key chunks. The blocks of one
  sequence that read the same chunk (a verify pass's 8 or 16 rows, a prefill's) are one kernel item of up to FOLD
  blocks, and never of PACK_ROWS query rows or more (`kernel_split`: fewer blocks an item, and for a group of 16+
  query heads a K/V head, the group's heads split over the kernel's head axis): from PACK_ROWS rows the CPU kernel
  may take its AMX path, which computes with other kernels than the path a one-block item takes. The kernel
  computes a row the same in an item of one block or of several (the probe checks it), and a deep draft then costs
  one larger product per chunk instead of one item per block;
- the chunks' partial results are merged per row by log-sum-exp in ascending chunk order with elementwise ops whose
  transcendental parts run through one scalar path (`_exp`, `_log1p`), so no element's bits depend on where a
  vectorised loop's tail fell. A chunk a row does not see (past its own position) is an exact no-op in the merge.

Masked keys must hold finite values (a fully masked key still multiplies its value by 0): the cache is zeroed
before it is read. The start-up probe (engine/probe.py) checks on the kernels of the running process that items
do not depend on the batch of the call, on the other rows of their block, or on a row's place in it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .packed import packed_linear

CHUNK = 256  # keys per kernel item (<= the CPU flash kernel's 512-key block: one block per item)
QUERY_BLOCK = 4  # query tokens per block (the unit of a row's attention work)
FOLD = 5  # at most this many blocks of one sequence share a kernel item (fewer where the rows would reach PACK_ROWS)
# PyTorch's CPU flash kernel (aten/src/ATen/native/cpu/FlashAttentionKernel.cpp, cpu_flash_attention, the `need_pack`
# block: lines 431-447 at pytorch commit 27a4844d7fb) packs K and V and computes with oneDNN brgemm instead of its
# plain gemm when `cpublas::could_pack(bf16)` (oneDNN's effective ISA is AMX and mkldnn is enabled) and
# `qSize >= 64 && kvSize >= 64` and a per-thread work ratio >= 4 that counts batch * heads and the thread count. Every
# item reads CHUNK >= 64 keys, so an item's query rows decide it: items stay below this many rows.
PACK_ROWS = 64
ROW_TILE = 16  # matrix products of an invariant pass run on a whole number of tiles of this many rows
UNSEEN = -1e30  # log-sum-exp of a row that sees no key of a chunk: exp(UNSEEN - x) is exactly 0 for finite x


@dataclass
class ChunkCall:
    """One kernel call: n items of `blocks` query blocks each (consecutive blocks of one sequence), against one chunk
    of that sequence's keys. Every layer of the pass makes it; what does not change between layers is built once
    (`bias`)."""

    pairs: torch.Tensor  # [n] (sequence, chunk) pair of each item
    rows: torch.Tensor  # [n, blocks * QUERY_BLOCK] packed token index of each query row (T: a zero row, padding)
    mask: torch.Tensor  # [n, 1, blocks * QUERY_BLOCK, CHUNK] bool, True = the row sees that key
    blocks: int = 1
    _bias: dict = None  # dtype -> (additive mask [n, 1, R, CHUNK] for `group` query heads a row, seen [n, 1, R])

    def bias(self, group: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows in (block, head in group, token) order: each block's rows as a one-block item lays them out."""
        if self._bias is None:
            self._bias = {}
        if dtype not in self._bias:
            n, m = self.rows.shape[0], self.blocks
            mask = self.mask.view(n, 1, m, 1, QUERY_BLOCK, CHUNK).expand(n, 1, m, group, QUERY_BLOCK, CHUNK)
            mask = mask.reshape(n, 1, m * group * QUERY_BLOCK, CHUNK)
            bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
            self._bias[dtype] = (bias, mask.any(-1))
        return self._bias[dtype]


@dataclass
class ChunkPlan:
    pair_slot: torch.Tensor  # [P] cache slot of each (sequence, chunk) pair the pass reads
    pair_chunk: torch.Tensor  # [P] chunk index of each pair
    calls: list[ChunkCall]
    grid: torch.Tensor  # [G, C] item (in call order; I = none) of query block g at chunk c
    token_rows: torch.Tensor  # [T] each packed token's row in the merged [G * QUERY_BLOCK] layout


def plan_chunks(cache_lens: list[int], q_lens: list[int], slots: list[int], anc: torch.Tensor | None,
                device) -> ChunkPlan:
    """Sequence b holds cache_lens[b] tokens in slot slots[b] and adds q_lens[b] new ones at key indices
    cache_len .. cache_len + q_len - 1. anc [B, max_q, max_q] (new row i sees new row j), or None: causal.
    Query block j of b reads chunks 0 .. (its last row's key index) // CHUNK."""
    dev = torch.device(device)
    pair_ids: dict[tuple[int, int], int] = {}
    per_pair: dict[int, list[tuple[int, int, int]]] = {}  # pair -> items (b, j, c)
    blocks, token_rows, starts = [], [], []
    start = 0
    for b, (cl, q) in enumerate(zip(cache_lens, q_lens)):
        starts.append(start)
        for j in range(-(-q // QUERY_BLOCK)):
            g = len(blocks)
            last = cl + min(q, (j + 1) * QUERY_BLOCK) - 1
            chunks = []
            for c in range(last // CHUNK + 1):
                p = pair_ids.setdefault((b, c), len(pair_ids))
                per_pair.setdefault(p, []).append((b, j, c))
                chunks.append(p)
            blocks.append(chunks)
            token_rows.extend(range(g * QUERY_BLOCK, g * QUERY_BLOCK + min(QUERY_BLOCK, q - j * QUERY_BLOCK)))
        start += q
    T = start
    cl_t = torch.tensor(cache_lens, dtype=torch.long, device=dev)
    ql_t = torch.tensor(q_lens, dtype=torch.long, device=dev)
    st_t = torch.tensor(starts, dtype=torch.long, device=dev)
    keys = list(pair_ids)
    by_size: dict[int, list[tuple[int, list]]] = {}  # blocks an item -> its items (pair, [(b, j, c) ...])
    for p, items in per_pair.items():  # a pair's query blocks are consecutive (later blocks reach more chunks)
        for i in range(0, len(items), FOLD):
            part = items[i : i + FOLD]
            by_size.setdefault(len(part), []).append((p, part))
    calls, item_of = [], {}
    for m, folded in sorted(by_size.items()):
        flat = [it for _, part in folded for it in part]
        for it in flat:
            item_of[it] = len(item_of)
        rows, mask = _rows_and_mask(torch.tensor(flat, dtype=torch.long, device=dev), cl_t, ql_t, st_t, anc, T)
        n = len(folded)
        calls.append(ChunkCall(torch.tensor([p for p, _ in folded], dtype=torch.long, device=dev),
                               rows.view(n, m * QUERY_BLOCK), mask.view(n, 1, m * QUERY_BLOCK, CHUNK), m))
    n_items = len(item_of)
    width = max(len(ch) for ch in blocks)
    grid = torch.full((len(blocks), width), n_items, dtype=torch.long)
    g = 0
    for b, q in enumerate(q_lens):
        for j in range(-(-q // QUERY_BLOCK)):
            for c in range(len(blocks[g])):
                grid[g, c] = item_of[(b, j, c)]
            g += 1
    return ChunkPlan(torch.tensor([slots[b] for b, _ in keys], dtype=torch.long, device=dev),
                     torch.tensor([c for _, c in keys], dtype=torch.long, device=dev), calls, grid.to(dev),
                     torch.tensor(token_rows, dtype=torch.long, device=dev))


def kernel_split(group: int) -> tuple[int, int]:
    """(query heads of a K/V head's group that share a kernel item, blocks an item holds at most): an item has
    heads * QUERY_BLOCK * blocks < PACK_ROWS query rows, whatever the model's group (SmolLM2's 3 heads: 5 blocks of
    12 rows; Llama-3.2's 4: 3 of 16; Qwen2.5-0.5B's 7: 2 of 28; a group of 16 or more is split over the kernel's
    head axis, which the kernel maps to the shared K/V head)."""
    heads = max(d for d in range(1, group + 1) if group % d == 0 and d * QUERY_BLOCK < PACK_ROWS)
    return heads, max(1, min(FOLD, (PACK_ROWS - 1) // (heads * QUERY_BLOCK)))


def _rows_and_mask(bjc, cl, ql, starts, anc, T):
    b, j, c = bjc.unbind(1)
    t = j.view(-1, 1) * QUERY_BLOCK + torch.arange(QUERY_BLOCK, device=bjc.device)  # [n, QB] row in its sequence
    real = t < ql[b].view(-1, 1)
    rows = torch.where(real, starts[b].view(-1, 1) + t, T)
    rel = (c.view(-1, 1, 1) * CHUNK + torch.arange(CHUNK, device=bjc.device)) - cl[b].view(-1, 1, 1)  # [n, 1, S]
    new = (rel >= 0) & (rel < ql[b].view(-1, 1, 1))
    if anc is None:
        sees_new = rel <= t.unsqueeze(-1)
    else:
        Q = anc.shape[1]
        a = anc[b.view(-1, 1), t.clamp(max=Q - 1)]  # [n, QB, Q]
        sees_new = a.gather(2, rel.clamp(0, Q - 1).expand(-1, QUERY_BLOCK, -1))
    mask = ((rel < 0) | (new & sees_new)) & real.unsqueeze(-1)
    return rows, mask.unsqueeze(1)


def _exp(x: torch.Tensor) -> torch.Tensor:
    """exp with every element through the same scalar code: a strided output keeps the CPU loop from vectorising,
    whose tail elements would otherwise take another code path than the rest, by the tensor's size."""
    if x.device.type != "cpu":
        return torch.exp(x)
    out = torch.empty(x.numel(), 2, dtype=x.dtype)[:, 0]
    return torch.exp(x.reshape(-1), out=out).view(x.shape)


def _log1p(x: torch.Tensor) -> torch.Tensor:
    if x.device.type != "cpu":
        return torch.log1p(x)
    out = torch.empty(x.numel(), 2, dtype=x.dtype)[:, 0]
    return torch.log1p(x.reshape(-1), out=out).view(x.shape)


def kernel(q, keys, vals, mask, bias=None):
    """(out [n, h, R, D], log-sum-exp [n, h, R] fp32) of one call; the CPU's flash kernel, which returns both.
    bias: the additive form of mask (bool, True = seen), when the caller has it."""
    if bias is None:
        bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
    if q.device.type == "cpu":
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, keys, vals, 0.0, False, attn_mask=bias)
        return o, lse
    o, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, keys, vals, bias.expand(*q.shape[:3], -1),
                                                                      True)[:2]
    return o, lse[..., : q.shape[2]]


def chunked_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, plan: ChunkPlan,
                      blocks: list[torch.Tensor]) -> torch.Tensor:
    """q [T, heads, D] packed; k/v_pool [kv_heads, num_blocks, block, D], a paged cache whose block size divides
    CHUNK; blocks[i]: the pool blocks of call i's items' key chunks, item after item. Returns [T, heads * D]."""
    T, H, D = q.shape
    kvh = k_pool.shape[0]
    group = H // kvh
    R = group * QUERY_BLOCK
    heads, fold = kernel_split(group)
    s = group // heads  # kernel heads a K/V head (1 but for groups of 16+)
    qz = torch.cat([q, q.new_zeros(1, H, D)])
    outs, lses = [], []
    for call, blk in zip(plan.calls, blocks):
        n, m = call.rows.shape[0], call.blocks
        # [n, kv head, sub-group, block, head in sub-group, token, D]: a kernel item is (n, kv head * s + sub-group)
        qi = qz[call.rows].view(n, m, QUERY_BLOCK, kvh, s, heads, D).permute(0, 3, 4, 1, 5, 2, 6)
        # an item's chunk: its blocks gathered in order, per head [n, CHUNK, D], viewed as [n, kv_heads, CHUNK, D]
        keys, vals = (p.index_select(1, blk).view(kvh, -1, CHUNK, D).transpose(0, 1) for p in (k_pool, v_pool))
        bias, seen = call.bias(heads, q.dtype)
        rows = heads * QUERY_BLOCK
        o, lse = [], []
        for b in range(0, m, fold):  # items of at most `fold` blocks: below PACK_ROWS query rows
            e = min(m, b + fold)
            ob, lb = kernel(qi[:, :, :, b:e].reshape(n, kvh * s, (e - b) * rows, D), keys, vals, None,
                            bias[:, :, b * rows : e * rows])
            o.append(ob.view(n, kvh, s, e - b, heads, QUERY_BLOCK, D))
            lse.append(lb.view(n, kvh, s, e - b, heads, QUERY_BLOCK))
        o, lse = (x[0] if len(x) == 1 else torch.cat(x, 3) for x in (o, lse))
        lse = torch.where(seen.view(n, 1, 1, m, heads, QUERY_BLOCK), lse, UNSEEN)
        # an item of m blocks -> m one-block items of R rows in (head in group, token) order, as the merge counts them
        outs.append(o.permute(0, 3, 1, 2, 4, 5, 6).reshape(n * m, kvh, R, D).float())
        lses.append(lse.permute(0, 3, 1, 2, 4, 5).reshape(n * m, kvh, R))
    outs.append(q.new_zeros(1, kvh, R, D, dtype=torch.float32))
    lses.append(torch.full((1, kvh, R), UNSEEN, device=q.device))
    O, L = torch.cat(outs), torch.cat(lses)
    acc_o, acc_l = O[plan.grid[:, 0]], L[plan.grid[:, 0]]
    for c in range(1, plan.grid.shape[1]):  # ascending chunks; a row's later unseen chunks change nothing
        o_c, l_c = O[plan.grid[:, c]], L[plan.grid[:, c]]
        top = torch.maximum(acc_l, l_c)
        new_l = top + _log1p(_exp(-(acc_l - l_c).abs()))
        w_acc, w_c = _exp(acc_l - new_l), _exp(l_c - new_l)
        acc_o = acc_o * w_acc.unsqueeze(-1) + o_c * w_c.unsqueeze(-1)
        acc_l = new_l
    G = acc_o.shape[0]
    out = acc_o.to(q.dtype).view(G, kvh, group, QUERY_BLOCK, D).permute(0, 3, 1, 2, 4).reshape(G * QUERY_BLOCK, H * D)
    return out[plan.token_rows]


def pad_rows(x: torch.Tensor, tile: int) -> torch.Tensor:
    """x [N, ...] with zero rows appended up to a whole number of tiles (at least one)."""
    n = x.shape[0]
    m = max(-(-n // tile), 1) * tile
    return x if m == n else torch.cat([x, x.new_zeros(m - n, *x.shape[1:])])


def in_calls(layer, x: torch.Tensor) -> torch.Tensor:
    """layer(x) in calls of at most `layer.call_rows` rows (whole tiles; the start-up probe sets it per weight
    shape, engine/probe.py), a torch Linear's through its packed weight in every call (model/packed.py): on an Intel
    CPU with AMX, a product of 1,536 inner columns rounded every tile otherwise in calls of 160 rows or more than in a
    tile's own call, and one of 4,864 columns (Qwen2.5-0.5B's) from 32-48 rows. Without the attribute (the probe did
    not run) one call."""
    run = (lambda t: packed_linear(layer, t, max_rows=None)) if isinstance(layer, torch.nn.Linear) else layer
    n = getattr(layer, "call_rows", 0)
    if not n or x.shape[0] <= n:
        return run(x)
    return torch.cat([run(x[i : i + n]) for i in range(0, x.shape[0], n)])


def tiled_linear(layer: torch.nn.Linear, x: torch.Tensor, tile: int) -> torch.Tensor:
    """layer(x) computed on x's rows padded to a whole number of tiles, in calls of at most `layer.call_rows` rows:
    the product's shape class never depends on how many rows the pass has below a tile (a kernel picks other code
    for few rows)."""
    return in_calls(layer, pad_rows(x, tile))[: x.shape[0]]
