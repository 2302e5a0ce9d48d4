"""Attention metadata for one cached forward: which cache slot and position every new token writes,
and which cached or new tokens every query may see (causal, or an arbitrary draft-tree mask).

Everything is built with tensor operations on the target device, with no Python loop over sequences or tree
nodes: a tree is given as each row's parent row, and its ancestor mask comes from pointer doubling.

Two builders: `make_step` packs exactly the given tokens (prefill, and decode without buckets); a pass of whole
prompts from cache position 0 gets no mask at all (`causal`: the attention runs the causal kernel over the new
tokens). `make_padded_step` lays a decode/verify pass out on a fixed [seqs, tokens] grid from device tensors
alone, with no host sync, so a CUDA graph can capture it (engine/graphs.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import paged_attention
from .chunked import ROW_TILE, ChunkPlan, plan_chunks


@dataclass
class StepMeta:
    positions: torch.Tensor  # [T] RoPE positions of the new tokens (packed, sequence after sequence)
    token_slot: torch.Tensor  # [T] cache row (slot) each new token writes to
    token_pos: torch.Tensor  # [T] position in its row each new token writes to (the cache maps it to a block)
    slots: torch.Tensor  # [B] cache row of each sequence
    q_lens: list[int]
    max_q: int
    max_k: int
    pad_idx: torch.Tensor | None  # [T] index of each packed token in the padded [B * max_q] layout; None if uniform
    mask: torch.Tensor | None  # [B, 1, max_q, max_k] bool, True = may attend; None when causal
    depths: torch.Tensor | None = None  # [T] depth of each new token in its tree (root 0), when trees were given
    causal: bool = False  # every sequence starts at cache position 0 with no tree: causal among the new tokens only
    chunks: ChunkPlan | None = None  # batch-invariant attention over the sequences' own keys (model/chunked.py)
    row_tile: int = 0  # > 0: the pass's matrix products run on a whole number of tiles of this many rows
    lens: torch.Tensor | None = None  # [B, 2] (cache_len, q_len): an invariant pass read in place by our kernel

    @property
    def in_place(self) -> bool:
        """A batch-invariant pass whose attention our kernel reads from the cache (model/paged_attention.py)."""
        return self.row_tile > 0 and self.chunks is None

    @property
    def num_seqs(self) -> int:
        return len(self.q_lens)


def invariant_in_place(device) -> bool:
    """Whether a batch-invariant pass's attention is our kernel's, read in place from the cache (on a CPU where it
    builds, model/paged_attention.py), rather than over fixed key chunks (model/chunked.py)."""
    return torch.device(device).type == "cpu" and paged_attention.available()


def tree_ancestors(parents: torch.Tensor) -> torch.Tensor:
    """parents [B, Q]: the row index of each row's parent within its sequence (a root or a padded row points
    to itself). Returns [B, Q, Q] bool: [b, i, j] = row j is row i or one of its ancestors. Fixed-shape ops
    only (no one_hot, whose range check syncs with the host on CUDA)."""
    B, Q = parents.shape
    cols = torch.arange(Q, device=parents.device)
    anc = (cols.view(1, Q, 1) == cols.view(1, 1, Q)) | (parents.unsqueeze(-1) == cols.view(1, 1, Q))
    jump = parents
    for _ in range(max(math.ceil(math.log2(max(Q, 2))), 1)):
        anc = anc | anc.gather(1, jump.unsqueeze(-1).expand(B, Q, Q))
        jump = jump.gather(1, jump)
    return anc


def _tree_keys(anc: torch.Tensor, cache_lens: torch.Tensor, num_keys: int) -> torch.Tensor:
    """anc [B, Q, Q] over the new rows, placed at key columns cache_len .. cache_len + Q - 1: [B, Q, num_keys]."""
    B, Q, _ = anc.shape
    wide = torch.zeros(B, Q, num_keys + Q, dtype=torch.bool, device=anc.device)
    cols = cache_lens.view(B, 1, 1) + torch.arange(Q, device=anc.device).view(1, 1, Q)
    wide.scatter_(2, cols.expand(B, Q, Q), anc)
    return wide[:, :, :num_keys]


def make_step(
    cache_lens: list[int],
    q_lens: list[int],
    slots: list[int],
    device: torch.device | str = "cpu",
    positions: torch.Tensor | None = None,
    tree_masks: list[torch.Tensor | None] | None = None,
    tree_parents: torch.Tensor | None = None,
    causal: bool = True,
    invariant: bool = False,
) -> StepMeta:
    """Sequence b already holds cache_lens[b] tokens in cache slot slots[b] and adds q_lens[b] new tokens,
    written at cache indices cache_lens[b] .. cache_lens[b] + q_lens[b] - 1. Without a tree the new tokens are
    causal among themselves. A tree is either tree_parents [B, max_q] (see tree_ancestors; positions then
    become cache_len + depth) or per-sequence masks tree_masks[b][i, j] (new token i sees new token j).
    When every cache_len is 0 and there is no tree, the step is `causal` and carries no mask (causal=False
    builds the dense mask anyway: the path before the causal kernel, kept for benchmarks/gpu/cost.py).
    invariant: the batch-invariant pass (engine/invariant.py): matrix products on whole row tiles, and attention
    by our kernel read in place from the cache on a CPU (model/paged_attention.py: a mask for trees only, causal
    rows from `lens`), elsewhere (or without a C compiler) over each sequence's own keys in fixed chunks
    (model/chunked.py); slots need not be contiguous."""
    dev = torch.device(device)
    B = len(q_lens)
    cl = torch.tensor(cache_lens, dtype=torch.long, device=dev)
    ql = torch.tensor(q_lens, dtype=torch.long, device=dev)
    max_q, max_k = max(q_lens), max(c + q for c, q in zip(cache_lens, q_lens))
    seq_of_token = torch.repeat_interleave(torch.arange(B, device=dev), ql)
    starts = torch.cumsum(ql, 0) - ql
    offset = torch.arange(seq_of_token.shape[0], device=dev) - starts[seq_of_token]
    token_pos = cl[seq_of_token] + offset
    uniform = all(q == max_q for q in q_lens)
    pad_idx = None if uniform else seq_of_token * max_q + offset
    st = torch.tensor(slots, dtype=torch.long, device=dev)
    meta = dict(token_slot=st[seq_of_token], token_pos=token_pos, slots=st, q_lens=list(q_lens), max_q=max_q,
                max_k=max_k, pad_idx=pad_idx)
    is_tree = tree_parents is not None or tree_masks is not None
    if invariant and tree_masks is not None:
        raise ValueError("an invariant pass takes trees as tree_parents")
    if invariant and invariant_in_place(dev):
        positions = token_pos if positions is None else positions.to(dev)
        meta.update(row_tile=ROW_TILE, lens=torch.stack([cl, ql], 1), mask=None)
        if tree_parents is None:
            return StepMeta(positions=positions, **meta)
        causal = False  # the tree's mask, below
    elif invariant:
        anc = tree_ancestors(tree_parents.to(dev)) if tree_parents is not None else None
        depths = None
        if anc is not None:
            depths = (anc.sum(-1) - 1).reshape(-1)
            depths = depths if pad_idx is None else depths[pad_idx]
            positions = cl[seq_of_token] + depths
        return StepMeta(positions=token_pos if positions is None else positions.to(dev), mask=None, depths=depths,
                        chunks=plan_chunks(cache_lens, q_lens, slots, anc, dev), row_tile=ROW_TILE, **meta)
    if causal and not is_tree and not any(cache_lens):
        return StepMeta(positions=token_pos if positions is None else positions.to(dev), causal=True, mask=None,
                        **meta)

    i = torch.arange(max_q, device=dev).view(1, max_q, 1)
    j = torch.arange(max_k, device=dev).view(1, 1, max_k)
    c = cl.view(B, 1, 1)
    rel = j - c
    new = (rel >= 0) & (rel < ql.view(B, 1, 1))
    depths = None
    if tree_parents is not None:
        anc = tree_ancestors(tree_parents.to(dev))  # [B, max_q, max_q]
        mask = (j < c) | (new & _tree_keys(anc, cl, max_k))
        depths = (anc.sum(-1) - 1).reshape(-1)
        depths = depths if pad_idx is None else depths[pad_idx]
        positions = cl[seq_of_token] + depths
    else:
        mask = (j < c) | (new & (rel <= i))
    if tree_masks is not None:
        for b, tm in enumerate(tree_masks):
            if tm is not None:
                q = q_lens[b]
                mask[b, :q, cache_lens[b] : cache_lens[b] + q] = tm.to(device=dev, dtype=torch.bool)
    mask |= (i >= ql.view(B, 1, 1)) & (j == 0)  # padded query rows see one key: softmax stays finite
    meta["mask"] = mask.unsqueeze(1)
    return StepMeta(positions=token_pos if positions is None else positions.to(dev), depths=depths, **meta)


def make_padded_step(cache_lens: torch.Tensor, q_lens: torch.Tensor, parents: torch.Tensor | None, num_keys: int,
                     scratch: int) -> StepMeta:
    """A decode/verify pass on a fixed grid: sequence b (slot b, b < len(cache_lens)) owns rows b*Q .. b*Q + Q - 1,
    of which the first q_lens[b] are real (q_lens[b] = 0: a padded sequence in a free slot). parents [B, Q] as
    in tree_ancestors (None: Q = 1, plain decode). Keys are positions 0 .. num_keys - 1 of slots 0 .. B - 1.

    Invariants the caller keeps (ModelRunner asserts them): cache_len + q_len <= num_keys for every real sequence,
    and `scratch` (the last cache position) lies past every real token, cache_len + q_len <= scratch. A padded row
    writes its K/V to `scratch` of its slot and sees key 0 only, so no real query reads what padding wrote and
    every real row's K/V, logits and hidden state equal the unpadded pass's. Built from device tensors with
    fixed-shape ops only: nothing syncs with the host, so the step can be captured in a CUDA graph."""
    B = cache_lens.shape[0]
    Q = 1 if parents is None else parents.shape[1]
    dev = cache_lens.device
    rows = torch.arange(Q, device=dev)
    real = rows.view(1, Q) < q_lens.view(B, 1)  # [B, Q]
    if parents is None:
        anc = torch.ones(B, 1, 1, dtype=torch.bool, device=dev)
        depths = torch.zeros(B, 1, dtype=torch.long, device=dev)
    else:
        anc = tree_ancestors(parents)
        depths = anc.sum(-1) - 1
    c = cache_lens.view(B, 1)
    j = torch.arange(num_keys, device=dev).view(1, 1, num_keys)
    sees = (j < c.unsqueeze(-1)) | _tree_keys(anc, cache_lens, num_keys)
    mask = torch.where(real.unsqueeze(-1), sees, j == 0)
    flat_real = real.reshape(-1)
    return StepMeta(
        positions=torch.where(real, c + depths, 0).reshape(-1),
        token_slot=torch.arange(B, device=dev).view(B, 1).expand(B, Q).reshape(-1),
        token_pos=torch.where(flat_real, (c + rows.view(1, Q)).reshape(-1), scratch),
        slots=torch.arange(B, device=dev),
        q_lens=[Q] * B,
        max_q=Q,
        max_k=num_keys,
        pad_idx=None,
        mask=mask.unsqueeze(1),
        depths=None if parents is None else depths.reshape(-1),
    )
