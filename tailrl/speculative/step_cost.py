"""A decode step's seconds as measured on this engine and CPU (or GPU): what the selector prices every arm with,
plain decoding included, and what the allocator prices a draft row with.

A step is described by what its pass carries (`Shape`), in the terms that set a pass's time on a CPU:

    seconds = a + b * B + k * K + w * (P - 1)                    (what every step pays: a plain step is only this)
            + v * [drafts] + d * D + p * (P - P_plain) + q * A   (what verifying D draft rows adds)

- B sequences; D draft rows (the pass has B + D rows);
- K thousands of keys the attention reads: each sequence's cached and new keys, once per item of `row_block`
  query rows (our kernel's ITEM_TOKENS = 16 in place; 0: all rows at once), so a draft within the item reads
  nothing more;
- P weight passes: the products' calls over the pass's rows. A batch-invariant pass runs every product in calls of
  at most the probe's `call_rows` rows (engine/probe.py), and on a CPU each call streams the weights again, so a
  draft row that opens a call costs a whole weight stream and one inside a call costs only its arithmetic;
- A thousands of (draft row, key) pairs: the attention's arithmetic for the draft rows, which at long contexts is
  what a deep draft costs most.

The coefficients are fitted by least squares with forgetting (`decay` per step), per batch-size bucket, each
bucket pulled towards the fit over all steps by a ridge worth `pool` steps (where a bucket has not measured a term,
e.g. drafts at 64 sequences, it takes the pooled price), and the pooled fit's draft terms pulled by `prior` steps
towards what a plain step prices (`_row_prior`: a draft row as a sequence's row, a weight stream it opens as a plain
step's extra one, a (draft row, key) pair as a key read). The prior used to be 0 (a draft row never measured was
free): on a first visit the selector then tried drafts at 32-64 sequences at 1.6-3x a plain step's seconds for 1.4
tokens a sequence. No constant price of a row survives a bucket's own measurements."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

NF = 8  # features: 1, B, K, P - 1 | [drafts], D, P - P_plain, A
PLAIN = slice(0, 4)
NONNEG = (2, 3, 4, 5, 6, 7)  # prices that cannot be negative (noise may fit them so)
SURPRISE = 0.25  # a step this far off its bucket's prediction discounts what the bucket measured before
# when a fit is solved again: once steps worth FRESH of what it holds were added since its last solve, or at once
# after a step its bucket's fit missed by more than AGREE (a new shape, a moved price). Steps that add a few
# percent to many agreeing ones move the least-squares solution by a few percent of their residuals; solving every
# fit after every step (4-12 small solves) was most of the selector's work on a plain step (RESULTS 25)
FRESH, AGREE = 0.1, 0.1


def batch_bucket(B: int) -> int:
    return max(B - 1, 0).bit_length()  # 1 | 2 | 3-4 | 5-8 | 9-16 | ...


@dataclass
class Geometry:
    """How the engine's passes lay out their work. row_block: query rows of one sequence an attention item takes
    (0: all of them); weight_calls: (rows per product call, share of the weights' bytes) per product, rows 0 = any
    number of rows in one call; tile: a product's rows are padded to whole tiles of this many (0: none)."""

    row_block: int = 0
    weight_calls: list[tuple[int, float]] = field(default_factory=lambda: [(0, 1.0)])
    tile: int = 0

    def passes(self, rows: int) -> float:
        """Weight streams of a pass of `rows` rows: per product, its calls, weighted by its share of the bytes."""
        if self.tile > 1:
            rows = -(-rows // self.tile) * self.tile
        return sum(share * (-(-rows // n) if n else 1) for n, share in self.weight_calls)

    def shape(self, contexts: list[int], drafts: list[int]) -> Shape:
        """The pass over sequences holding `contexts` keys before it, verifying drafts[i] draft rows each."""
        B, D = len(contexts), sum(drafts)
        keys = sum(self._items(1 + d) * (c + 1 + d) for c, d in zip(contexts, drafts))
        pairs = sum(d * (c + d) for c, d in zip(contexts, drafts))
        return Shape(B, D, self.passes(B + D) if B else 0.0, self.passes(B) if B else 0.0, keys / 1e3, pairs / 1e3,
                     (sum(contexts) + B) / 1e3)

    def uniform(self, contexts: list[int], depth: float) -> Shape:
        """The pass where every sequence verifies `depth` draft rows (a fraction: the mean over them): `shape` of
        the first round(frac * B) sequences at the depth's ceiling and the rest at its floor, in closed form (the
        selector prices every arm with it on every step)."""
        B = len(contexts)
        lo = int(depth)
        k = round((depth - lo) * B)
        total = sum(contexts)
        head = sum(contexts[:k]) if k else 0
        keys = pairs = 0.0
        for d, n, S in ((lo + 1, k, head), (lo, B - k, total - head)):
            if n:
                keys += self._items(1 + d) * (S + n * (1 + d))
                pairs += d * (S + n * d)
        D = lo * B + k
        return Shape(B, D, self.passes(B + D) if B else 0.0, self.passes(B) if B else 0.0, keys / 1e3, pairs / 1e3,
                     (total + B) / 1e3)

    def _items(self, q: int) -> int:
        return -(-q // self.row_block) if self.row_block else 1


@dataclass(frozen=True)
class Shape:
    seqs: int
    drafts: int
    passes: float
    plain_passes: float
    keys: float
    draft_keys: float
    plain_keys: float  # K of the same sequences decoding without drafts

    def features(self) -> np.ndarray:
        return np.array([1.0, self.seqs, self.keys, self.plain_passes - 1.0, float(self.drafts > 0), self.drafts,
                         self.passes - self.plain_passes, self.draft_keys])

    def plain(self) -> Shape:
        """The same sequences decoding without drafts."""
        return Shape(self.seqs, 0, self.plain_passes, self.plain_passes, self.plain_keys, 0.0, self.plain_keys)


class _Sums:
    def __init__(self):
        self.xx = np.zeros((NF, NF))
        self.xy = np.zeros(NF)
        self.n = 0.0

    def add(self, x: np.ndarray, y: float, decay: float, weight: float = 1.0) -> None:
        self.xx = decay * self.xx + weight * np.outer(x, x)
        self.xy = decay * self.xy + weight * y * x
        self.n = decay * self.n + weight

    def halve(self) -> None:
        self.xx *= 0.5
        self.xy *= 0.5
        self.n *= 0.5


def _ridge_solve(xx: np.ndarray, xy: np.ndarray, lam: np.ndarray, target: np.ndarray) -> np.ndarray:
    """argmin |X w - y|^2 + sum lam_j (w_j - target_j)^2, with the NONNEG prices kept >= 0 (a negative one is fixed
    at 0 and the rest refitted: clamping afterwards would leave the others wrong)."""
    a = xx + np.diag(lam)
    b = xy + lam * target
    free = list(range(NF))
    while True:
        w = np.zeros(NF)
        w[free] = np.linalg.solve(a[np.ix_(free, free)], b[free])
        negative = [j for j in free if j in NONNEG and w[j] < 0]
        if not negative:
            return w
        free.remove(min(negative, key=lambda j: w[j]))


def _row_prior(w: np.ndarray) -> np.ndarray:
    """What a draft term costs before it is measured: a draft row what a sequence's row costs (b), a weight stream
    its rows open what a plain step's extra stream costs (w), a thousand (draft row, key) pairs what a thousand keys
    cost a sequence (k): a pass's row is a row, whoever sent it."""
    target = np.zeros(NF)
    target[5], target[6], target[7] = w[1], w[3], w[2]
    return target


class StepTime:
    """The step-time model (see the module docstring): `record(shape, seconds)` after every decode step,
    `seconds(shape)` for any shape at that batch size."""

    def __init__(self, decay: float = 0.995, pool: float = 0.05, prior: float = 0.1):
        self.decay, self.pool, self.prior = decay, pool, prior
        self.all = _Sums()
        self.buckets: dict[int, _Sums] = {}
        self._w: dict[int | None, np.ndarray | None] = {}
        self._fresh: dict[int | None, float] = {}  # per fit (None: pooled), step weight added since it was solved
        self.solves = 0  # times the pooled fit was solved

    def record(self, shape: Shape, seconds: float, weight: float = 1.0) -> None:
        """A measured step, standing for `weight` steps of its kind (a probe stands for the steps since the last
        one: the selector's probes are rare by design, and without it a bucket's many steps of the chosen arm
        outvote what they measure). One that the bucket's fit misses by more than SURPRISE (its price moved:
        another load on the machine, a fit from steps of other shapes) halves what was measured before it, so a
        few such steps re-price it whatever it had learned. The fits are solved again lazily (FRESH, AGREE)."""
        x = shape.features()
        bucket = self.buckets.setdefault(batch_bucket(shape.seqs), _Sums())
        before = self.seconds(shape) if bucket.n > 0 else None
        if before is not None and abs(seconds - before) > SURPRISE * before:
            bucket.halve()
            self.all.halve()
        self.all.add(x, seconds, self.decay, weight)
        bucket.add(x, seconds, self.decay, weight)
        b = batch_bucket(shape.seqs)
        for key in (None, b):
            self._fresh[key] = self._fresh.get(key, 0.0) + weight
        if before is None or abs(seconds - before) > AGREE * before or self._fresh[None] > FRESH * self.all.n:
            self._refit()
        elif self._fresh[b] > FRESH * bucket.n:
            self._w.pop(b, None)

    def _refit(self) -> None:
        """Every fit is solved again when next asked."""
        self._w.clear()

    def end_rollout(self) -> None:
        """What was measured counts half from here on: the weights, the contexts and the machine's load move."""
        for s in [self.all, *self.buckets.values()]:
            s.halve()
        self._refit()

    def measured(self, B: int) -> bool:
        """Whether steps of this batch size's bucket were measured (before: the pooled fit stands in)."""
        s = self.buckets.get(batch_bucket(B))
        return s is not None and s.n > 0.5

    def seconds(self, shape: Shape) -> float | None:
        """Predicted seconds of a step of this shape; None before any step was measured."""
        w = self.coefficients(shape.seqs)
        return None if w is None else max(float(w @ shape.features()), 1e-6)

    def coefficients(self, B: int) -> np.ndarray | None:
        bucket = batch_bucket(B)
        if bucket not in self._w:
            self._w[bucket] = self._solve_bucket(bucket)
            self._fresh[bucket] = 0.0
        return self._w[bucket]

    def _scale(self) -> np.ndarray:
        """A feature's mean square over the recent steps (1 where it never varied): the ridge's units."""
        n = max(self.all.n, 1e-9)
        return np.maximum(np.diag(self.all.xx) / n, 1e-6)

    def _pooled(self) -> np.ndarray | None:
        if None not in self._w:
            if self.all.n <= 0:
                self._w[None] = None
            else:
                lam = self._scale() * 1e-3
                lam[4:] = self._scale()[4:] * self.prior
                w = _ridge_solve(self.all.xx, self.all.xy, lam, np.zeros(NF))
                for _ in range(2):  # the draft terms' prior: a row, a weight stream, a key read as a plain step's
                    w = _ridge_solve(self.all.xx, self.all.xy, lam, _row_prior(w))
                self._w[None] = w
                self._fresh[None] = 0.0
                self.solves += 1
        return self._w[None]

    def _solve_bucket(self, bucket: int) -> np.ndarray | None:
        pooled = self._pooled()
        s = self.buckets.get(bucket)
        if pooled is None or s is None or s.n <= 0:
            return pooled
        return _ridge_solve(s.xx, s.xy, self._scale() * self.pool, pooled)

