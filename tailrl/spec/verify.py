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

All randomness for the token at output position i comes from that position's own stream (request seed, i),
drawn in a fixed order (the Gumbel noise first, then one uniform per tried child), so deterministic drafts
emit exactly what plain decoding with the same seed emits."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .noise import draw, gumbel, position_generator
from .tree import DraftTree


@dataclass
class Verdict:
    accepted_nodes: list[int]  # tree nodes on the accepted path, root side first
    tokens: list[int]  # emitted: accepted draft tokens, then one correction or bonus token
    logprobs: list[float]


def _rejection_step(logp: torch.Tensor, q: torch.Tensor, kids: list[int], tokens: list[int],
                    generator: torch.Generator) -> tuple[int | None, int]:
    """Returns (accepted child or None, emitted token)."""
    noise = gumbel(generator, logp.shape[-1]).to(logp.device)  # drawn first: the residual draw's noise
    p = logp.double().exp()
    qc = q.double().to(p.device).clone()
    for c in kids:
        x = tokens[c]
        u = float(torch.rand((), generator=generator, dtype=torch.float64))
        if u * float(qc[x]) < float(p[x]):
            return c, x
        p = (p - qc).clamp_min(0)
        s = p.sum()
        p = p / s if s > 0 else logp.double().exp()  # s == 0 only through rounding when p == q
        qc[x] = 0
        qs = qc.sum()
        qc = qc / qs if qs > 0 else qc
    return None, int((torch.log(p) + noise).argmax())


def verify_tree(tree: DraftTree, logp: torch.Tensor, greedy: bool, seed: int, position: int) -> Verdict:
    """logp: [1 + N, V] warped target log-probabilities for [root] + tree nodes; the root's child is drawn
    for output position `position` of a request seeded `seed`."""
    kids_of: dict[int, list[int]] = {}
    for i, p in enumerate(tree.parents):
        kids_of.setdefault(p, []).append(i)
    node, accepted, out, lps = -1, [], [], []
    while True:
        row = logp[node + 1]
        kids = kids_of.get(node, [])
        q = tree.q.get(node)
        if greedy:
            x = int(row.argmax())
            child = next((c for c in kids if tree.tokens[c] == x), None)
        elif q is not None and kids:
            child, x = _rejection_step(row, q, kids, tree.tokens, position_generator(seed, position + len(out)))
        else:
            x = draw(row, position_generator(seed, position + len(out)))
            child = next((c for c in kids if tree.tokens[c] == x), None)
        out.append(x)
        lps.append(float(row[x]))
        if child is None:
            return Verdict(accepted, out, lps)
        accepted.append(child)
        node = child
