"""Logit warping (temperature, top-k, top-p) and sampling keyed by (request seed, token position).

The uniform that draws the token at output position i of a request depends only on the request's seed and i
(speculative/noise.py: a counter-based hash, computed on the logits' device).
Plain decoding and speculative verification with deterministic drafts therefore emit the very same tokens,
not merely tokens of the same distribution, and a batch gives each request what it would get alone.

`warped_logprobs` defines the distribution a request samples from, and speculative verification uses it. Its
support comes from `warp_mask`, the one definition of what top-k and top-p leave out: the trainer scores tokens
under the same warped distribution by calling it too (rl/actor/logprobs.py), so the logprobs the engine reports
and the trainer's agree up to float rounding. Greedy rows keep the unscaled distribution (temperature 1) for their
reported logprobs and take its argmax."""

from __future__ import annotations

import torch

from ..speculative.noise import gumbel_argmax, row_keys, signed64
from ..speculative.verify import Verdict, verify_tree, walk
from .sampling import SamplingParams


def warp_tensors(params: list[SamplingParams], device) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Per row: temperature, top-k and top-p; top-k (top-p) is None when no row uses it, decided here on the host
    so that a GPU step need not wait for the device to answer."""
    temps = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params], dtype=torch.float32)
    top_k = torch.tensor([p.top_k for p in params], dtype=torch.long) if any(p.top_k > 0 for p in params) else None
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32) if any(p.top_p < 1 for p in params) else None
    return temps.to(device), *(None if t is None else t.to(device) for t in (top_k, top_p))


def warped_logprobs(logits: torch.Tensor, temps: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                    rows: int = 32) -> torch.Tensor:
    """logits [N, V] -> log-probabilities [N, V] after temperature, then top-k, then top-p (-inf outside).
    On CPU `rows` rows at a time: each row's result is the same, and the temporaries of a block stay in cache (a
    verify pass of 64 sequences with 8 draft tokens has 576 rows of 49k: about 2x faster in blocks)."""
    if logits.device.type != "cpu" or len(logits) <= rows:
        return _warp(logits, temps, top_k, top_p)
    out = torch.empty(logits.shape, dtype=torch.float32)
    for i in range(0, len(logits), rows):
        block = slice(i, i + rows)
        out[block] = _warp(logits[block], temps[block], *(None if t is None else t[block] for t in (top_k, top_p)))
    return out


def warp_mask(x: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor | None:
    """What top-k, then top-p, leave out of temperature-scaled logits x [N, V] (True: dropped), or None when no row
    uses either. top-k keeps each row's k largest (ties with the k-th kept; k = 0: all); top-p then keeps the smallest
    prefix, by probability renormalised after top-k, whose mass reaches p (p = 1: all). A pure function of x and
    the settings: the sampler and the trainer (rl/actor/logprobs.py) share it, so both warp alike."""
    V, drop = x.shape[-1], None
    if top_k is not None and bool((top_k > 0).any()):
        k = torch.where(top_k > 0, top_k.clamp(max=V), V)
        kth = torch.topk(x, int(k.max()), dim=-1).values.gather(-1, (k - 1).unsqueeze(-1))
        drop = x < kth
    if top_p is not None and bool((top_p < 1).any()):
        sorted_x, order = torch.sort(x if drop is None else x.masked_fill(drop, float("-inf")), dim=-1, descending=True)
        probs = sorted_x.softmax(-1)
        mass_before = probs.cumsum(-1) - probs  # keep the smallest prefix whose mass reaches top_p
        drop_sorted = (mass_before >= top_p.unsqueeze(-1)) & (top_p < 1).unsqueeze(-1)  # top_p=1: keep all
        by_p = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        drop = by_p if drop is None else drop | by_p
    return drop


def _warp(logits: torch.Tensor, temps: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    x = logits.float() / temps.unsqueeze(-1)
    drop = warp_mask(x, top_k, top_p)
    return torch.log_softmax(x if drop is None else x.masked_fill(drop, float("-inf")), dim=-1)


def sample(logprobs: torch.Tensor, greedy: list[bool], seeds: list[int], positions: list[int]) -> tuple[list[int], list[float]]:
    """One token per row from warped logprobs [N, V]: row r is output position positions[r] of a request
    seeded seeds[r] (Gumbel-max with that position's keyed noise), or the argmax for greedy rows."""
    tokens = sample_tensor(logprobs, greedy, seeds, positions)
    lp = logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return tokens.tolist(), lp.tolist()


def sample_tensor(logprobs: torch.Tensor, greedy: list[bool], seeds: list[int], positions) -> torch.Tensor:
    """`sample`'s tokens as a tensor on the logits' device (positions may be a tensor)."""
    tokens = logprobs.argmax(-1)
    if all(greedy):
        return tokens
    keys = row_keys(seeds, positions, device=logprobs.device)
    if not any(greedy):
        return gumbel_argmax(logprobs, keys)
    rows = torch.tensor([i for i, g in enumerate(greedy) if not g], device=logprobs.device)
    tokens[rows] = gumbel_argmax(logprobs[rows], keys[rows])  # noise only for the sampled rows
    return tokens


def sample_first(logits: torch.Tensor, seqs: list) -> tuple[list[int], list[float]]:
    """The first token of each sequence (output position 0) from its row of prefill logits."""
    logp = warped_logprobs(logits, *warp_tensors([s.params for s in seqs], logits.device))
    return sample(logp, [s.params.greedy for s in seqs], [s.seed for s in seqs], [0] * len(seqs))


def decide(logits: torch.Tensor, seqs: list, trees: list | None, q_lens: list[int],
           depths: torch.Tensor | None) -> list[Verdict]:
    """What each sequence of a decode pass emits. Plain rows and the rows of deterministic trees are drawn in
    one batched call, row r at output position len(output) + depth(r) with its own keyed noise; a deterministic
    tree is then walked on those draws, and a tree with draft probabilities goes through rejection sampling."""
    dev = logits.device
    ql = torch.tensor(q_lens, device=dev)
    params = [s.params for s, q in zip(seqs, q_lens) for _ in range(q)]
    logp = warped_logprobs(logits, *warp_tensors(params, dev))
    base = torch.repeat_interleave(torch.tensor([len(s.output_ids) for s in seqs], device=dev), ql)
    positions = base if depths is None else base + depths
    seeds = torch.repeat_interleave(torch.tensor([signed64(s.seed) for s in seqs], device=dev), ql)
    # rows of trees with draft probabilities go through rejection sampling below: no noise drawn for them here
    rejection = [bool(trees and trees[b] is not None and trees[b].q and not s.params.greedy) for b, s in enumerate(seqs)]
    argmax_only = [s.params.greedy or r for s, r, q in zip(seqs, rejection, q_lens) for _ in range(q)]
    tokens = sample_tensor(logp, argmax_only, seeds, positions)
    lps = logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    tokens, lps = torch.stack([tokens.double(), lps.double()]).tolist()  # one device-to-host copy, exact
    tokens = [int(t) for t in tokens]
    out, off = [], 0
    for b, s in enumerate(seqs):
        q, tree = q_lens[b], trees[b] if trees else None
        if tree is None:
            out.append(Verdict([], [tokens[off]], [lps[off]]))
        elif s.params.greedy or not tree.q:
            accepted = walk(tree, tokens[off : off + q])
            rows = [off] + [off + 1 + a for a in accepted]
            out.append(Verdict(accepted, [tokens[r] for r in rows], [lps[r] for r in rows]))
        else:
            out.append(verify_tree(tree, logp[off : off + q], False, s.seed, len(s.output_ids)))
        off += q
    return out
