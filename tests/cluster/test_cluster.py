"""Placement (HistoPipe), the migration cost rule and the step-cost model: pure functions, no Ray, no model."""

import random

import pytest

from tailrl.cluster.config import ClusterConfig
from tailrl.cluster.cost import StepCost
from tailrl.cluster.migrate import Candidate, move_pays, plan_moves
from tailrl.cluster.placement import (LengthPredictor, Unit, length_metrics, lpt, lpt_cost, place, prompt_key,
                                      split_units, static_split)


def optimal_makespan(works: list[float], W: int) -> float:
    """The least largest load over all assignments of works to W workers (branch and bound; small cases only)."""
    works, loads, best = sorted(works, reverse=True), [0.0] * W, [sum(works)]

    def place_from(i: int) -> None:
        if i == len(works):
            best[0] = min(best[0], max(loads))
            return
        for k in range(W):
            if loads[k] in loads[:k] or loads[k] + works[i] >= best[0]:  # a worker loaded like an earlier one: same
                continue
            loads[k] += works[i]
            place_from(i + 1)
            loads[k] -= works[i]

    place_from(0)
    return best[0]


def lpt_makespan(works: list[float], W: int) -> float:
    where = lpt(works, W)
    return max(sum(w for w, k in zip(works, where) if k == i) for i in range(W))


def test_lpt_within_grahams_bound():
    """Graham (1969): LPT's largest load is at most (4/3 - 1/(3W)) times the optimum, which is found by brute force
    here. 4 equal jobs over 3 workers (LPT = OPT = 2, above 4/3 of the averaged lower bound) and Graham's tight case
    (2W+1 jobs: LPT = 4W - 1 against OPT = 3W) are among the cases."""
    rng = random.Random(0)
    cases = [([1.0] * 4, 3)]
    for W in (2, 3):  # jobs 2W-1, 2W-1, 2W-2, 2W-2, ..., W+1, W+1, W, W, W
        cases.append(([float(j) for j in range(2 * W - 1, W, -1) for _ in range(2)] + [float(W)] * 3, W))
    for _ in range(40):
        n = rng.randint(1, 9)
        works = [float(rng.randint(1, 12)) for _ in range(n)] if rng.random() < 0.5 else \
            [rng.choice([1, 2, 3, 50, 400]) * rng.random() for _ in range(n)]
        cases.append((works, rng.randint(1, 4)))
    for works, W in cases:
        where = lpt(works, W)
        assert set(where) <= set(range(W))
        opt = optimal_makespan(works, W)
        assert opt - 1e-9 <= lpt_makespan(works, W) <= (4 / 3 - 1 / (3 * W)) * opt + 1e-9, (works, W, opt)
    assert lpt_makespan(*cases[0]) == 2.0
    for works, W in cases[1:3]:  # Graham's tight case: LPT meets the bound
        assert lpt_makespan(works, W) == 4 * W - 1 and optimal_makespan(works, W) == 3 * W


def test_place_covers_every_sample_once_and_runs_longest_first():
    rng = random.Random(1)
    units = [Unit(i, 0, rng.choice([1, 4, 8]), rng.choice([10, 100, 1000])) for i in range(13)]
    for cost in (None, StepCost()):
        plan = place(units, 5, cost=cost)
        seen = sorted((u.prompt_index, u.first + j) for w in plan for u in w for j in range(u.count))
        assert seen == sorted((u.prompt_index, j) for u in units for j in range(u.count))
        for w in plan:
            assert [u.predicted for u in w] == sorted((u.predicted for u in w), reverse=True)


def test_split_gives_every_worker_work_and_never_splits_a_sample():
    units = split_units([Unit(0, 0, 8, 100.0), Unit(1, 0, 1, 5.0)], 6)
    assert len(units) >= 6 and all(u.count >= 1 for u in units)
    assert sum(u.count for u in units if u.prompt_index == 0) == 8
    assert sorted(u.first for u in units if u.prompt_index == 0) == sorted({u.first for u in units if u.prompt_index == 0})


def test_histopipe_beats_static_on_sorted_lengths():
    units = [Unit(i, 0, 4, 1000.0 if i < 4 else 10.0) for i in range(16)]  # the long groups come first
    static = [sum(u.work for u in w) for w in static_split(units, 4)]
    histo = [sum(u.work for u in w) for w in place(units, 4, split=False)]
    assert max(histo) < max(static)
    assert histo == [4120.0] * 4  # one long group and three short ones per worker


def test_cost_aware_lpt_gives_long_units_their_own_workers():
    cost = StepCost(base_s=0.03, per_token_s=0.001)
    units = [Unit(0, 0, 1, 5000.0), Unit(1, 0, 1, 4000.0)] + [Unit(i, 0, 4, 100.0) for i in range(2, 12)]
    where = lpt_cost(units, 4, cost)
    assert where[0] != where[1]
    assert all(where[i] not in (where[0], where[1]) for i in range(2, 12))


def test_predictor_history_then_task_mean_then_prior():
    p = LengthPredictor(prior=64)
    assert p.predict([1, 2, 3], "lvl1") == 64
    p.observe([1, 2, 3], "lvl1", [10, 30])
    assert p.predict([1, 2, 3], "lvl1") == 20  # its own history
    assert p.predict([9, 9], "lvl1") == 20  # unseen: the task's running mean
    assert p.predict([9, 9], "lvl2") == 20  # unseen task: the global mean
    assert p.predict("a text prompt") == 20
    p.observe([1, 2, 3], "lvl1", [50, 70])
    assert p.predict([1, 2, 3]) == 40  # the last `keep` epochs
    assert p.remaining([1, 2, 3], None, 45, 512) == pytest.approx(((50 - 45) + (70 - 45)) / 2)
    assert p.remaining([1, 2, 3], None, 100, 512) == 50  # beyond all history: half of what is done
    assert p.remaining([1, 2, 3], None, 500, 512) == 12  # capped by max_tokens
    q = LengthPredictor(prior=1)
    q.load_state_dict(p.state_dict())
    assert q.predict([1, 2, 3]) == 40 and prompt_key([1, 2, 3]) == prompt_key((1, 2, 3))


def test_length_metrics():
    m = length_metrics([1, 2, 3], [2, 4, 6])
    assert m["cluster/len_pred_corr"] == pytest.approx(1.0)
    assert m["cluster/len_pred_mae"] == pytest.approx(2.0)


def test_move_pays_only_when_the_receiver_finishes_it_sooner():
    cost = StepCost(base_s=0.03, per_token_s=0.0035)
    long_tail = Candidate("a", prompt_len=100, done=500, remaining=3000)
    assert move_pays(long_tail, b_src=16, b_dst=0, cost=cost)
    assert not move_pays(Candidate("b", 100, 500, 5), b_src=16, b_dst=0, cost=cost)  # re-prefill > what is left
    assert not move_pays(long_tail, b_src=2, b_dst=2, cost=cost)  # the receiver is as loaded as the donor
    flat = StepCost(base_s=0.03, per_token_s=0.0)  # memory-bound decode: batch size costs nothing
    assert not move_pays(long_tail, b_src=16, b_dst=0, cost=flat)
    assert move_pays(Candidate("w", 100, 0, 50), b_src=3, b_dst=0, cost=flat)  # waiting: only the prefill it owes


def test_plan_moves_balances_and_prefers_waiting_then_longest():
    cost = StepCost(base_s=0.03, per_token_s=0.0035)
    cands = [Candidate(i, 50, 200, r) for i, r in enumerate([100, 4000, 2500, 3000])] + [Candidate("w", 50, 0, 500)]
    moves = plan_moves(cands, 0, cost)
    assert [c.key for c in moves] == ["w", 1]  # 5 held: the receiver takes 2, the donor keeps 3
    assert plan_moves(cands[:1], 0, cost) == []  # below min_donor
    assert len(plan_moves(cands, 0, cost, max_moves=1)) == 1


def test_cost_fit_recovers_coefficients():
    true = StepCost(0.02, 0.003, 1e-6, 0.05, 0.004)
    samples = [(t, c, true.forward(t, c)) for t in (1, 4, 16, 64) for c in (100, 5000, 20000)]
    fit = StepCost.fit(samples, [(p, true.prefill(p)) for p in (40, 400)])
    assert fit.base_s == pytest.approx(0.02, rel=1e-6) and fit.per_token_s == pytest.approx(0.003, rel=1e-6)
    assert fit.per_attn_s == pytest.approx(1e-6, rel=1e-6)
    assert fit.prefill(1000) == pytest.approx(0.05 + 4.0, rel=1e-6)


def test_cluster_config_validates():
    with pytest.raises(ValueError, match="placement"):
        ClusterConfig(placement="random")
    with pytest.raises(ValueError, match="round_steps"):
        ClusterConfig(round_steps=-1)


def test_config_keys():
    from tailrl.config import ConfigError, load_config

    cfg = load_config(None, ["rollout.workers=4", "rollout.worker_threads=2", "cluster.address=auto",
                             "cluster.migrate=false", "cluster.step_timeout_s=30"])
    assert cfg.rollout.workers == 4 and cfg.cluster.address == "auto" and not cfg.cluster.migrate
    with pytest.raises(ConfigError, match="cluster"):
        load_config(None, ["cluster.placement=random"])
    with pytest.raises(ConfigError, match="rollout.workers"):
        load_config(None, ["rollout.workers=0"])
