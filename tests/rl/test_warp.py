"""Top-k / top-p in training: the trainer scores each token under the distribution the engine sampled it from
(temperature, then top-k, then top-p, renormalised: engine/sampler.warp_mask, shared), so the engine's reported
logprobs equal the trainer's and the truncated importance weight exp(old - rollout) is 1 where both compute alike
(issue 64: with the temperature-only trainer it was 0.90-0.93 at top_p=0.9)."""

import random

import pytest
import torch

from tailrl.config import AlgoCfg
from tailrl.engine import Engine, EngineConfig, SamplingParams
from tailrl.rl.actor.forward import make_batch, no_grad_logprobs
from tailrl.rl.actor.logprobs import Warp, head_logprobs
from tailrl.rl.actor.precision import Precision
from tailrl.rl.actor.update import policy_update
from tailrl.rl.algos import token_logprobs
from tests.helpers import tiny_model
from tests.rl.update_helpers import GRAD_ATOL, GRAD_RTOL, VALUE_TOL

T, K, P = 0.9, 20, 0.8
# fp32, the same model: the engine's paged decode against the trainer's packed forward, the same products summed
# in another order (tests/engine/test_score.py's bound for the engine's warped logprobs against a plain forward)
TOL = 2e-5


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model(tmp_path_factory, "llama", dtype=torch.float32)


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_head_warped_equals_full_logits_values_and_gradients(chunk):
    """The chunked head under top-k/top-p against the full-logits reference: the same values (entropy of the
    warped distribution) and gradients; targets outside the support stay in it (a finite logprob)."""
    torch.manual_seed(0)
    h = torch.randn(37, 16, requires_grad=True)
    w = (torch.randn(50, 16) * 0.5).requires_grad_()
    y = torch.randint(0, 50, (37,))
    g_lp, g_ent = torch.randn(37), torch.randn(37)
    lp, ent = head_logprobs(h, w, y, Warp(0.7, 7, 0.8), chunk=chunk)
    (lp @ g_lp + ent @ g_ent).backward()
    got = (lp.detach(), ent.detach(), h.grad.clone(), w.grad.clone())
    h.grad = w.grad = None
    ref_lp, ref_ent = token_logprobs((h @ w.T)[None], y[None], 0.7, top_k=7, top_p=0.8)
    (ref_lp[0] @ g_lp + ref_ent[0] @ g_ent).backward()
    torch.testing.assert_close(got[0], ref_lp[0].detach(), atol=VALUE_TOL, rtol=0)
    torch.testing.assert_close(got[1], ref_ent[0].detach(), atol=VALUE_TOL, rtol=0)
    torch.testing.assert_close(got[2], h.grad, rtol=GRAD_RTOL, atol=GRAD_ATOL)
    torch.testing.assert_close(got[3], w.grad, rtol=GRAD_RTOL, atol=GRAD_ATOL)
    plain, _ = head_logprobs(h.detach(), w.detach(), y, 0.7)
    assert torch.isfinite(got[0]).all() and (got[0] > plain + 1e-3).all()  # every row lost mass to the warp
    rank = ((h @ w.T).detach() > (h @ w.T).detach().gather(-1, y[:, None])).sum(-1)
    assert (rank >= 7).any()  # some targets were outside top-k: kept, finite


def engine_batch(model):
    """3 prompts x 8 samples of 24 tokens drawn by our engine at T, top_k=K, top_p=P, as the update's batch."""
    eng = Engine(model, None, EngineConfig(kv_cache_gb=0.05))
    prompts = [[1, 5, 9, 4], [1, 30, 31, 32, 33, 7], [1, 60, 2, 61]]
    params = [SamplingParams(n=8, max_tokens=24, temperature=T, top_k=K, top_p=P, seed=s) for s in range(3)]
    comps = eng.generate(prompts, params)
    assert all(len(c.logprobs) == len(c.token_ids) > 0 for c in comps)
    return make_batch(comps, pad=0)


def mean_abs(a, b, mask):
    return float(((a - b).abs() * mask).sum() / mask.sum())


def test_trainer_scores_engine_tokens_under_the_engines_warp(tiny):
    """The trainer's logprobs of the engine's tokens equal the engine's (fp32, within TOL at every token); a
    trainer that warps otherwise (temperature only, top-k only, top-p only) is far off, so this test sees it."""
    batch = engine_batch(tiny)
    m = batch.mask
    got = no_grad_logprobs(tiny, batch, 8, Warp(T, K, P))
    assert float(((got - batch.rollout_lp).abs() * m).max()) <= TOL
    for other in (Warp(T), Warp(T, K), Warp(T, 0, P), Warp(T, 2 * K, P)):
        assert mean_abs(no_grad_logprobs(tiny, batch, 8, other), batch.rollout_lp, m) > 0.01, other


def test_tis_weight_is_one_under_top_k_and_top_p(tiny):
    """The update at the rollout policy with TIS on: every weight exp(old - rollout) is 1 within fp32 rounding
    (the temperature-only trainer gave the kept mass, about 0.9), and the logged mismatch is fp32's."""
    batch = engine_batch(tiny)
    model = tiny_model_copy(tiny)
    adv = torch.randn(len(batch), generator=torch.Generator().manual_seed(0))
    algo = AlgoCfg(tis_cap=2.0, mini_batch_size=len(batch), micro_batch_size=8)
    metrics, why = policy_update(Precision(model, "float32"), torch.optim.SGD(model.parameters(), lr=0.0), None,
                                 batch, adv, algo, Warp(T, K, P), random.Random(0), {})
    assert why is None
    assert abs(metrics["actor/tis_weight"] - 1.0) <= 1e-4
    assert metrics["rollout/logprob_diff_max"] <= TOL


def tiny_model_copy(model):
    import copy

    return copy.deepcopy(model).requires_grad_(True)


@pytest.mark.slow  # a training step (8 s with the tiny chat model's set-up)
def test_a_training_run_at_top_k_and_top_p_has_fp32_mismatch_only(tiny_chat, task_file, tmp_path):
    """A step of `tailrl train` with rollout.top_k/top_p (fp32 engine): the actor scores under the rollout's warp,
    so the engine/trainer mismatch is fp32 rounding and the TIS weight 1 (a temperature-only actor: kept mass)."""
    import json

    from tailrl.rl.run import train
    from tests.rl_helpers import tiny_cfg

    cfg = tiny_cfg(tiny_chat, task_file, tmp_path, "model.dtype=float32", "rollout.top_k=5", "rollout.top_p=0.8",
                   "trainer.steps=1", "trainer.save_every=0", "algo.tis_cap=2.0", "rollout.spec.mode=off",
                   "algo.skip_zero_advantage=false")  # every sequence computed, whatever the rewards
    row = [json.loads(x) for x in (train(cfg) / "metrics.jsonl").read_text().splitlines() if "reward/mean" in x][0]
    assert row["rollout/logprob_diff_max"] <= TOL, row["rollout/logprob_diff_max"]
    assert abs(row["actor/tis_weight"] - 1.0) <= 1e-4
