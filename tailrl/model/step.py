"""Attention metadata for one cached forward: which cache slot and position every new token writes,
and which cached or new tokens every query may see (causal, or an arbitrary draft-tree mask)."""

from __future__ import annotations

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

    @property
    def num_seqs(self) -> int:
        return len(self.q_lens)


def make_step(
    cache_lens: list[int],
    q_lens: list[int],
    slots: list[int],
    device: torch.device | str = "cpu",
    positions: torch.Tensor | None = None,
    tree_masks: list[torch.Tensor | None] | None = None,
) -> StepMeta:
    """Sequence b already holds cache_lens[b] tokens in cache slot slots[b] and adds q_lens[b] new tokens,
    written at cache indices cache_lens[b] .. cache_lens[b] + q_lens[b] - 1. Without a tree mask the new
    tokens are causal among themselves; tree_masks[b][i, j] says whether new token i sees new token j.
    positions defaults to the cache index (a chain); a tree passes cache_len + depth."""
    B = len(q_lens)
    cl = torch.tensor(cache_lens, dtype=torch.long)
    ql = torch.tensor(q_lens, dtype=torch.long)
    seq_of_token = torch.repeat_interleave(torch.arange(B), ql)
    starts = torch.cumsum(ql, 0) - ql
    offset = torch.arange(int(ql.sum())) - starts[seq_of_token]
    token_pos = cl[seq_of_token] + offset
    max_q = int(ql.max())
    max_k = int((cl + ql).max())
    pad_idx = None if bool((ql == max_q).all()) else seq_of_token * max_q + offset

    i = torch.arange(max_q).view(1, max_q, 1)
    j = torch.arange(max_k).view(1, 1, max_k)
    c = cl.view(B, 1, 1)
    rel = j - c
    mask = (j < c) | ((rel >= 0) & (rel <= i) & (rel < ql.view(B, 1, 1)))
    if tree_masks is not None:
        for b, tm in enumerate(tree_masks):
            if tm is not None:
                q = q_lens[b]
                mask[b, :q, cache_lens[b] : cache_lens[b] + q] = tm.to(torch.bool)
    mask |= (i >= ql.view(B, 1, 1)) & (j == 0)  # padded query rows see one key so softmax stays finite
    st = torch.tensor(slots, dtype=torch.long)
    contiguous = all(slots[k] == slots[0] + k for k in range(B))
    return StepMeta(
        positions=(token_pos if positions is None else positions.cpu()).to(device),
        token_slot=st[seq_of_token].to(device),
        token_pos=token_pos.to(device),
        slots=st.to(device),
        slot_range=(slots[0], slots[0] + B) if contiguous else None,
        q_lens=list(q_lens),
        max_q=max_q,
        max_k=max_k,
        pad_idx=None if pad_idx is None else pad_idx.to(device),
        mask=mask.unsqueeze(1).to(device),
    )
