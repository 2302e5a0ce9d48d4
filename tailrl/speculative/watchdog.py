"""Acceptance watchdog: a drafter whose acceptance collapses is reported and re-measured.

The most common silent failure of speculation in RL frameworks is a drafter that goes stale after a weight
sync: the policy moved, the drafter did not, and the accept length falls to about 1.0 while the run goes on
paying for drafts. Per drafter and per source (verified drafts, shadow drafts), acceptance = accepted draft
tokens / drafted tokens is summed over the current rollout and compared with a baseline carried over from
earlier rollouts; once the current rollout has enough evidence and its rate is below `drop` x the baseline,
the drafter is flagged (once per rollout) so the selector can forget its estimates and re-explore."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class _Track:
    baseline: float | None = None  # acceptance over earlier rollouts (EMA across rollouts)
    accepted: float = 0.0  # this rollout
    drafted: float = 0.0


class Watchdog:
    def __init__(self, drop: float = 0.4, min_drafted: int = 64, min_baseline: float = 0.15, alpha: float = 0.5):
        self.drop, self.min_drafted, self.min_baseline, self.alpha = drop, min_drafted, min_baseline, alpha
        self.tracks: dict[tuple[str, str], _Track] = {}
        self.flagged: dict[str, tuple[float, float]] = {}  # drafter -> (baseline, now), this rollout

    def observe(self, drafter: str, source: str, accepted: float, drafted: float) -> tuple[float, float] | None:
        """Adds one observation; returns (baseline, now) when the drafter turns stale with it."""
        t = self.tracks.setdefault((drafter, source), _Track())
        t.accepted += accepted
        t.drafted += drafted
        if drafter in self.flagged or t.baseline is None or t.baseline < self.min_baseline:
            return None
        if t.drafted >= self.min_drafted and t.accepted / t.drafted < self.drop * t.baseline:
            self.flagged[drafter] = (t.baseline, t.accepted / t.drafted)
            return self.flagged[drafter]
        return None

    def end_rollout(self, drafters: list[str]) -> dict[str, float]:
        """Closes a rollout: {drafter: 1.0 if it was flagged, else 0.0}; the baselines move to this rollout's
        rates (at once for a flagged drafter: its new level is the one to watch from now on)."""
        report = {d: float(d in self.flagged) for d in drafters}
        for (drafter, _), t in self.tracks.items():
            if t.drafted >= self.min_drafted:
                rate = t.accepted / t.drafted
                fresh = t.baseline is None or drafter in self.flagged
                t.baseline = rate if fresh else t.baseline + self.alpha * (rate - t.baseline)
            t.accepted = t.drafted = 0.0
        self.flagged = {}
        return report
