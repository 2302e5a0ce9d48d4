"""Draft trees from the learned head, for every running sequence at once.

The head keeps its own one-layer KV cache, in the same slots as the target's (the engine's cache copies it
along when sequences fork or move). A proposal first catches the head up on the positions the target
verified since the last one (their hidden states come from the engine), which also yields the root's draft
distribution; the tree then grows level by level (EAGLE-2): the top-k nodes of the newest level by
cumulative draft probability are expanded, each into its top-k children, and the `budget` best nodes by
cumulative probability are kept. Sampled requests draw children without replacement from the draft
distribution q (Gumbel top-k with keyed noise on a stream separate from the verifier's) and carry q for lossless
rejection sampling; greedy requests take the top-k deterministically."""

from __future__ import annotations

import math

import torch

from ..model.step import make_step
from ..speculative.noise import draw_without_replacement
from ..speculative.tree import DraftTree
from .config import DrafterConfig
from .eagle import EagleDrafter

DRAFT_SALT = 0x5EED_D4AF_7000_0001  # keeps draft noise independent of the verifier's stream for a position


class _Node:
    __slots__ = ("token", "parent", "logp", "adj", "depth", "dist", "written", "order")

    def __init__(self, token, parent, logp, adj, depth, order):
        self.token, self.parent, self.logp, self.adj, self.depth, self.order = token, parent, logp, adj, depth, order
        self.dist = None  # draft log-probabilities over the draft vocabulary for this node's children
        self.written = -1  # index of its entry among the tree entries in the head's cache


class _BatchDrafter:
    """Drafters that propose for the whole batch at once with head forwards (the spec Drafter protocol)."""

    costly = True  # shadow drafts cost head forwards: the speculator runs them rarely
    needs_hidden = True
    policy_bound = True  # trained on an earlier policy's outputs
    chains = False  # one child per node (the speculator sets it for a batch-invariant verifier)

    def attach(self, kv) -> None:
        pass

    def start(self, seq) -> None:
        pass

    def accept(self, seq, tokens) -> None:
        pass

    def release(self, seq_id: int) -> None:
        pass

    def end_rollout(self) -> None:
        pass


class LearnedDrafter(_BatchDrafter):
    name = "learned"

    def __init__(self, head: EagleDrafter, cfg: DrafterConfig | None = None):
        self.head = head
        self.cfg = cfg or DrafterConfig()
        self.kv = None
        self.seen: dict[int, int] = {}  # seq_id -> positions the head has run over (its own cache holds them)

    def attach(self, kv) -> None:
        """Gives the head a KV cache in the target cache's slots, with room for tree entries past a sequence."""
        self.kv = kv.mirror(self.head.config, self.cfg.topk * 32 + 8, self.head.fc.weight.dtype)

    # ---- drafter interface ------------------------------------------------------------------------------

    def start(self, seq) -> None:
        self.seen[seq.seq_id] = 0

    def release(self, seq_id: int) -> None:
        self.seen.pop(seq_id, None)

    @torch.inference_mode()
    def propose(self, seqs: list, budgets: list[int], depths: list[int]) -> list[DraftTree | None]:
        depths = list(depths)
        live = [i for i, s in enumerate(seqs) if budgets[i] > 0 and depths[i] > 0 and s.hidden]
        live = [i for i in live if self._fit(seqs[i], depths, i)]
        out: list[DraftTree | None] = [None] * len(seqs)
        if not live:
            return out
        roots = self._catch_up([seqs[i] for i in live])
        trees = self._grow([seqs[i] for i in live], roots, [budgets[i] for i in live], [depths[i] for i in live])
        for i, t in zip(live, trees):
            out[i] = t
        return out

    # ---- internals ----------------------------------------------------------------------------------------

    def _fit(self, seq, depths: list[int], i: int) -> bool:
        """Room for the tree entries in seq's KV blocks (at most topk nodes are expanded per level). When the pool
        is short, depths[i] is cut to what the blocks the row holds allow; False when not one level fits (the
        sequence goes undrafted this step rather than failing the batch)."""
        need = seq.cache_len + self.cfg.topk * depths[i] + 2
        if self.kv.grow(seq.slot, need):
            return True
        depths[i] = (self.kv.tables.held(seq.slot) - seq.cache_len - 2) // self.cfg.topk
        return depths[i] > 0

    def _catch_up(self, seqs: list) -> torch.Tensor:
        """Runs the head over each sequence's verified positions it has not seen; returns the root's g [B, H]."""
        dev = self.head.fc.weight.device
        hs, ids, starts, lens = [], [], [], []
        for s in seqs:
            done, c = self.seen.get(s.seq_id, 0), s.cache_len
            if done >= c:  # nothing new (cannot happen after a step): redo the last position
                done = c - 1
            hs.append(s.hidden_rows(done, c))
            all_ids = s.prompt_ids + s.output_ids
            ids.extend(all_ids[done + 1 : c + 1])
            starts.append(done)
            lens.append(c - done)
            self.seen[s.seq_id] = c
        step = make_step(starts, lens, [s.slot for s in seqs], dev)
        h = torch.cat(hs).to(device=dev, dtype=self.head.fc.weight.dtype)
        g = self.head.step(h, torch.tensor(ids, device=dev), step, self.kv)
        last = torch.tensor(lens, device=dev).cumsum(0) - 1
        return g[last]

    def _children(self, s, logq: torch.Tensor, k: int, greedy: bool, stream: int) -> tuple[list[int], list[float]]:
        """k children of one node in the order they were drawn (without replacement for sampled requests)."""
        k = min(k, logq.shape[-1])
        if greedy:
            vals, idx = torch.topk(logq, k)
            return idx.tolist(), vals.tolist()
        idx = draw_without_replacement(logq, s.seed ^ DRAFT_SALT, stream, k)
        return idx, logq[idx].tolist()

    def _grow(self, seqs, root_g, budgets, depths) -> list[DraftTree | None]:
        head, k = self.head, 1 if self.chains else self.cfg.topk
        dev = head.fc.weight.device
        floor = math.log(self.cfg.min_prob) if self.cfg.min_prob > 0 else -math.inf
        temps = [max(s.params.temperature, 1e-5) for s in seqs]
        greedy = [s.params.greedy for s in seqs]
        nodes: list[list[_Node]] = [[] for _ in seqs]
        root_dist = torch.log_softmax(head.logits(root_g).float() / torch.tensor(temps, device=dev)[:, None], -1)
        frontier: list[list[_Node]] = []
        for b, s in enumerate(seqs):
            toks, lps = self._children(s, root_dist[b], k, greedy[b], len(s.output_ids) << 16)
            frontier.append(self._add(nodes[b], None, toks, lps, floor if greedy[b] else -math.inf))
        written = [0] * len(seqs)
        level_g: dict[int, torch.Tensor] = {}  # id(node) -> the head's output at that node
        parent_g = {b: root_g[b] for b in range(len(seqs))}
        for level in range(1, max(depths)):
            expand = []
            for b in range(len(seqs)):
                if level < depths[b] and frontier[b]:
                    # a node below the budget-th best score cannot have a kept child: do not expand it
                    scores = sorted((n.adj for n in nodes[b]), reverse=True)
                    kth = scores[budgets[b] - 1] if len(scores) >= budgets[b] else -math.inf
                    best = [n for n in sorted(frontier[b], key=lambda n: (-n.adj, n.order))[:k] if n.adj >= kth]
                    if best:
                        expand.append((b, best))
            if not expand:
                break
            hs, ids, pos, cache_lens, q_lens, slots, anc = [], [], [], [], [], [], []
            for b, best in expand:
                c = seqs[b].cache_len
                for n in best:
                    hs.append(parent_g[b] if n.parent is None else level_g[id(n.parent)])
                    ids.append(n.token)
                    pos.append(c + n.depth - 1)
                cache_lens.append(c + written[b])
                q_lens.append(len(best))
                slots.append(seqs[b].slot)
                anc.append([self._ancestry(n, written[b]) for n in best])
            self.kv.ensure(slots, [cl + q for cl, q in zip(cache_lens, q_lens)])
            step = make_step(cache_lens, q_lens, slots, dev, positions=torch.tensor(pos),
                             tree_masks=[torch.eye(q, dtype=torch.bool) for q in q_lens])
            for row, (b, best) in enumerate(expand):  # tree entries seen: the node's ancestors only
                c = seqs[b].cache_len
                if written[b]:
                    step.mask[row, 0, : len(best), c : c + written[b]] = torch.stack(anc[row]).to(dev)
            g = head.step(torch.stack(hs), torch.tensor(ids, device=dev), step, self.kv)
            t = torch.tensor([temps[b] for b, best in expand for _ in best], device=dev)
            dist = torch.log_softmax(head.logits(g).float() / t[:, None], -1)
            r = 0
            new_frontier = [[] for _ in seqs]
            for b, best in expand:
                for n in best:
                    n.written = written[b]
                    written[b] += 1
                    level_g[id(n)] = g[r]
                    n.dist = dist[r]
                    stream = (len(seqs[b].output_ids) << 16) + n.order + 1
                    toks, lps = self._children(seqs[b], dist[r], k, greedy[b], stream)
                    new_frontier[b].extend(self._add(nodes[b], n, toks, lps, floor if greedy[b] else -math.inf))
                    r += 1
            frontier = new_frontier
        return [self._tree(nodes[b], budgets[b], root_dist[b], greedy[b]) for b in range(len(seqs))]

    @staticmethod
    def _ancestry(n: _Node, written: int) -> torch.Tensor:
        row = torch.zeros(written, dtype=torch.bool)
        p = n.parent
        while p is not None:
            row[p.written] = True
            p = p.parent
        return row

    @staticmethod
    def _add(nodes: list[_Node], parent: _Node | None, toks, lps, floor: float) -> list[_Node]:
        """Children in draw order; a child's score never exceeds its parent's or an earlier sibling's, so any
        top-scored set keeps each node's children as a prefix of their draw order (needed for rejection sampling)."""
        added, cap = [], 0.0 if parent is None else parent.adj
        base = 0.0 if parent is None else parent.logp
        for tok, lp in zip(toks, lps):
            logp = base + lp
            adj = min(logp, cap)
            if adj < floor:
                break
            n = _Node(tok, parent, logp, adj, 1 if parent is None else parent.depth + 1, len(nodes))
            nodes.append(n)
            added.append(n)
            cap = adj
        return added

    @staticmethod
    def _keep_greedy(nodes: list[_Node], budget: int) -> list[_Node]:
        return sorted(nodes, key=lambda n: (-n.adj, n.order))[:budget]

    @staticmethod
    def _keep_sampled(nodes: list[_Node], budget: int) -> list[_Node]:
        """Sampled drafts are kept or cut a whole sibling group at a time, by the parent's score: the verifier's
        rejection sampling is exact only if how many children a node keeps does not depend on which children
        were drawn (cutting the lowest-scored drafts would bias it towards likely children)."""
        groups: dict[int, list[_Node]] = {}
        for n in nodes:
            groups.setdefault(-1 if n.parent is None else id(n.parent), []).append(n)
        keep, kept = [], {-1}
        parents = [None] + sorted({n.parent for n in nodes if n.parent is not None}, key=lambda p: (p.depth, -p.adj, p.order))
        for p in parents:
            key = -1 if p is None else id(p)
            if key in kept and len(keep) + len(groups[key]) <= budget:
                keep += groups[key]
                kept.update(id(c) for c in groups[key])
        return keep

    def _tree(self, nodes: list[_Node], budget: int, root_dist: torch.Tensor, greedy: bool) -> DraftTree | None:
        if not nodes:
            return None
        keep = sorted(self._keep_greedy(nodes, budget) if greedy else self._keep_sampled(nodes, budget),
                      key=lambda n: n.order)
        index = {id(n): i for i, n in enumerate(keep)}
        to_target = self.head.to_target_ids
        tokens = to_target(torch.tensor([n.token for n in keep])).tolist()
        parents = [-1 if n.parent is None else index[id(n.parent)] for n in keep]
        tree = DraftTree(tokens, parents, drafter=self.name)
        if not greedy:  # the distributions the kept children were drawn from, over the full vocabulary
            V = self.head.config.vocab_size
            has_kids = {p for p in parents}
            for node in has_kids:
                d = root_dist if node == -1 else keep[node].dist
                q = torch.zeros(V, dtype=torch.float32, device=d.device)
                q[self.head.vocab.to(d.device) if len(self.head.vocab) else slice(None)] = d.exp()
                tree.q[node] = q
        return tree
