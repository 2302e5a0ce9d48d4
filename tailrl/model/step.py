"""Attention metadata for one cached forward: which cache slot and position every new token writes,
and which cached or new tokens every query may see (causal, or an arbitrary draft-tree mask).

Everything is built with tensor operations on the target device, with no Python loop over sequences or tree
nodes: a tree is given as each row's parent row, and its ancestor mask comes from pointer doubling."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class StepMeta:
    positions: torch.Tensor  # [T] RoPE positions of the new tokens (packed, sequence after sequence)
    token_slot: torch.Tensor  # [T] cache slot each new token writes to
    token_pos: torch.Tensor  # [T] cache index each new token writes to
    slots: torch.Tensor  # [B] cache slot of each sequence
    slot_range: tuple[int, int] | None  # slots are start..end-1 in order: keys are a view, not a gather
    q_lens: list[int]
    max_q: int
    max_k: int
    pad_idx: torch.Tensor | None  # [T] index of each packed token in the padded [B * max_q] layout; None if uniform
    mask: torch.Tensor  # [B, 1, max_q, max_k] bool, True = may attend
    depths: torch.Tensor | None = None  # [T] depth of each new token in its tree (root 0), when trees were given

    @property
    def num_seqs(self) -> int:
        return len(self.q_lens)


def tree_ancestors(parents: torch.Tensor) -> torch.Tensor:
    """parents [B, Q]: the row index of each row's parent within its sequence (a root or a padded row points
    to itself). Returns [B, Q, Q] bool: [b, i, j] = row j is row i or one of its ancestors."""
    B, Q = parents.shape
    eye = torch.eye(Q, dtype=torch.bool, device=parents.device).expand(B, Q, Q)
    anc = eye | torch.nn.functional.one_hot(parents, Q).bool()
    jump = parents
    for _ in range(max(math.ceil(math.log2(max(Q, 2))), 1)):
        anc = anc | anc.gather(1, jump.unsqueeze(-1).expand(B, Q, Q))
        jump = jump.gather(1, jump)
    return anc


def make_step(
    cache_lens: list[int],
    q_lens: list[int],
    slots: list[int],
    device: torch.device | str = "cpu",
    positions: torch.Tensor | None = None,
    tree_masks: list[torch.Tensor | None] | None = None,
    tree_parents: torch.Tensor | None = None,
) -> StepMeta:
    """Sequence b already holds cache_lens[b] tokens in cache slot slots[b] and adds q_lens[b] new tokens,
    written at cache indices cache_lens[b] .. cache_lens[b] + q_lens[b] - 1. Without a tree the new tokens are
    causal among themselves. A tree is either tree_parents [B, max_q] (see tree_ancestors; positions then
    become cache_len + depth) or per-sequence masks tree_masks[b][i, j] (new token i sees new token j)."""
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

    i = torch.arange(max_q, device=dev).view(1, max_q, 1)
    j = torch.arange(max_k + max_q, device=dev).view(1, 1, max_k + max_q)
    c = cl.view(B, 1, 1)
    rel = j - c
    new = (rel >= 0) & (rel < ql.view(B, 1, 1))
    depths = None
    if tree_parents is not None:
        anc = tree_ancestors(tree_parents.to(dev))  # [B, max_q, max_q]
        wide = torch.zeros(B, max_q, max_k + max_q, dtype=torch.bool, device=dev)
        wide.scatter_(2, (c + torch.arange(max_q, device=dev).view(1, 1, max_q)).expand(B, max_q, max_q), anc)
        mask = (j < c) | (new & wide)
        depths = (anc.sum(-1) - 1).reshape(-1)
        depths = depths if pad_idx is None else depths[pad_idx]
        positions = cl[seq_of_token] + depths
    else:
        mask = (j < c) | (new & (rel <= i))
    mask = mask[:, :, :max_k]
    if tree_masks is not None:
        for b, tm in enumerate(tree_masks):
            if tm is not None:
                q = q_lens[b]
                mask[b, :q, cache_lens[b] : cache_lens[b] + q] = tm.to(device=dev, dtype=torch.bool)
    mask |= (i >= ql.view(B, 1, 1)) & (j[:, :, :max_k] == 0)  # padded query rows see one key: softmax stays finite
    contiguous = all(slots[k] == slots[0] + k for k in range(B))
    st = torch.tensor(slots, dtype=torch.long, device=dev)
    return StepMeta(
        positions=token_pos if positions is None else positions.to(dev),
        token_slot=st[seq_of_token],
        token_pos=token_pos,
        slots=st,
        slot_range=(slots[0], slots[0] + B) if contiguous else None,
        q_lens=list(q_lens),
        max_q=max_q,
        max_k=max_k,
        pad_idx=pad_idx,
        mask=mask.unsqueeze(1),
        depths=depths,
    )
