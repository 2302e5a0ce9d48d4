"""The rollout ledger: what speculation bought over a whole rollout, by the selector's own SD-off estimate of the same
tokens (`spec/speedup_est`: the rollout's plain schedule priced by the step-time model, off_estimate.py), and the
plain rollouts it calls for where that estimate says speculation lost.

Why a rollout and not a step: the selector prices each step, and a step can pay as a step while the rollout gains
nothing: the rollout ends when its last sequence does, and drafts that finish easy sequences early leave the one it
waits for as far behind as before (a rollout capped at `max_tokens` runs as many steps with SD as without: benchmarks/
RESULTS.md section 25). Per step the prices cannot see that; the rollout's own estimate does, and tracked the
measured ratio within 2-8% per rollout there (0.90 / 0.90x, 0.93 / 0.89x, 1.20 / 1.16x estimate / measured), though
not on every shape (REST_BELOW): the ledger acts on clear losses only, the steps' own guard and probes on the rest.

The rule: a rollout whose estimate reads below REST_BELOW lost; the next rollouts decode plainly (no pricing, no
probes, no shadow drafts: SD off's own work), 1 after a first loss, doubling with each loss in a row up to REST_MAX;
then a rollout speculates again, and one that does not lose ends the streak. So where speculation keeps losing, at
most one rollout in REST_MAX + 1 runs it, and where it starts to pay (a later epoch has history) it is tried again
within REST_MAX rollouts. A rollout with no estimate (a partial rollout whose sequences carry on) changes nothing."""

from __future__ import annotations

from dataclasses import dataclass

# a rollout estimated below this share of SD off's speed lost. Not nearer 1: one rollout's estimate errs by up to
# 13-17% on the long preset (a rollout decoded wholly plainly read 1.13x; one measured 1.16x of SD off's read 0.97x,
# and at 0.98 the ledger rested the rollout after it: benchmarks/RESULTS.md section 25), by 2-4% at 96 tokens
REST_BELOW = 0.90
REST_MAX = 8  # the longest rest, in rollouts


@dataclass
class Ledger:
    streak: int = 0  # rollouts in a row that speculated and lost
    rest: int = 0  # rollouts still to decode plainly, this one included while resting
    resting: bool = False  # this rollout decodes plainly
    last: float | None = None  # the estimate of the last rollout that speculated

    def end_rollout(self, speedup: float | None) -> None:
        """A rollout ended; speedup: its estimated speedup over SD off (None: not estimated)."""
        if self.resting:
            self.rest -= 1
            self.resting = self.rest > 0
            return
        if speedup is None:
            return
        self.last = speedup
        if speedup >= REST_BELOW:
            self.streak = 0
            return
        self.streak += 1
        self.rest = min(2 ** (self.streak - 1), REST_MAX)
        self.resting = True

    def metrics(self) -> dict[str, float]:
        """spec/rested: 1 for a rollout the ledger made decode plainly; spec/rest_streak: losing rollouts in a row."""
        return {"spec/rested": float(self.resting), "spec/rest_streak": float(self.streak)}
