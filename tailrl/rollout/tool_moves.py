"""Which trajectories move between Ray workers mid-rollout (RLHFSpec's sample reallocation, Seer's divided rollout,
for multi-turn work; the single-turn path's is cluster/reallocate.py): after a round, the least loaded workers
take trajectories from the worker whose engine holds the most predicted work, as many as the cost rule
(cluster/migrate.plan_moves: re-prefill on the receiver against decoding on in the donor's larger batch) says
pay, never so many that the receiver would run more than the donor keeps.

A trajectory's remaining tokens are predicted from this rollout's ends (the mean drawn tokens of the trajectories
that ended so far, as cluster/placement.LengthPredictor.remaining does for an unseen prompt): a trajectory that ran
long is expected to run on (at least half again what it drew). Only a turn in the engine moves: one waiting on its
tool call stays where its call runs.

Invariant: planning changes where a trajectory runs, never its tokens (its turn seed and positions travel with it,
tool_turns.ToolTurns.hand_over)."""

from __future__ import annotations

from typing import NamedTuple

from ..cluster.cost import StepCost
from ..cluster.migrate import Candidate, plan_moves


class Move(NamedTuple):
    donor: int
    receiver: int
    keys: list  # (label, sample) of the trajectories it moves


def remaining(drawn: int, typical: float) -> float:
    """Predicted drawn tokens still to come of a trajectory that has drawn `drawn` (typical: the mean of those
    that ended; 0 when none has)."""
    return max(typical - drawn, 0.5 * drawn, 1.0)


def plan(movable: dict[int, list], load: dict[int, int], live: list[int], typical: float, cost: StepCost,
         min_running: int = 2, margin: float = 1.1) -> list[Move]:
    """movable[w]: (label, sample, context, current turn's tokens, drawn tokens) of each trajectory in worker w's
    engine (ToolTurns.movable); load[w]: its unfinished trajectories (with those waiting on a call, which come
    back to its engine). Receivers, the least loaded first, each take from the donor with the most predicted tokens
    left among those whose engines hold at least two more trajectories than the receiver runs."""
    left = {w: list(movable.get(w, [])) for w in live}
    load = {w: load.get(w, 0) for w in live}
    moves = []
    for recv in sorted(live, key=lambda w: (load[w], w)):
        donors = [w for w in live if w != recv and len(left[w]) >= max(min_running, load[recv] + 2)]
        if not donors:
            continue
        donor = max(donors, key=lambda w: (sum(remaining(x[4], typical) for x in left[w]), -w))
        receivers = sum(1 for w in live if load[w] + 2 <= len(left[donor]))
        cands = [Candidate((x[0], x[1]), x[2], x[3], remaining(x[4], typical)) for x in left[donor]]
        picked = plan_moves(cands, load[recv], cost, min_running, margin,
                            max_moves=max((len(cands) - load[recv]) // max(receivers, 1), 1))
        if not picked:
            continue
        keys = {c.key for c in picked}
        moves.append(Move(donor, recv, [c.key for c in picked]))
        left[recv] += [x for x in left[donor] if (x[0], x[1]) in keys]
        left[donor] = [x for x in left[donor] if (x[0], x[1]) not in keys]
        load[recv] += len(keys)
        load[donor] -= len(keys)
    return moves
