"""What a drafter's proposal costs, as the selector prices it (selector.py).

Most drafters propose one sequence at a time on the host: a proposal's seconds per sequence (an EMA over the steps
the drafter drafted), times the batch. A drafter whose proposal is one batched pass per draft level (`leveled`: the
self drafter, speculative/self_draft.py) costs levels x the seconds of a level at the batch's size instead: a
proposal for 16 sequences is not 16 of one, and a budget of 8 costs 8 levels where a budget of 1 costs one."""

from __future__ import annotations

from .step_cost import batch_bucket


class DraftCost:
    def __init__(self, drafters: list[str]):
        self.per_seq: dict[str, float] = {d: 0.0 for d in drafters}  # seconds per sequence proposal (EMA)
        self.leveled: set[str] = set()  # drafters priced per draft level (the speculator names them)
        self.level_s: dict[tuple[str, int], float] = {}  # (drafter, batch bucket) -> seconds of one level (EMA)
        self.levels: dict = {}  # arm -> levels its proposals ran (EMA; unmeasured: its budget)

    def seconds(self, arm, B: int) -> float:
        """Predicted seconds of the arm's proposal for B sequences. A leveled drafter's level before B's bucket is
        measured costs what the nearest measured bucket's did (the larger of two as near); nothing measured: 0, so
        that it is tried."""
        d = arm.drafter
        if d not in self.leveled:
            return B * self.per_seq[d]
        measured = [k for (name, k) in self.level_s if name == d]
        if not measured:
            return 0.0
        bucket = batch_bucket(B)
        near = min(measured, key=lambda k: (abs(k - bucket), -k))
        return self.levels.get(arm, float(arm.budget)) * self.level_s[(d, near)]

    def record(self, arm, B: int, draft_s: float, levels: int = 0) -> None:
        """A verified step's proposal: its seconds for B sequences and, for a leveled drafter, the levels it ran."""
        d = arm.drafter
        self.per_seq[d] += 0.2 * (draft_s / max(B, 1) - self.per_seq[d])
        if d in self.leveled and levels > 0:
            key, per = (d, batch_bucket(B)), draft_s / levels
            old = self.level_s.get(key)
            self.level_s[key] = per if old is None else old + 0.2 * (per - old)
            lv = self.levels.get(arm)
            self.levels[arm] = float(levels) if lv is None else lv + 0.2 * (levels - lv)
