"""When moving a running sequence from a loaded worker to an idle one pays (RLHFSpec sample reallocation,
Seer's divided rollout).

The importer re-prefills prompt + tokens so far (no KV transfer), then decodes the rest. With r predicted
remaining tokens, a donor batch of B_src and a receiver batch of B_dst, and per-step times t(B) from the cost
model (`cost.StepCost`):
    stay:  r * t_src(B_src)
    move:  prefill(prompt + done) + r * t_dst(B_dst + 1)
and the move is made when `move * margin < stay`. A waiting sequence (nothing emitted yet) pays only the prefill
it would pay anyway, so it moves whenever the receiver runs a smaller batch. Moves go longest predicted
remaining first, and stop before the receiver would hold more sequences than the donor keeps.

Invariant: migration changes timing only. The sequence keeps its seed and sample index; sampling noise keyed by
(seed, position) makes the importer emit exactly the tokens the donor would have.
"""

from __future__ import annotations

from dataclasses import dataclass

from .cost import StepCost


@dataclass
class Candidate:
    key: object  # the caller's handle (e.g. the engine-local sequence id)
    prompt_len: int
    done: int  # tokens emitted so far (0: still waiting)
    remaining: float  # predicted tokens still to come


def move_pays(c: Candidate, b_src: int, b_dst: int, cost: StepCost, ctx_src: float = 0.0, ctx_dst: float = 0.0,
              margin: float = 1.1, queued_prefill: float = 0.0) -> bool:
    """ctx_src / ctx_dst: mean context per sequence on each side (attention cost); queued_prefill: tokens the
    receiver re-prefills before this one (moves made in the same round run their prefills first)."""
    if c.remaining <= 0 or b_dst + 1 > b_src:
        return False
    if c.done == 0:
        return True  # waiting: the prefill happens wherever it runs
    stay = c.remaining * cost.decode(b_src, ctx_src * b_src)
    move = (cost.prefill(queued_prefill + c.prompt_len + c.done)
            + c.remaining * cost.decode(b_dst + 1, ctx_dst * (b_dst + 1)))
    return move * margin < stay


def plan_moves(cands: list[Candidate], b_dst: int, cost: StepCost, min_donor: int = 2, margin: float = 1.1,
               max_moves: int | None = None) -> list[Candidate]:
    """Which of a donor's sequences (running and waiting) go to a receiver that runs b_dst sequences. The donor
    gives only while it holds at least `min_donor` sequences and more than the receiver would after the move;
    waiting sequences go first (no extra prefill), then the longest predicted remaining."""
    b_src = len(cands)
    if b_src < min_donor:
        return []
    ctx = sum(c.prompt_len + c.done for c in cands) / b_src
    moves, queued = [], 0
    for c in sorted(cands, key=lambda c: (c.done > 0, -c.remaining)):
        if max_moves is not None and len(moves) >= max_moves:
            break
        if b_src - 1 < b_dst + 1:
            break
        if move_pays(c, b_src, b_dst, cost, ctx, ctx, margin, queued):
            moves.append(c)
            queued += c.prompt_len + c.done if c.done else 0
            b_src -= 1
            b_dst += 1
    return moves
