"""A decode step's seconds per batch-size bucket, fitted locally: what the selector predicts arms from and what the
allocator prices draft rows with."""

from __future__ import annotations

import numpy as np

ROW_PRIOR = 0.3  # a draft row's cost in sequence-steps until the step cost is measured


def batch_bucket(B: int) -> int:
    return max(B - 1, 0).bit_length()  # 1 | 2 | 3-4 | 5-8 | 9-16 | ...


class StepCost:
    """Seconds of a decode step (forward, sampling, acceptance; drafting aside) as
        c * B + r * (rows - B) + v * [it verifies any draft row],
    fitted per batch-size bucket over the recent steps of that bucket (forgetting factor `decay` per step). Local,
    because what a draft row costs relative to a sequence changes with the batch: in the tail a pass streams the
    weights whatever its few rows, at 64 sequences a row costs a fifth of a sequence-step (benchmarks/verify_cost.py),
    and one global line through both priced a row at 1.1 ms and a plain step of 2 at 57 ms where they cost 0.4 and 25.
    The per-verify term keeps a verify step's fixed work (walking the drafts, compacting the cache) off the rows.

    A ridge prior pulls r towards ROW_PRIOR of the bucket's cost per sequence and v towards 0, worth `prior_steps`
    steps, and each rollout's end halves what was measured: the fit learns a row's price only from steps that
    verify rows, so without the prior a price that came out high stopped all verification in its bucket and was
    never corrected (seed 1 of the default run, session 10)."""

    def __init__(self, decay: float = 0.98, prior_steps: float = 2.0):
        self.decay, self.prior_steps = decay, prior_steps
        self.fits: dict[int, list] = {}  # bucket -> [xx (3x3), xy (3), steps (decayed count)]
        self._solved: dict[int, tuple[float, float, float] | None] = {}  # bucket -> coefficients, until it changes

    def record(self, B: int, rows: int, seconds: float) -> None:
        x = np.array([float(B), float(rows - B), float(rows > B)])
        fit = self.fits.setdefault(batch_bucket(B), [np.zeros((3, 3)), np.zeros(3), 0.0])
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
        first step. Solved once per bucket between steps of it (the selector asks for every arm, every step)."""
        bucket = batch_bucket(B)
        if bucket not in self._solved:
            self._solved[bucket] = self._solve(self.fits.get(bucket))
        return self._solved[bucket]

    def _solve(self, fit: list | None) -> tuple[float, float, float] | None:
        if fit is None or fit[0][0, 0] <= 0:
            return None
        xx, xy, steps = fit[0].copy(), fit[1].copy(), fit[2]
        per_seq = xy[0] / xx[0, 0]  # as if every step were plain: the prior's scale
        mean_b2 = xx[0, 0] / steps  # a step's B^2: the prior counts as prior_steps steps of B draft rows each
        lam = self.prior_steps * mean_b2
        xx[1, 1] += lam
        xy[1] += lam * ROW_PRIOR * per_seq
        xx[2, 2] += self.prior_steps
        keep = [0, 1, 2]
        while True:  # a negative price is refitted at 0 (clamping it afterwards would leave the others wrong)
            w = np.zeros(3)
            w[keep] = np.linalg.solve(xx[np.ix_(keep, keep)], xy[keep])
            negative = [j for j in keep[1:] if w[j] < 0]
            if not negative:
                break
            keep.remove(negative[-1])
        c, r, v = (float(x) for x in w)
        return (c, max(r, 0.0), max(v, 0.0)) if c > 0 else None
