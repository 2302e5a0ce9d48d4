"""A draft tree for one sequence: nodes in topological order, each a proposed next token.

Node i has token tokens[i] and parent parents[i] (-1: a child of the root, i.e. the sequence's last emitted
token, which is not yet in the KV cache). The verification forward runs [root] + nodes; row 0 holds the
target distribution for the root's children, row 1 + i for node i's children. A node's children are tried
in the order they appear. `q[node]` (node -1 for the root) is the draft distribution the node's children were
sampled from without replacement, in that order; without it the children are deterministic drafts.
`cond[i]` and `support[i]` (optional) are the drafter's own estimate of P(node i | its parent accepted) and how many
observations it rests on; speculative/allocate.py calibrates them into the odds that decide which nodes a step verifies."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class DraftTree:
    tokens: list[int]
    parents: list[int]
    q: dict[int, torch.Tensor] = field(default_factory=dict)
    drafter: str = ""
    cond: list[float] | None = None
    support: list[int] | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    def validate(self, vocab_size: int) -> None:
        if len(self.parents) != len(self.tokens):
            raise ValueError(f"draft tree has {len(self.tokens)} tokens but {len(self.parents)} parents")
        seen: dict[int, set[int]] = {}
        for i, (t, p) in enumerate(zip(self.tokens, self.parents)):
            if not 0 <= t < vocab_size:
                raise ValueError(f"draft token {t} at node {i} is outside the vocabulary")
            if not -1 <= p < i:
                raise ValueError(f"node {i} has parent {p}; parents must come before their children")
            if t in seen.setdefault(p, set()):
                raise ValueError(f"node {p} has the draft token {t} twice")
            seen[p].add(t)
        for node, dist in self.q.items():
            kids = [self.tokens[i] for i in self.children(node)]
            if kids and bool((dist[kids] <= 0).any()):
                raise ValueError(f"node {node}'s draft distribution gives zero probability to one of its children")

    def children(self, node: int) -> list[int]:
        return [i for i, p in enumerate(self.parents) if p == node]

    def kids_of(self) -> dict[int, list[int]]:
        """node -> its children in order (node -1: the root)."""
        out: dict[int, list[int]] = {}
        for i, p in enumerate(self.parents):
            out.setdefault(p, []).append(i)
        return out

    def depths(self) -> list[int]:
        d: list[int] = []
        for p in self.parents:
            d.append(1 if p < 0 else d[p] + 1)
        return d

    def attention_mask(self) -> torch.Tensor:
        """[1 + N, 1 + N] bool over [root] + nodes: each row sees the root, its ancestors and itself."""
        n = len(self.tokens)
        m = torch.zeros(n + 1, n + 1, dtype=torch.bool)
        m[:, 0] = True
        for i, p in enumerate(self.parents):
            if p >= 0:
                m[i + 1] = m[p + 1]
            m[i + 1, i + 1] = True
        return m

    def top_path(self) -> list[int]:
        """Tokens along first children from the root (the most likely path of a best-first tree)."""
        path, node = [], -1
        while True:
            kids = [i for i, p in enumerate(self.parents) if p == node]
            if not kids:
                return path
            node = kids[0]
            path.append(self.tokens[node])

    def preorder(self) -> DraftTree:
        """The same tree with its nodes in depth-first order, first children first: the path along first
        children is then nodes 0, 1, 2, ..., each right after its parent in a verify pass (engine/invariant.py)."""
        kids = self.kids_of()
        order: list[int] = []
        stack = list(reversed(kids.get(-1, [])))
        while stack:
            node = stack.pop()
            order.append(node)
            stack.extend(reversed(kids.get(node, [])))
        if order == list(range(len(self.tokens))):
            return self
        return self.subset(order)

    def subset(self, nodes: list[int]) -> DraftTree:
        """The tree of these nodes, in this order (each node's parent among them and before it, or the root)."""
        new = {old: i for i, old in enumerate(nodes)}

        def pick(xs):
            return [xs[o] for o in nodes]

        return DraftTree(pick(self.tokens), [new.get(self.parents[o], -1) for o in nodes],
                         {new.get(k, -1): v for k, v in self.q.items() if k == -1 or k in new}, self.drafter,
                         pick(self.cond) if self.cond is not None else None,
                         pick(self.support) if self.support is not None else None)

    @classmethod
    def chain(cls, tokens: list[int], drafter: str = "") -> DraftTree:
        return cls(list(tokens), list(range(-1, len(tokens) - 1)), drafter=drafter)
