"""The update with each policy loss (`algo.loss`: ppo, gspo, cispo) on the tiny model: at the rollout policy they
give one gradient; once the policy has moved within the batch they move the weights each its own way (their math
against hand-computed values: test_algos.py)."""

import copy
import math
import random

import pytest
import torch

from tailrl.config import AlgoCfg
from tailrl.rl.actor.forward import make_batch
from tailrl.rl.actor.precision import Precision
from tailrl.rl.actor.update import policy_update
from tests.conftest import tiny_model
from tests.update_helpers import GRAD_ATOL, GRAD_RTOL, GradRecorder, comps

LOSSES = ("ppo", "gspo", "cispo")
ADV = torch.tensor([0.9, -0.3, -0.6, 1.1, -1.1, 0.5, -0.5, 0.2])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model(tmp_path_factory, "llama", dtype=torch.float32).requires_grad_(True)


def update(model, loss, opt_of, **algo):
    master = copy.deepcopy(model)
    opt = opt_of(master.parameters())
    metrics, why = policy_update(Precision(master, "float32"), opt, None, make_batch(comps(seed=11, n=8), pad=0), ADV,
                                 AlgoCfg(loss=loss, **algo), 0.9, random.Random(0), {})
    assert why is None, loss
    return master, opt, metrics


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.0)


def test_at_the_rollout_policy_the_three_losses_give_one_gradient(tiny):
    """Ratio 1 everywhere (nothing moves the weights): PPO's gradient is -A/N grad logp per token (token-mean),
    GSPO's s A / N with s = 1 inside its clip, CISPO's -1 * A / N: the gradients handed to the optimizer agree."""
    grads = {loss: update(tiny, loss, GradRecorder, mini_batch_size=4, micro_batch_size=2)[1].grads for loss in LOSSES}
    assert len(grads["ppo"]) == 2
    for loss in ("gspo", "cispo"):
        for step_a, step_b in zip(grads["ppo"], grads[loss]):
            for a, b in zip(step_a, step_b):
                torch.testing.assert_close(b, a, rtol=GRAD_RTOL, atol=GRAD_ATOL, msg=loss)


def test_each_policy_loss_updates_the_tiny_model(tiny):
    """Two mini-batches at lr 1e-2: the second sees ratios away from 1, which PPO clips at [0.8, 1.28], GSPO clips
    per response at 1 -/+ 3e-4/4e-4 and CISPO weighs without dropping a token; each run moves the weights, and
    the three land in different places."""
    after = {}
    for loss in LOSSES:
        master, _, metrics = update(tiny, loss, adamw, mini_batch_size=4, micro_batch_size=2)
        assert all(math.isfinite(metrics[k]) for k in ("actor/pg_loss", "actor/grad_norm", "actor/ppo_kl")), loss
        assert 0 <= metrics["actor/pg_clipfrac"] <= 1
        if loss != "cispo":  # CISPO's weight cap (5) is far from these ratios
            assert metrics["actor/pg_clipfrac"] > 0, loss
        moved = max(float((p - q).detach().abs().max()) for p, q in zip(master.parameters(), tiny.parameters()))
        assert moved > 1e-3, loss
        after[loss] = master
    for a, b in (("ppo", "gspo"), ("ppo", "cispo"), ("gspo", "cispo")):
        diff = max(float((p - q).detach().abs().max()) for p, q in zip(after[a].parameters(), after[b].parameters()))
        assert diff > 1e-3, (a, b)
