"""Which drafted nodes a decode step verifies: the nodes of all sequences ranked by their odds of being accepted and
taken while they raise the step's expected tokens per second (adaptive verification: RLHFSpec's cost-aware draft
allocation, vLLM's per-slot survival budget under a profiled cost model).

Every verified node is a row of the pass: forward time and sampling over the vocabulary, whatever its odds. At the
batches a rollout starts with (30-64 sequences) a row costs a fifth to a third of a plain sequence-step on a CPU
(benchmarks/verify_cost.py, in git at 103a651), so a fixed budget for every sequence pays for the rows a drafter
merely guesses at, and speculation there broke even. A node's survival (the odds that it and all its ancestors are
accepted) is the product along its path of its calibrated conditional odds; the slots of all sequences then compete
for rows, best first, and the step verifies the prefix of that ranking that maximises (B + sum of survivals) /
predicted seconds.

Lossless: only deterministic drafts (no draft distribution q) are cut. A deterministic draft may be any function of
the context, and the verifier emits the target's own draws whatever it verifies (with batch-invariant passes, the
very same tokens). A tree whose children were sampled from q is kept whole: rejection sampling stays exact only if
how many children a node keeps does not depend on which children were drawn."""

from __future__ import annotations

from .budgets import block_end
from collections.abc import Callable

from .tree import DraftTree

ROW_PRIOR = 0.3  # a draft row's price in sequence-steps before the step-time model has measured a step

COND_EDGES = (0.3, 0.5, 0.7, 0.9)  # the drafter's own P(node | parent accepted): history's continuation frequency
SUPPORT_EDGES = (2, 4, 8, 16)  # how many continuations that frequency counts


def _bucket(x: float, edges: tuple) -> int:
    return sum(x >= e for e in edges)


class AcceptanceModel:
    """Measured P(node accepted | its parent accepted) per (drafter, estimate bucket, support bucket): accepted and
    reached counts, shrunk towards the drafter's overall rate by `prior` pseudo-observations, and halved at the end of
    every rollout (the policy, and with it what is accepted, moves between rollouts). A drafter's raw estimate is only
    a feature here: history's frequencies over three siblings claim 1.0 where the policy agrees half the time."""

    def __init__(self, prior: float = 4.0):
        self.prior = prior
        self.cells: dict[tuple[str, int, int], list[float]] = {}  # -> [accepted, reached]
        self.overall: dict[str, list[float]] = {}

    @staticmethod
    def _features(tree: DraftTree, i: int) -> tuple[int, int]:
        cond = tree.cond[i] if tree.cond is not None else 1.0
        support = tree.support[i] if tree.support is not None else 1
        return _bucket(cond, COND_EDGES), _bucket(support, SUPPORT_EDGES)

    def odds(self, drafter: str, features: tuple[int, int]) -> float:
        """A drafter never seen starts at even odds: its first node is verified, its deeper ones rarely, until
        acceptance is measured (a cautious first rollout, whose verified nodes teach the table)."""
        a, n = self.overall.get(drafter, (0.0, 0.0))
        base = (a + 1.0) / (n + 2.0)
        ca, cn = self.cells.get((drafter, *features), (0.0, 0.0))
        return (ca + self.prior * base) / (cn + self.prior)

    def survival(self, tree: DraftTree) -> list[float]:
        """Per node, the odds that it is accepted: its conditional odds times its parent's survival. A later
        sibling never ranks above an earlier one (drafters order children best first)."""
        out: list[float] = []
        prev_sibling: dict[int, float] = {}
        for i, p in enumerate(tree.parents):
            s = (1.0 if p < 0 else out[p]) * self.odds(tree.drafter, self._features(tree, i))
            s = min(s, prev_sibling.get(p, s))
            prev_sibling[p] = s
            out.append(s)
        return out

    def observe(self, tree: DraftTree, accepted_nodes: list[int]) -> None:
        """A verified tree: every node whose parent was accepted (or is the root) was reached, and it was accepted
        if it lies on the accepted path."""
        path = set(accepted_nodes)
        for i, p in enumerate(tree.parents):
            if p < 0 or p in path:
                self._count(tree.drafter, self._features(tree, i), i in path)

    def observe_path(self, drafter: str, features: list[tuple[int, int]], matched: int) -> None:
        """A shadow draft path scored against the tokens the sequence went on to emit: its first `matched` nodes
        would have been accepted, the next one rejected."""
        for k, f in enumerate(features[: matched + 1]):
            self._count(drafter, f, k < matched)

    def _count(self, drafter: str, features: tuple[int, int], hit: bool) -> None:
        cell = self.cells.setdefault((drafter, *features), [0.0, 0.0])
        total = self.overall.setdefault(drafter, [0.0, 0.0])
        cell[0] += hit
        cell[1] += 1
        total[0] += hit
        total[1] += 1

    def path_features(self, tree: DraftTree) -> list[tuple[int, int]]:
        """Features of the nodes along the tree's first-child path (a shadow draft's path)."""
        out, node = [], -1
        kids = tree.kids_of()
        while kids.get(node):
            node = kids[node][0]
            out.append(self._features(tree, node))
        return out

    def end_rollout(self) -> None:
        for table in (self.cells, self.overall):
            for cell in table.values():
                cell[0] *= 0.5
                cell[1] *= 0.5


def allocate(trees: list[DraftTree | None], model: AcceptanceModel, B: int,
             cost: Callable[[int], float] | None) -> list[DraftTree | None]:
    """The trees cut to the nodes worth verifying. cost: draft rows -> the step's seconds verifying that many (the
    step-time model, speculative/step_cost.py); None until measured, and then a row is priced at ROW_PRIOR of a
    sequence-step."""
    seconds = cost if cost is not None else (lambda rows: B + ROW_PRIOR * rows)
    fixed_rows, fixed_gain = 0, float(B)
    slots: list[tuple[float, int, int, int]] = []  # (-survival, depth, sequence, node)
    whole: set[int] = set()
    for b, tree in enumerate(trees):
        if tree is None:
            continue
        surv = model.survival(tree)
        if tree.q:  # sampled children: kept whole
            fixed_rows += len(tree)
            fixed_gain += sum(surv)
            whole.add(b)
            continue
        depths = tree.depths()
        slots += [(-s, d, b, i) for i, (s, d) in enumerate(zip(surv, depths))]
    if not slots:
        return trees

    slots.sort()  # best odds first; a node never before its parent (no better odds, and shallower)
    best_n, best, gain = 0, fixed_gain / seconds(fixed_rows), fixed_gain
    for n, slot in enumerate(slots, 1):
        gain -= slot[0]
        rate = gain / seconds(fixed_rows + n)
        if rate > best:
            best_n, best = n, rate
    keep: dict[int, set[int]] = {}
    for _, _, b, i in slots[:best_n]:
        keep.setdefault(b, set()).add(i)
    out: list[DraftTree | None] = []
    for b, tree in enumerate(trees):
        if tree is None or b in whole:
            out.append(tree)
            continue
        chosen, kept = keep.get(b, set()), set()
        for i, p in enumerate(tree.parents):  # parents come first: a node stays only under a kept parent
            if i in chosen and (p < 0 or p in kept):
                kept.add(i)
        nodes = sorted(kept)
        out.append(tree if len(nodes) == len(tree) else tree.subset(nodes) if nodes else None)
    return out


FILL_MIN_SURVIVAL = 0.05  # a free row still samples the vocabulary (~0.1 ms on a CPU): a node must have these odds


def fill_tile(trees: list[DraftTree | None], wide: list[DraftTree | None], model: AcceptanceModel, tile: int,
              block: int, free: int | None = None, min_survival: float = 0.0) -> tuple[list[DraftTree | None], int]:
    """The rows a batch-invariant pass leaves free, given to the likeliest next draft nodes. Its matrix products run
    on whole tiles of `tile` rows (model/chunked.py ROW_TILE), so a step of 6 sequences verifying one draft each
    (12 rows) pays for 16; its attention reads a sequence's keys once per query block of `block` rows, so a node
    that stays in its sequence's last block costs no attention either. trees: the chains the step verifies (cut to
    the arm's budget, and by `allocate`); wide: the same drafter's chains drafted to the end of each sequence's last
    query block (trees[b] a prefix of wide[b]). Returns the trees with the free rows' nodes appended, best
    survival first, and how many nodes were added. free: the rows to give (default: those up to the last tile's
    end; the speculator gives those up to the end of the pass's last product call where the step-time model has
    priced a row, speculative/step_cost.py); min_survival: the odds a node needs (at least FILL_MIN_SURVIVAL: a row
    still costs its arithmetic and sampling). Lossless as `allocate` is: a deterministic draft is any function
    of the context, and the verifier emits the target's own draws whatever it verifies."""
    if free is None:
        free = -sum(1 + (len(t) if t is not None else 0) for t in trees) % tile
    min_survival = max(min_survival, FILL_MIN_SURVIVAL)
    if not free:
        return trees, 0
    slots: list[tuple[float, int, int]] = []  # (-survival, node, sequence)
    for b, (tree, w) in enumerate(zip(trees, wide)):
        n = len(tree) if tree is not None else 0
        if w is None or w.q or len(w) <= n or w.parents != list(range(-1, len(w) - 1)):
            continue  # chains only (a branch would leave the first-child path the invariant verifier keeps)
        if tree is not None and tree.tokens != w.tokens[:n]:
            continue
        end = block_end(n, block)  # the sequence's nodes up to the end of its last query block
        surv = model.survival(w)
        slots += [(-surv[i], i, b) for i in range(n, min(len(w), end)) if surv[i] >= min_survival]
    slots.sort()  # a node's survival is at most its parent's, and ties go to the shallower: parents come first
    extra: dict[int, int] = {}
    for _, _, b in slots[:free]:
        extra[b] = extra.get(b, 0) + 1
    out = list(trees)
    for b, k in extra.items():
        n = len(trees[b]) if trees[b] is not None else 0
        out[b] = wide[b].subset(list(range(n + k)))
    return out, sum(extra.values())
