"""What the selector measures of acceptance: a drafter arm's tokens per sequence-step (`Rate`), and one sequence's
share of it (`SeqAccept`), and the share of the sequence the rollout waits for (`critical_factor`)."""

from __future__ import annotations


class Rate:
    """Tokens per sequence-step (accepted, or drafted), as exponentially decayed sums over sequence-steps: a
    32-sequence step weighs 32 single-sequence shadow observations, and one lucky sequence moves it little."""

    def __init__(self, half_life: float = 200.0):
        self.decay = 0.5 ** (1 / half_life)
        self.total = 0.0
        self.weight = 0.0

    def add(self, value_sum: float, seq_steps: int) -> None:
        d = self.decay**seq_steps
        self.total = self.total * d + value_sum
        self.weight = self.weight * d + seq_steps

    def mean(self, default: float) -> float:
        return self.total / self.weight if self.weight > 0 else default


class SeqAccept:
    """One sequence's share of its drafters' acceptance: accepted tokens on its verified steps over what the
    selector expected of the arm there, decayed (its text now counts more than its text long ago) and pulled
    towards 1 by PRIOR_STEPS expected steps. The sequences a rollout's tail is left with are those whose drafts
    failed (the others finished early): priced at the drafters' mean, the tail was predicted 1.5x and measured
    1.2x (benchmarks/RESULTS.md section 25)."""

    PRIOR_STEPS, DECAY = 1.0, 0.9

    def __init__(self):
        self.got = 0.0
        self.expected = 0.0

    def add(self, accepted: float, expected: float) -> None:
        self.got = self.DECAY * self.got + accepted
        self.expected = self.DECAY * self.expected + expected

    def factor(self, mean: float) -> float:
        """mean: the drafters' expected accepted tokens per step (the prior's unit)."""
        prior = self.PRIOR_STEPS * max(mean, 0.05)
        return (self.got + prior) / (self.expected + prior)


def critical_factor(factors: list[float], remaining: list[int | None]) -> float:
    """The acceptance factor of the sequence the rollout waits for (Selector.worth). remaining: tokens left per
    sequence, predicted from history, None where a sequence has none. Among those predicted to have the most left
    (at least 0.8 of the most), the least (the rollout waits for the slowest; drafts accepted now and then by each of
    15 sequences move their mean, not their minimum). Sequences with no prediction (a prompt's first visit) could
    each be the one the rollout waits for and which runs longest is not known: they count at their mean (at their
    least, a first visit valued every draft at its worst acceptor's, 0.15 of the mean, and the guard then vetoed
    the n-gram arm that ran 1.30x of SD off: benchmarks/RESULTS.md section 25)."""
    known = [(f, r) for f, r in zip(factors, remaining) if r is not None]
    unknown = [f for f, r in zip(factors, remaining) if r is None]
    out = sum(unknown) / len(unknown) if unknown else float("inf")
    if known:
        top = max(r for _, r in known)
        out = min(out, min(f for f, r in known if r >= 0.8 * top))
    return out
