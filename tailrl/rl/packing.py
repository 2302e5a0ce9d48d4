"""The update's forward layout: the samples of one prompt (a GRPO group) share one copy of the prompt.

A GRPO step computes n responses to each prompt. Laid out one sequence per row, the forward and backward run the
prompt n times; here a micro-batch's sequences with the same prompt ids form a *segment*, one row of

    prompt, response_1[:-1], response_2[:-1], ..., response_k[:-1]

with RoPE positions restarting after the prompt for every response (each response's first token sits at position
len(prompt), as in its own sequence) and a mask under which a response's rows see the prompt and their own earlier
tokens, never another response. The prompt's last hidden row predicts every member's first token; a response's
own rows predict the rest. So each member's token logprobs are those of its own sequence, and the gradient reaching
the shared prompt rows is the sum of the members' gradients: the same computation in another summation order
(tests/test_packing.py). With responses of about the prompt's length and groups of 8, a step computes about half
the tokens.

A segment of one sequence is that sequence's plain causal row; a micro-batch in which every segment has one member
runs the causal kernel with no mask, as before. Segments are right-padded to the micro-batch's longest: harmless,
since no real row sees a padded column (padded rows see only the prompt, so their softmax stays finite)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Layout:
    tokens: torch.Tensor  # [S, L] input ids, one row per segment
    positions: torch.Tensor  # [S, L] RoPE positions
    mask: torch.Tensor | None  # [S, 1, L, L] bool (True = may attend), None = plain causal
    rows: torch.Tensor  # [N] flat index into S * L of the hidden row that predicts each response token
    targets: torch.Tensor  # [N] the response tokens
    cols: torch.Tensor  # [N] flat index into [len(idx), T] (the Batch's layout) of each response token
    computed: int  # real tokens in the forward (no padding)


def group_keys(prompts: list[list[int]]) -> list[int]:
    """A group id per sequence: sequences with identical prompt ids share one, numbered by first appearance."""
    ids: dict[tuple[int, ...], int] = {}
    return [ids.setdefault(tuple(p), len(ids)) for p in prompts]


def segments(groups: list[int], idx: list[int], size: int) -> list[list[int]]:
    """idx's sequences by group (in order of first appearance), each group cut into pieces of at most `size`."""
    by: dict[int, list[int]] = {}
    for i in idx:
        by.setdefault(groups[i], []).append(i)
    return [g[k : k + size] for g in by.values() for k in range(0, len(g), size)]


def packed_len(seqs: list[list[int]], prompt_lens: list[int], seg: list[int]) -> int:
    p = prompt_lens[seg[0]]
    return p + sum(max(len(seqs[i]) - p - 1, 0) for i in seg)


def packed_tokens(seqs: list[list[int]], prompt_lens: list[int], groups: list[int], idx: list[int]) -> int:
    """Tokens the forward over idx's segments computes (no padding)."""
    return sum(packed_len(seqs, prompt_lens, g) for g in segments(groups, idx, len(idx)))


def layout(seqs: list[list[int]], prompt_lens: list[int], groups: list[int], idx: list[int], start: int, T: int,
           pad: int, device) -> Layout:
    """The forward layout of the sequences idx (a micro-batch). seqs: prompt + response ids; start and T: the
    Batch's [B, T] response layout (column j of a row is the token at position start + 1 + j)."""
    segs = segments(groups, idx, len(idx))
    L = max(packed_len(seqs, prompt_lens, s) for s in segs)
    S = len(segs)
    tokens = torch.full((S, L), pad, dtype=torch.long)
    positions = torch.zeros(S, L, dtype=torch.long)
    part = torch.full((S, L), -1, dtype=torch.long)  # 0: the prompt, k >= 1: the k-th member's response
    rows, targets, cols = [], [], []
    where = {i: u for u, i in enumerate(idx)}
    computed = 0
    for r, seg in enumerate(segs):
        p = prompt_lens[seg[0]]
        tokens[r, :p] = torch.tensor(seqs[seg[0]][:p])
        positions[r, :p] = torch.arange(p)
        part[r, :p] = 0
        off = p
        for k, i in enumerate(seg, start=1):
            resp = seqs[i][p:]
            n = len(resp)
            if n == 0:
                continue
            tokens[r, off : off + n - 1] = torch.tensor(resp[:-1], dtype=torch.long)
            positions[r, off : off + n - 1] = torch.arange(p, p + n - 1)
            part[r, off : off + n - 1] = k
            rows.append(torch.cat([torch.tensor([p - 1]), torch.arange(off, off + n - 1)]) + r * L)
            targets.append(torch.tensor(resp))
            c0 = p - 1 - start
            cols.append(torch.arange(c0, c0 + n) + where[i] * T)
            off += n - 1
        computed += off
    mask = None
    if any(len(s) > 1 for s in segs):
        a = torch.arange(L)
        causal = a.view(1, L, 1) >= a.view(1, 1, L)
        same = (part.unsqueeze(2) == part.unsqueeze(1)) | (part == 0).unsqueeze(1)
        mask = (causal & same).unsqueeze(1)
    empty = torch.zeros(0, dtype=torch.long)
    cat = (lambda xs: torch.cat(xs).to(device)) if rows else (lambda xs: empty.to(device))
    return Layout(tokens.to(device), positions.to(device), None if mask is None else mask.to(device), cat(rows),
                  cat(targets), cat(cols), computed)
