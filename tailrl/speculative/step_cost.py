"""A decode step's seconds per batch-size bucket, fitted locally: what the selector predicts arms from and what the
allocator prices draft rows with."""

from __future__ import annotations

import numpy as np

ROW_PRIOR = 0.3  # a draft row's cost in sequence-steps until the step cost is measured


def batch_bucket(B: int) -> int:
    return max(B - 1, 0).bit_length()  # 1 | 2 | 3-4 | 5-8 | 9-16 | ...


def attention_units(contexts: list[int], q_lens: list[int], block: int, chunk: int) -> int:
    """Key chunks a pass's attention reads: per sequence, its keys (cached + new) in chunks of `chunk`, read once per
    block of `block` query rows (a batch-invariant pass, model/chunked.py: QUERY_BLOCK rows a kernel item), or once
    for all its rows where block is 0 (a plain pass). At long contexts this, not the rows, is most of a CPU pass."""
    out = 0
    for ctx, q in zip(contexts, q_lens):
        out += (-(-q // block) if block else 1) * -(-(ctx + q) // chunk)
    return out


class StepCost:
    """Seconds of a decode step (forward, sampling, acceptance; drafting aside) as
        c * B + r * (rows - B) + v * [it verifies any draft row] + u * units,
    fitted per batch-size bucket over the recent steps of that bucket (forgetting factor `decay` per step). Local,
    because what a draft row costs relative to a sequence changes with the batch: in the tail a pass streams the
    weights whatever its few rows, at 64 sequences a row costs a fifth of a sequence-step (benchmarks/verify_cost.py,
    in git at 103a651), and one global line through both priced a row at 1.1 ms and a plain step of 2 at 57 ms where
    they cost 0.4 and 25. The per-verify term keeps a verify step's fixed work (walking the drafts, compacting the
    cache) off the rows.
    `units` are the key chunks the pass's attention reads (attention_units): a sequence's cost grows with what it
    holds (a plain step of 8 sequences over 900 tokens took 67 ms, over 100 tokens about 30), and in a
    batch-invariant pass a draft that spills into a second query block reads every chunk again. Without it a bucket's
    fit priced plain steps at the contexts its verify steps had seen, and the SD-off estimate of a 1,024-token
    rollout came out 15-38% short.

    A ridge prior pulls r towards ROW_PRIOR of the bucket's cost per sequence and v towards 0, each worth
    `prior_steps` steps, and each rollout's end halves what was measured: the fit learns a row's price only from steps
    that verify rows, so without the prior a price that came out high stopped all verification in its bucket and was
    never corrected (seed 1 of the default run, session 10). u's prior (towards 0) weighs a twentieth of that: rows
    and chunks grow together in verify steps, and a stronger pull let the rows take the chunks' price (the plain step
    at 1,000 tokens came out 26% short in tests/test_allocate.py's tail, 6% with this one). Where the chunks only
    follow the batch (one context), the pull leaves their price in c, as before."""

    def __init__(self, decay: float = 0.98, prior_steps: float = 2.0):
        self.decay, self.prior_steps = decay, prior_steps
        self.fits: dict[int, list] = {}  # bucket -> [xx (4x4), xy (4), steps (decayed count)]
        self._solved: dict[int, tuple[float, float, float, float] | None] = {}  # bucket -> coefficients

    def record(self, B: int, rows: int, seconds: float, units: float = 0.0) -> None:
        x = np.array([float(B), float(rows - B), float(rows > B), float(units)])
        fit = self.fits.setdefault(batch_bucket(B), [np.zeros((4, 4)), np.zeros(4), 0.0])
        d = self.decay
        fit[0] = d * fit[0] + np.outer(x, x)
        fit[1] = d * fit[1] + seconds * x
        fit[2] = d * fit[2] + 1.0
        self._solved.pop(batch_bucket(B), None)

    def end_rollout(self) -> None:
        """What was measured counts half against the prior from here on (like the acceptance table): a price learned
        in one rollout is re-tried in the next ones unless verified steps keep confirming it."""
        for fit in self.fits.values():
            fit[0] *= 0.5
            fit[1] *= 0.5
            fit[2] *= 0.5
        self._solved.clear()

    def coefficients(self, B: int) -> tuple[float, float, float] | None:
        """(seconds per sequence, per draft row, per verify step) at this batch size; None before the bucket's
        first step. The attention's share (`seconds`) is left out: what the allocator compares is rows."""
        w = self._coef(B)
        return None if w is None else w[:3]

    def seconds(self, B: int, rows: float, units: float = 0.0) -> float | None:
        """Predicted seconds of a step of B sequences, `rows` rows in all, reading `units` key chunks; None before
        the bucket's first step."""
        w = self._coef(B)
        if w is None:
            return None
        c, r, v, u = w
        return c * B + r * (rows - B) + (v if rows > B else 0.0) + u * units

    def _coef(self, B: int) -> tuple[float, float, float, float] | None:
        """Solved once per bucket between steps of it (the selector asks for every arm, every step)."""
        bucket = batch_bucket(B)
        if bucket not in self._solved:
            self._solved[bucket] = self._solve(self.fits.get(bucket))
        return self._solved[bucket]

    def _solve(self, fit: list | None) -> tuple[float, float, float, float] | None:
        if fit is None or fit[0][0, 0] <= 0:
            return None
        xx, xy, steps = fit[0].copy(), fit[1].copy(), fit[2]
        per_seq = xy[0] / xx[0, 0]  # as if every step were plain: the prior's scale
        mean_b2 = xx[0, 0] / steps  # a step's B^2: the prior counts as prior_steps steps of B draft rows each
        lam = self.prior_steps * mean_b2
        xx[1, 1] += lam
        xy[1] += lam * ROW_PRIOR * per_seq
        xx[2, 2] += self.prior_steps
        # u towards 0 at the scale of a step's units (1 where none were given: a zero column stays solvable)
        xx[3, 3] += 0.05 * self.prior_steps * max(xx[3, 3] / steps, 1.0)
        keep = [0, 1, 2, 3]
        while True:  # a negative price is refitted at 0 (clamping it afterwards would leave the others wrong)
            w = np.zeros(4)
            w[keep] = np.linalg.solve(xx[np.ix_(keep, keep)], xy[keep])
            negative = [j for j in keep[1:] if w[j] < 0]
            if not negative:
                break
            keep.remove(negative[-1])
        c, r, v, u = (float(x) for x in w)
        return (c, max(r, 0.0), max(v, 0.0), max(u, 0.0)) if c > 0 else None
