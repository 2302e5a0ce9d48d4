"""What the selector chooses between (`Arm`: a drafter and its budget, OFF = plain decoding) and what it says of its
last choice (`Decision`: the step records and metrics carry it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


class Arm(NamedTuple):  # a tuple: the selector's tables are keyed by arm, and a tuple hashes in C
    drafter: str  # "" = off
    budget: int = 0

    def __str__(self) -> str:
        return f"{self.drafter}:{self.budget}" if self.drafter else "off"


OFF = Arm("")


@dataclass
class Decision:
    """Why a step ran what it ran: the arm, its predicted tokens / s, OFF's (None: not predictable yet), and
    whether it was a probe."""

    arm: Arm = OFF
    predicted: float | None = None
    off: float | None = None
    probe: bool = False
    weight: float = 1.0  # steps of its kind the step stands for (a probe: the steps since the last one)
    worth: float = 1.0  # what an accepted token was worth (Selector.worth)
    far: bool = False  # decoding plainly, the best drafter arm predicted below `Selector.far` of OFF or vetoed

    def __post_init__(self):
        self.far = self.far and self.arm == OFF
