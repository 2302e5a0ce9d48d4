"""The goodput choice of draft tokens (speculative/goodput.py), as our proposer inside vLLM makes it: the step-cost
line is recovered from timed steps, large batches whose rows cost about an emitted token draft nothing, the tail
drafts its likely tokens, a chain is verified as a prefix, and acceptance is calibrated by what drafts did."""

import numpy as np

from tailrl.speculative.goodput import Calibration, StepLine, choose

# vLLM-CPU's steps as profiled (benchmarks/RESULTS.md 21): ~80 ms fixed, ~2.5 ms a sequence, ~2 ms a draft token
A, B_SEQ, R, C = 0.08, 0.0025, 0.002, 0.01


def true_s(seqs, drafts):
    return A + B_SEQ * seqs + R * drafts + C * (drafts > 0)


def fitted_line(noise=0.02, steps=400, seed=0) -> StepLine:
    rng = np.random.default_rng(seed)
    line = StepLine()
    for _ in range(steps):
        seqs = int(rng.integers(1, 129))
        drafts = int(rng.integers(0, 4 * seqs + 1)) if rng.random() < 0.5 else 0
        line.record(seqs, drafts, true_s(seqs, drafts) * (1 + noise * rng.standard_normal()))
    return line


def test_the_step_line_recovers_the_costs():
    line = fitted_line()
    assert line.ready
    a, b, r, c = line.weights()
    # 2% multiplicative noise over 400 steps: each term within 15% (c, the smallest, within 0.005 s)
    assert abs(a - A) < 0.15 * A and abs(b - B_SEQ) < 0.15 * B_SEQ and abs(r - R) < 0.15 * R
    assert abs(c - C) < 0.005


def test_large_batches_draft_nothing_and_the_tail_drafts_its_likely_tokens():
    line = fitted_line()
    chain = [0.5, 0.4, 0.3, 0.25, 0.15, 0.1, 0.05, 0.02]
    assert sum(choose(line, 128, [chain] * 128)) == 0  # a row costs ~ an emitted token: verifying does not pay
    small = choose(line, 2, [chain, chain])
    assert all(3 <= m <= 8 for m in small)  # at 2 sequences a row is nearly free next to the fixed cost
    # the choice is the best m: no other number of tokens (best first) is predicted faster
    flat = sorted(chain * 2, reverse=True)
    rate = [(2 + sum(flat[:m])) / line.seconds(2, m) for m in range(len(flat) + 1)]
    assert sum(small) == int(np.argmax(rate))


def test_rows_with_likelier_chains_get_the_drafts_and_each_draft_is_a_prefix():
    line = fitted_line()
    sure, unsure = [0.95] * 8, [0.3, 0.1, 0.05]
    counts = choose(line, 24, [sure] * 12 + [unsure] * 12)
    assert all(m > 0 for m in counts[:12]) and all(m == 0 for m in counts[12:])
    assert all(0 <= m <= 8 for m in counts)
    assert choose(line, 24, [[]] * 24) == [0] * 24  # nothing to draft


def test_before_the_line_is_known_it_drafts_the_likely_tokens_to_measure_them():
    line = StepLine()
    assert not line.ready
    assert choose(line, 64, [[0.9, 0.6, 0.4], [0.2]]) == [2, 0]
    many = choose(line, 64, [[0.9, 0.8, 0.7]] * 64)  # a few tokens a step, at any batch size
    assert sum(many) == 16 and max(many) <= 3
    for _ in range(40):  # large steps with the same few drafts do not tell what a draft costs
        line.record(128 - _ % 32, 16, true_s(128, 16))
    assert not line.ready


def test_calibration_learns_what_drafts_did():
    cal = Calibration(depth=8)
    est = np.ones(8)  # a chain seen once: the drafter says 1.0 all the way
    assert np.allclose(cal(est), 1.0)
    for _ in range(200):  # in fact each chain is accepted up to its third token
        cal.record(list(est), 3)
    q = cal(est)
    assert q[0] > 0.95 and q[2] > 0.95 and q[3] < 0.05 and q[7] < 0.05
    assert np.all(np.diff(q) <= 0)  # non-increasing along the chain
    assert cal([]).size == 0


def test_no_chain_is_worth_computing_where_even_a_certain_token_does_not_pay():
    from tailrl.speculative.goodput import worth_drafting

    line = fitted_line()
    assert worth_drafting(line, 4, 8) and worth_drafting(line, 128, 8) and worth_drafting(StepLine(), 128, 8)
    costly = StepLine()  # a draft token costing 3x a sequence: not even certain tokens pay
    for s in range(1, 129, 3):
        for d in (0, s, 2 * s):
            costly.record(s, d, 0.01 + 0.001 * s + 0.003 * d + 0.03 * (d > 0))
    assert costly.ready and not worth_drafting(costly, 128, 8) and worth_drafting(costly, 1, 8)  # a step of one: yes


def test_a_batch_whose_drafts_cost_more_than_the_line_says_learns_to_draft_less():
    line = fitted_line()
    chain = [0.8, 0.7, 0.6, 0.5]
    before = sum(choose(line, 100, [chain] * 100))
    small = line.correction.get(0, 1.0)
    assert before > 0
    for _ in range(30):  # at 100 sequences, drafts cost 3x what the line through all steps predicts
        line.record(100, 200, true_s(100, 0) + 3 * (true_s(100, 200) - true_s(100, 0)))
    assert line.correction[100 // 16] > 1.5  # (the line itself moves toward these steps too)
    assert sum(choose(line, 100, [chain] * 100)) < before
    assert line.correction.get(0, 1.0) == small  # other batch sizes keep their correction
