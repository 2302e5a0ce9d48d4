"""The update's forward layout: the samples of one prompt (a GRPO group) share one copy of the prompt.

A GRPO step computes n responses to each prompt. Laid out one sequence per row, the forward and backward run the
prompt n times. Here a micro-batch's sequences with the same prompt ids form a *segment*: its prompt runs once,
causally, and each member's response runs as its own row whose attention reads the prompt's keys and values
(gathered, not recomputed) and then its own, causally (`CausalLM.forward_shared`). A response's RoPE positions
continue from the prompt's end, as in its own sequence. The prompt's last hidden row predicts every member's first
token; a response's rows predict the rest (a response's last token is never an input). So each member's token
logprobs are those of its own sequence, and the gradient reaching the shared prompt rows is the sum of the members'
gradients: the same computation in another summation order (tests/rl/test_packing.py). With responses of about the
prompt's length and groups of 8, a step computes about half the tokens; the attention reads each response's own
rows and its prompt, never another response (a single row with a block mask would spend most of it on masked
pairs).

Rows are packed without padding through every matrix product; only the attention lays them out on padded grids
(prompts [S, P], responses [M, R]), where no real row sees a padded key (a padded response row sees its prompt, so
its softmax stays finite)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...model.llama import SharedPrompts


@dataclass
class Layout:
    tokens: torch.Tensor  # [rows] input ids, packed: the prompts' tokens, then the responses' inputs
    positions: torch.Tensor  # [rows] RoPE positions
    shared: SharedPrompts
    rows: torch.Tensor  # [N] index into the forward's rows of the hidden state that predicts each response token
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


def token_segments(groups: list[int], seqs: list[list[int]], prompt_lens: list[int], idx: list[int],
                   budget: int) -> list[list[int]]:
    """idx's sequences by group (as `segments`), each group cut, in index order, into pieces whose packed length
    (the prompt once, then each member's response inputs) is at most `budget`; a sequence longer than the budget
    on its own is a piece alone (a sequence is never split)."""
    out: list[list[int]] = []
    for g in segments(groups, idx, max(len(idx), 1)):
        p = prompt_lens[g[0]]
        piece, used = [], p
        for i in g:
            n = max(len(seqs[i]) - p - 1, 0)
            if piece and used + n > budget:
                out.append(piece)
                piece, used = [], p
            piece.append(i)
            used += n
        out.append(piece)
    return out


def packed_len(seqs: list[list[int]], prompt_lens: list[int], seg: list[int]) -> int:
    p = prompt_lens[seg[0]]
    return p + sum(max(len(seqs[i]) - p - 1, 0) for i in seg)


def packed_tokens(seqs: list[list[int]], prompt_lens: list[int], groups: list[int], idx: list[int]) -> int:
    """Tokens the forward over idx's segments computes (no padding)."""
    return sum(packed_len(seqs, prompt_lens, g) for g in segments(groups, idx, len(idx)))


def layout(seqs: list[list[int]], prompt_lens: list[int], groups: list[int], idx: list[int], start: int, T: int,
           device) -> Layout:
    """The forward layout of the sequences idx (a micro-batch). seqs: prompt + response ids; start and T: the
    Batch's [B, T] response layout (column j of a row is the token at position start + 1 + j)."""
    segs = segments(groups, idx, len(idx))
    S, P = len(segs), max(prompt_lens[g[0]] for g in segs)
    members = [(s, i) for s, g in enumerate(segs) for i in g]
    M = len(members)
    R = max(1, max(len(seqs[i]) - prompt_lens[i] - 1 for _, i in members))
    toks, pos, p_idx, r_idx = [], [], [], []
    first = []  # packed row of each segment's last prompt token
    for s, g in enumerate(segs):
        p = prompt_lens[g[0]]
        first.append(len(toks) + p - 1)
        toks += seqs[g[0]][:p]
        pos += range(p)
        p_idx += range(s * P, s * P + p)
    rows, targets, cols = [], [], []
    where = {i: u for u, i in enumerate(idx)}
    for m, (s, i) in enumerate(members):
        p = prompt_lens[i]
        resp = seqs[i][p:]
        n = len(resp)
        if n == 0:
            continue
        rows.append([first[s]] + list(range(len(toks), len(toks) + n - 1)))
        toks += resp[:-1]
        pos += range(p, p + n - 1)
        r_idx += range(m * R, m * R + n - 1)
        targets.append(resp)
        c0 = p - 1 - start + where[i] * T
        cols.append(list(range(c0, c0 + n)))
    seg_of = torch.tensor([s for s, _ in members])
    plen = torch.tensor([prompt_lens[g[0]] for g in segs])
    real_prompt = torch.arange(P).view(1, P) < plen[seg_of].view(M, 1)  # [M, P]
    causal = torch.ones(R, R, dtype=torch.bool).tril()
    mask = torch.cat([real_prompt.view(M, 1, P).expand(M, R, P), causal.expand(M, R, R)], dim=2).unsqueeze(1)

    def t(xs):
        return torch.tensor(xs, dtype=torch.long, device=device)

    def flat(xss):
        return t([x for xs in xss for x in xs])

    shared = SharedPrompts(S, P, M, R, t(p_idx), t(r_idx), seg_of.to(device), mask.to(device))
    return Layout(t(toks), t(pos), shared, flat(rows), flat(targets), flat(cols), len(toks))
