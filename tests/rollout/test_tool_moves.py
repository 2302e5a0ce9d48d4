"""Which trajectories move between workers mid-rollout (rollout/tool_moves.py): only to a worker running at least two
fewer, from the donor with the most predicted work, the longest predicted first, as the cost rule allows."""

from tailrl.cluster.cost import StepCost
from tailrl.rollout.tool_moves import plan, remaining

COST = StepCost(prefill_token_s=0.0005)  # prefill cheaper a token than decode, as on every backend


def _engine(label, drawn, n=6):
    """n trajectories of group `label` in a worker's engine: (label, sample, context, turn tokens, drawn)."""
    return [(label, j, 40, drawn[j], drawn[j]) for j in range(n)]


def test_an_idle_worker_takes_the_longest_predicted_from_the_busiest_and_never_more_than_balance():
    movable = {0: _engine(0, [30, 2, 28, 3, 26, 1]), 1: _engine(1, [2] * 3, n=3), 2: []}
    moves = plan(movable, {0: 6, 1: 3, 2: 0}, [0, 1, 2], 10.0, COST)
    assert [(m.donor, m.receiver) for m in moves] == [(0, 2)]
    keys = moves[0].keys
    assert 0 < len(keys) <= 3 and all(k[0] == 0 for k in keys)
    # the longest predicted go first (drawn 30 then 28: a trajectory that ran long is expected to run on)
    assert keys[0] == (0, 0) and (len(keys) < 2 or keys[1] == (0, 2))


def test_no_move_without_a_gap_of_two_a_second_donor_or_a_move_that_pays():
    busy = {0: _engine(0, [20] * 3, n=3), 1: _engine(1, [20] * 2, n=2)}
    assert plan(busy, {0: 3, 1: 2}, [0, 1], 10.0, COST) == []  # 3 against 2: a move would only swap them
    waiting = {0: _engine(0, [0] * 4, n=4), 1: []}
    assert plan(waiting, {0: 4, 1: 0}, [0, 1], 10.0, COST)  # turns not begun move whenever the receiver runs fewer
    # a worker whose trajectories all wait on their calls counts them: 4 against 4 moves nothing
    assert plan({0: _engine(0, [20] * 4, n=4), 1: []}, {0: 4, 1: 4}, [0, 1], 10.0, COST) == []
    # one in the donor's engine is below migrate_min_running: nothing to take
    assert plan({0: _engine(0, [20], n=1), 1: []}, {0: 1, 1: 0}, [0, 1], 10.0, COST) == []


def test_remaining_runs_on_past_the_typical_length():
    assert remaining(4, 10.0) == 6.0 and remaining(30, 10.0) == 15.0 and remaining(0, 0.0) == 1.0
