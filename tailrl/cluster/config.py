"""Multi-worker rollout settings (the `cluster:` config section), validated on construction."""

from __future__ import annotations

from dataclasses import dataclass

PLACEMENTS = ("histopipe", "static")


@dataclass
class ClusterConfig:
    address: str = ""  # "": start a local Ray; "auto" or "host:port": join an existing Ray cluster
    placement: str = "histopipe"  # histopipe (LPT on predicted lengths, longest first) | static (contiguous split)
    migrate: bool = True  # move sequences from loaded workers to idle ones when the cost rule says it pays
    migrate_min_running: int = 2  # a donor must hold at least this many sequences
    migrate_margin: float = 1.1  # a move must beat staying by this factor (cost rule)
    sibling_drafting: bool = True  # forward each round's new tokens to the workers holding the group's siblings
    idle_train: bool = True  # workers with nothing to decode run drafter training (when a learned drafter trains)
    round_s: float = 0.25  # a worker runs engine steps for about this long between driver rounds
    round_steps: int = 0  # ... or at most this many engine steps (0: no limit; tests use it for determinism)
    step_timeout_s: float = 600.0  # a worker that does not answer a round within this is treated as dead

    def __post_init__(self):
        if self.placement not in PLACEMENTS:
            raise ValueError(f"cluster.placement={self.placement!r}: choose one of {', '.join(PLACEMENTS)}")
        if self.round_steps < 0 or self.migrate_min_running < 1 or self.migrate_margin < 1.0:
            raise ValueError("cluster.round_steps must be >= 0, migrate_min_running >= 1 and migrate_margin >= 1")
        if not self.round_s > 0 or not self.step_timeout_s > 0:
            raise ValueError("cluster.round_s and cluster.step_timeout_s must be > 0")
