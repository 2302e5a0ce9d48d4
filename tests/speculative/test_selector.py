"""The selector against a fake clock: worlds whose step seconds and acceptance are known, so what the right arm is at
each batch size is computed, not assumed, and the selector must find it from what it measures.

A world prices a pass like a CPU does (a weight stream per product call of CALL rows, each row's arithmetic and
sampling, the attention over each sequence's keys), with 3% multiplicative noise; a draft token is accepted with
probability `accept` given its parent was (a chain). Fixed seeds; the tolerances are stated per test."""

from __future__ import annotations

import random

import numpy as np
import pytest

from tailrl.speculative.off_estimate import off_seconds, turn_starts
from tailrl.speculative.selector import OFF, PROBE_MAX
from tailrl.speculative.step_cost import Geometry, StepTime
from tests.speculative.selector_helpers import (BUDGETS, CALL, EXPENSIVE, ITEM, TAIL_ONLY, TILE, World, make_selector, off_rate,
                                    rate, right_share, run, trained)


def test_the_worlds_say_what_the_tests_claim():
    """The premises, computed: drafts never pay in EXPENSIVE; in TAIL_ONLY they pay at 1-4 sequences and not at
    32-64, and a price of a row that is one constant share of a sequence's step cannot tell the two apart."""
    for B in (1, 4, 16, 64):
        assert EXPENSIVE.best([200] * B)[0] == 0
    assert [TAIL_ONLY.best([200] * B)[0] > 0 for B in (1, 2, 4, 32, 64)] == [True, True, True, False, False]


@pytest.mark.parametrize("B", [64, 16, 4, 1])
def test_where_drafts_never_pay_the_selector_converges_to_off_and_stays_there(B):
    """After a bounded exploration (the untried drafter once, optimistic prices measured away in a few steps), at
    most one step in PROBE_MAX speculates; over the whole run it is within 3% of plain decoding's tokens / s."""
    sel = make_selector()
    steps = run(sel, EXPENSIVE, B, 400)
    spec_late = sum(d > 0 for d, _, _ in steps[100:])
    assert spec_late <= 300 // PROBE_MAX + 2, spec_late
    assert sum(d > 0 for d, _, _ in steps) <= 16
    assert rate(steps) >= 0.97 * off_rate(EXPENSIVE, B, 400)


def test_drafts_run_only_at_the_batch_sizes_where_they_pay():
    """The same selector through a rollout's batch sizes, large to small (and again: a second rollout): at 1-4
    sequences it speculates at a depth within 3% of the best, at 32-64 it decodes plainly, 90% of the steps after
    the first 60 of each batch size."""
    sel = make_selector()
    for _ in range(2):
        for B in (64, 32, 4, 2, 1):
            steps = run(sel, TAIL_ONLY, B, 200, seed=B)
            share = right_share(sel, TAIL_ONLY, B, steps[60:])
            assert share >= 0.9, (B, share)
        sel.end_rollout()


class ConstantRowTime(StepTime):
    """A selector that prices a draft row at a constant share of a sequence's plain step (today's ROW_PRIOR
    approach): the tests above must fail for it."""

    share = 0.3

    def seconds(self, shape):
        plain = super().seconds(shape.plain())
        return None if plain is None else plain * (1 + self.share * shape.drafts / shape.seqs)


def test_a_constant_price_of_a_draft_row_fails_these_tests():
    sel = make_selector()
    sel.time = ConstantRowTime()
    shares = {}
    for B in (64, 32, 4, 1):
        steps = run(sel, TAIL_ONLY, B, 200, seed=B)
        shares[B] = right_share(sel, TAIL_ONLY, B, steps[60:])
    assert min(shares.values()) < 0.9, shares


@pytest.mark.parametrize("factor", [3.0, 1 / 3.0])
def test_a_price_learned_3x_wrong_either_way_is_measured_away(factor):
    """The selector first learns a world whose draft rows and weight streams cost `factor` times the truth's (a
    stale fit: another CPU's kernels, the machine's load, the policy before a sync), then meets the truth: within
    150 steps of each batch size it runs the right arm 90% of the time."""
    truth = TAIL_ONLY
    stale = World(stream_s=truth.stream_s * factor, row_s=truth.row_s * factor, accept=truth.accept)
    sel = make_selector()
    for B in (64, 32, 4, 1):
        run(sel, stale, B, 150, seed=B)
    for B in (64, 32, 4, 1):
        steps = run(sel, truth, B, 300, seed=100 + B)
        share = right_share(sel, truth, B, steps[150:])
        assert share >= 0.9, (factor, B, share)


def test_plain_decodings_price_stays_measured_while_speculating():
    """Where it speculates (1-4 sequences in TAIL_ONLY), what it says plain decoding would have cost (the SD-off
    estimate behind spec/speedup_est) is within 10% of the world's plain step at the contexts reached."""
    sel = make_selector()
    for B in (4, 2, 1):
        run(sel, TAIL_ONLY, B, 300, seed=B, ctx=600)
        contexts = [600 + 7 * i + 300 * 3 for i in range(B)]
        est, truth = sel.plain_step_s(contexts), TAIL_ONLY.seconds(contexts, 0)
        assert est == pytest.approx(truth, rel=0.1), (B, est, truth)


def test_the_step_time_model_separates_a_weight_stream_from_a_row():
    """Fitted on noiseless steps of one bucket at depths 0, 1 and 7 (16, 32 and 128 rows at 16 sequences), it prices
    a depth it never ran (3: 64 rows, two streams) within 5%."""
    sel = make_selector()
    world = World(noise=0.0)
    contexts = [300 + i for i in range(16)]
    for k in range(30):
        d = (0, 1, 7)[k % 3]
        sel.time.record(sel.geometry.shape(contexts, [d] * 16), world.seconds(contexts, d))
    got = sel.time.seconds(sel.geometry.shape(contexts, [3] * 16))
    assert got == pytest.approx(world.seconds(contexts, 3), rel=0.05)
    assert np.isfinite(got)


def test_the_step_time_model_prices_nothing_below_zero():
    """Verify steps measured faster than plain ones (noise, a pause in a plain step) would fit a negative price for
    a draft row: it is refitted at 0, so a draft is never priced cheaper than the plain step it extends."""
    sel = make_selector()
    contexts = [100] * 4
    for _ in range(20):
        for d, t in ((0, 0.010), (4, 0.009), (8, 0.006)):
            sel.time.record(sel.geometry.shape(contexts, [d] * 4), t)
    w = sel.time.coefficients(4)
    assert (w[2:] >= 0).all()
    plain, wide = sel.plain_step_s(contexts), sel.time.seconds(sel.geometry.shape(contexts, [8] * 4))
    assert wide >= plain and 0.006 <= plain <= 0.010


def test_the_plain_step_is_priced_at_the_context_it_runs_at():
    """The tail of a long rollout: contexts grow from 300 to 1,000 tokens, most steps verify drafts of 2-15 tokens
    and one in ten decodes plainly, and a step's cost grows with its keys. The plain step at 1,000 tokens (the SD-off
    estimate) comes out within 10% of the world's."""
    sel = make_selector()
    world = World()
    rng = random.Random(1)
    for step in range(300):
        contexts = [300 + 700 * step // 300] * 8
        d = 0 if step % 10 == 0 else (3, 7, 15, 3, 2)[step % 5]
        sel.time.record(sel.geometry.shape(contexts, [d] * 8), world.seconds(contexts, d, rng))
    assert sel.plain_step_s([1000] * 8) == pytest.approx(world.seconds([1000] * 8, 0), rel=0.1)


def test_the_sd_off_estimate_follows_the_rollouts_own_plain_schedule():
    """Sequences of 3, 5 and 5 tokens after prompts of 10: plain decoding runs decode steps 1-4 (the first token comes
    from the prefill), over 3 sequences at t = 1, 2 and over 2 at t = 3, 4; with a tail of at most 2 sequences the last
    two steps are the tail. Priced by the model as plain steps of those sequences at their contexts then."""
    sel = make_selector()
    world = World(noise=0.0)
    for B in (1, 2, 3):
        for c in (10, 14):
            sel.time.record(sel.geometry.shape([c] * B, [0] * B), world.seconds([c] * B, 0))
    assert off_seconds(sel.plain_step_s, [10, 10, 10], [3, 5, 5], tail=0) is not None
    body, tail = off_seconds(sel.plain_step_s, [10, 10, 10], [3, 5, 5], tail=2)
    want_body = sum(sel.plain_step_s([10 + t - 1] * 3) for t in (1, 2))
    want_tail = sum(sel.plain_step_s([10 + t - 1] * 2) for t in (3, 4))
    assert body == pytest.approx(want_body) and tail == pytest.approx(want_tail)
    assert want_tail < want_body  # two sequences' steps cost less than three's
    assert off_seconds(make_selector().plain_step_s, [10], [4], tail=0) is None  # nothing priced yet


def test_a_token_the_rollout_does_not_wait_for_is_worth_its_row_not_a_step():
    """Where a step costs about the same for 16 sequences as for 8 (weight streams, not rows) and no request waits,
    drafts that only the sequences ahead accept shorten nothing the rollout waits for: the 8 behind (the most
    tokens left) accept nothing. The selector decodes plainly there, and speculates for the same acceptance spread
    the other way round (the critical sequences accept) or where requests queue (a finished sequence makes room).
    Fails for a selector that values every accepted token at a plain step's share."""
    world = World(stream_s=0.02, row_s=0.0004, seq_s=0.00002, accept=0.7)
    sel = trained(world)
    contexts = [200 + 7 * i for i in range(16)]
    assert sel.choose(16, contexts) != OFF  # at the mean acceptance of the drafter, speculation pays here
    easy_ahead = [1.9] * 8 + [0.05] * 8
    left = [20] * 8 + [60] * 8
    assert sel.worth(contexts, easy_ahead, left) < 0.4  # 0.35 of a share here; 1.0 if priced at the share
    assert sel.choose(16, contexts, easy_ahead, left) == OFF
    assert sel.choose(16, contexts, easy_ahead[::-1], left) != OFF  # the critical sequences are the easy ones
    assert sel.worth(contexts, easy_ahead, left, queued=True) == pytest.approx(sum(easy_ahead) / 16)
    assert sel.choose(16, contexts, easy_ahead, left, queued=True) != OFF
    # where every sequence is alike, a token is worth a plain step's share, whatever is left (1% for the fit's noise)
    assert sel.worth(contexts, [1.0] * 16, [50] * 16) == pytest.approx(1.0, rel=0.01)


def test_on_a_first_visit_a_token_is_worth_the_mean_acceptance_not_the_worst():
    """With no length predicted for any sequence (a prompt's first visit) which one the rollout will wait for is not
    known: a token is worth the sequences' mean acceptance, so the same spread that makes the rollout wait for its
    non-accepting half where history predicts it (previous test) still speculates here. Fails for a selector that
    takes every sequence with no prediction as critical (the least of 16 factors: 0.05 of the mean, RESULTS 25)."""
    from tailrl.speculative.rates import critical_factor

    world = World(stream_s=0.02, row_s=0.0004, seq_s=0.00002, accept=0.7)
    sel = trained(world)
    contexts = [200 + 7 * i for i in range(16)]
    spread = [1.9] * 8 + [0.05] * 8
    unknown = [None] * 16
    assert sel.worth(contexts, spread, unknown) == pytest.approx(sum(spread) / 16, rel=0.01)
    assert sel.choose(16, contexts, spread, unknown) != OFF
    assert sel.choose(16, contexts, spread, [20] * 8 + [60] * 8) == OFF  # predicted: the rollout waits for 0.05
    # a mix: the predicted-longest count at their least, those with no prediction at their mean, the lower wins
    assert critical_factor([1.9, 0.3, 1.0, 0.6], [10, 50, None, None]) == pytest.approx(0.3)
    assert critical_factor([1.9, 1.2, 0.2, 0.6], [10, 50, None, None]) == pytest.approx(0.4)
    assert critical_factor([1.9, 1.2, 1.0], [45, 50, 10]) == pytest.approx(1.2)  # 45 >= 0.8 * 50: critical too


def test_a_sequences_share_of_acceptance_follows_what_it_accepted():
    """SeqAccept: a sequence whose drafts are always rejected falls below a tenth of the drafters' mean within 30
    verified steps, one that accepts what was expected stays at 1, and with nothing measured it is 1."""
    from tailrl.speculative.rates import SeqAccept

    hard, alike, new = SeqAccept(), SeqAccept(), SeqAccept()
    for _ in range(30):
        hard.add(0.0, 2.0)
        alike.add(2.0, 2.0)
    assert hard.factor(2.0) < 0.1
    assert alike.factor(2.0) == pytest.approx(1.0)
    assert new.factor(2.0) == 1.0


def test_an_untried_drafter_is_first_tried_where_a_step_of_it_costs_little():
    """A drafter never measured is tried at its smallest budget where the model (a draft row priced as a plain
    row) says the step costs at most try_cost of a plain one: not at 64 sequences where each row opens weight
    streams, at once at 4."""
    world = World(stream_s=0.02, row_s=0.0004, accept=0.7)
    sel = make_selector()
    for B in (64, 48, 4, 2):
        for _ in range(40):  # plain steps only: the selector sees no acceptance (no shadows here)
            contexts = [200 + 7 * i for i in range(B)]
            sel.record(OFF, sel.geometry.shape(contexts, [0] * B), world.seconds(contexts, 0), B, 0, 0.0)
    assert sel.choose(64, [200] * 64) == OFF
    assert sel.choose(4, [200] * 4).budget == min(BUDGETS)


def test_a_probe_of_an_arm_predicted_far_below_plain_waits_probe_max_steps():
    """Where drafts never pay by far (each row a weight stream), the selector, once it measured them, speculates at
    most once in PROBE_MAX steps (the interval probes of a close call start at PROBE_MIN)."""
    from tailrl.speculative.selector import PROBE_MIN

    world = World(stream_s=0.004, row_s=0.004, accept=0.2)
    sel = make_selector()
    steps = run(sel, world, 48, 400)
    late = [d for d, _, _ in steps[100:]]
    assert sum(d > 0 for d in late) <= len(late) // PROBE_MAX + 1, late
    assert PROBE_MIN < PROBE_MAX


def test_a_bucket_whose_speculative_steps_measure_slower_decodes_plainly():
    """The guard: where a bucket's speculative steps ran slower than the model's plain step for the same sequences
    (here: at 3x the seconds their prices said, a cost the model's features do not carry), the bucket decodes
    plainly within GUARD_STEPS such steps whatever the prices say; another bucket is untouched, and speculative
    steps measured paying again (a probe's) lift it."""
    from tailrl.speculative.selector import GUARD_STEPS

    sel = trained(TAIL_ONLY, sizes=(4, 4, 1), steps=80)
    contexts = [200 + 7 * i for i in range(4)]
    arm = sel.choose(4, contexts)
    assert arm != OFF and not sel.vetoed(4)
    shape = sel.geometry.shape(contexts, [arm.budget] * 4)
    slow = 3 * TAIL_ONLY.seconds(contexts, arm.budget)
    for _ in range(int(GUARD_STEPS) + 1):
        sel.decision.weight = 1.0
        sel.record(arm, shape, slow, 4 + 4, 4 * arm.budget, 0.0)
        sel.time = trained(TAIL_ONLY, sizes=(4, 1), steps=40).time  # prices stay those of the world without it
    assert sel.vetoed(4) and sel.choose(4, contexts) == OFF
    assert not sel.vetoed(1) and sel.choose(1, [200]) != OFF
    fast = TAIL_ONLY.seconds(contexts, arm.budget)
    for _ in range(40):
        sel.record(arm, shape, fast, 4 + 4 * 2, 4 * arm.budget, 0.0)
    assert not sel.vetoed(4)


def test_exploration_costs_at_most_its_credit():
    """Where drafts lose by 7-24% at 6-48 sequences and pay at 3 (probes of a close call, not a far one), with
    rollouts of 12 steps at each of five batch sizes and every rollout starting the probes again: what the run
    loses against plain decoding stays within EXPLORE_SHARE of its seconds (plus 1% for the world's noise). The
    probes and first tries are paid from the credit: with none, no speculative step runs where drafts lose, once
    the first rollout measured them; with it, probes keep measuring there."""
    from tailrl.speculative import selector as selmod

    world = World(accept=0.45, row_s=0.003)
    sizes = (48, 24, 12, 6, 3)
    assert [world.best([200] * B)[0] > 0 for B in sizes] == [False] * 4 + [True]

    def run_all(share: float) -> tuple[float, int]:
        old, selmod.EXPLORE_SHARE = selmod.EXPLORE_SHARE, share
        try:
            sel = make_selector()
            spent = plain = 0.0
            late = 0
            for r in range(25):
                for B in sizes:
                    steps = run(sel, world, B, 12, seed=10 * r + B)
                    spent += sum(t for _, t, _ in steps)
                    plain += sum(e for _, _, e in steps) / off_rate(world, B, 12, seed=r)
                    late += sum(d > 0 for d, _, _ in steps) if r and B >= 6 else 0
                sel.end_rollout()
        finally:
            selmod.EXPLORE_SHARE = old
        return 1 - plain / spent, late

    lost, probes = run_all(selmod.EXPLORE_SHARE)
    assert lost <= selmod.EXPLORE_SHARE + 0.01, lost
    assert probes >= 10, probes
    assert run_all(0.0)[1] <= probes // 5, probes


def test_a_uniform_pass_is_the_pass_of_its_rows():
    """Geometry.uniform (closed form: the selector prices every arm with it each step) equals `shape` of the same
    per-sequence draft rows, for fractional depths, tiles, query blocks and weight calls."""
    g = Geometry(ITEM, [(CALL, 0.7), (0, 0.3)], TILE)
    rng = random.Random(0)
    for _ in range(500):
        B = rng.randint(1, 70)
        contexts = [rng.randint(1, 1500) for _ in range(B)]
        depth = rng.choice([0, 1, 2, 4, 8, 15]) + rng.random() * rng.choice([0, 1])
        lo, k = int(depth), round((depth - int(depth)) * B)
        want = g.shape(contexts, [lo + 1] * k + [lo] * (B - k)).features()
        assert np.allclose(g.uniform(contexts, depth).features(), want, rtol=1e-12, atol=1e-12)


def test_a_tool_trajectorys_turns_follow_one_another_in_the_sd_off_estimate():
    """Turn a1 (seq 12) continues a0 (seq 10, 4 tokens): in the plain schedule it begins 3 steps in (a0's first token
    came from its prefill), beside b0 (seq 11, 6 tokens) the whole time; a turn whose predecessor is not in the
    rollout begins with it. Every step's sequences and contexts, as the model is asked to price them."""
    assert turn_starts([10, 11, 12, 13, 14], [4, 6, 3, 2, 5], [None, None, 10, 12, 99]) == [0, 0, 3, 5, 0]
    asked = []

    def plain(contexts):
        asked.append(list(contexts))
        return 1.0

    body, tail = off_seconds(plain, [5, 6, 12], [4, 6, 3], tail=1, starts=turn_starts([10, 11, 12], [4, 6, 3],
                                                                                      [None, None, 10]))
    assert asked == [[5, 6], [6, 7], [7, 8], [9, 12], [10, 13]]  # a0 at t 1-3, b0 at t 1-5, a1 at t 4-5
    assert (body, tail) == (5.0, 0.0)
    asked.clear()
    off_seconds(plain, [5, 6, 12], [4, 6, 3], tail=1)  # without starts every sequence begins with the rollout
    assert asked[3:] == [[9], [10]] and len(asked) == 5

