"""Lossless acceptance of a draft tree against the target's distributions.

Deterministic drafts: at the current node draw x from the target and move to the child whose token is x;
stop at the first x that no child has (x is then the correction token) or at a leaf (x is the bonus token).
Every emitted token is then a plain draw from the target given the emitted prefix.

Drafts with probabilities (children sampled from q without replacement): recursive rejection sampling
(SpecInfer's multi-draft verification, in the without-replacement form of Jeon et al. 2024): child c is
accepted with probability min(1, p(c) / q(c)); on rejection p <- norm(max(p - q, 0)) and c is removed from
q (renormalised); if every child is rejected, the token is drawn from the final residual p.

Greedy takes the argmax at every node, which makes any draft exact. Emitted logprobs are those of the
target's (warped) distribution at each position: what plain decoding would have reported.

All randomness for the token at output position i comes from that position's keyed noise (speculative/noise.py): its
Gumbel noise draws a token (plain, or from the residual), uniform(seed, i, 1 + k) tests the k-th tried child. Deterministic
drafts therefore emit exactly what plain decoding with the same seed emits."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .noise import draw, uniform
from .tree import DraftTree


@dataclass
class Verdict:
    accepted_nodes: list[int]  # tree nodes on the accepted path, root side first
    tokens: list[int]  # emitted: accepted draft tokens, then one correction or bonus token
    logprobs: list[float]


def _rejection_step(logp: torch.Tensor, q: torch.Tensor, kids: list[int], tokens: list[int],
                    seed: int, position: int) -> tuple[int | None, int]:
    """Returns (accepted child or None, emitted token)."""
    p = logp.double().exp()
    qc = q.double().to(p.device).clone()
    for k, c in enumerate(kids):
        x = tokens[c]
        if uniform(seed, position, 1 + k) * float(qc[x]) < float(p[x]):
            return c, x
        p = (p - qc).clamp_min(0)
        s = p.sum()
        p = p / s if s > 0 else logp.double().exp()  # s == 0 only through rounding when p == q
        qc[x] = 0
        qs = qc.sum()
        qc = qc / qs if qs > 0 else qc
    return None, draw(torch.log(p), seed, position)


def walk(tree: DraftTree, row_tokens: list[int]) -> list[int]:
    """Deterministic drafts: row_tokens[r] is the target's draw at row r ([root] + nodes), each drawn with its
    own position's noise. Returns the accepted nodes (the path whose tokens match the draws)."""
    kids_of = tree.kids_of()
    node, accepted = -1, []
    while True:
        x = row_tokens[node + 1]
        child = next((c for c in kids_of.get(node, ()) if tree.tokens[c] == x), None)
        if child is None:
            return accepted
        accepted.append(child)
        node = child


def verify_tree(tree: DraftTree, logp: torch.Tensor, greedy: bool, seed: int, position: int,
                row_tokens: list[int] | None = None) -> Verdict:
    """logp: [1 + N, V] warped target log-probabilities for [root] + tree nodes; the root's child is drawn
    for output position `position` of a request seeded `seed`. row_tokens, when given, are the draws of every
    row already made in one batched call (deterministic trees only)."""
    if greedy or not tree.q:
        if row_tokens is None:
            depths = [0] + tree.depths()
            row_tokens = ([int(t) for t in logp.argmax(-1)] if greedy else
                          [draw(logp[r], seed, position + d) for r, d in enumerate(depths)])
        accepted = walk(tree, row_tokens)
        rows = [0] + [a + 1 for a in accepted]
        out = [tree.tokens[a] for a in accepted] + [row_tokens[rows[-1]]]
        return Verdict(accepted, out, [float(logp[r, x]) for r, x in zip(rows, out)])
    kids_of = tree.kids_of()
    node, accepted, out, lps = -1, [], [], []
    while True:
        row = logp[node + 1]
        kids = kids_of.get(node, [])
        q = tree.q.get(node)
        if q is not None and kids:
            child, x = _rejection_step(row, q, kids, tree.tokens, seed, position + len(out))
        else:
            x = draw(row, seed, position + len(out))
            child = next((c for c in kids if tree.tokens[c] == x), None)
        out.append(x)
        lps.append(float(row[x]))
        if child is None:
            return Verdict(accepted, out, lps)
        accepted.append(child)
        node = child
