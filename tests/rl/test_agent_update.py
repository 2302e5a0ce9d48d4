"""Observation tokens never enter the update: make_batch multiplies the loss mask by a trajectory's response_mask,
and the gradient policy_update hands the optimizer is that of the loss over the model's tokens only, KL included;
and the trajectory's ids agree with a re-tokenization where the model wrote canonical tokens (drift otherwise)."""

import copy
import random
from types import SimpleNamespace

import pytest
import torch

from tailrl.config import AlgoCfg
from tailrl.rl.actor.forward import make_batch
from tailrl.rl.actor.precision import Precision
from tailrl.rl.actor.update import policy_update
from tailrl.rl.algos import kl_penalty
from tests.helpers import tiny_model
from tests.rl.update_helpers import GRAD_ATOL, GRAD_RTOL, GradRecorder, padded_reference


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model(tmp_path_factory, "llama", dtype=torch.float32).requires_grad_(True)


def trajectories(seed=0, n=4):
    """Responses of model tokens, an observation (mask 0), and model tokens again."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt = [rng.randrange(3, 96) for _ in range(5)]
        a, obs, b = ([rng.randrange(3, 96) for _ in range(k)] for k in (rng.randint(2, 5), rng.randint(3, 6), 3))
        mask = [1] * len(a) + [0] * len(obs) + [1] * len(b)
        out.append(SimpleNamespace(prompt_token_ids=prompt, token_ids=a + obs + b, response_mask=mask,
                                   logprobs=[-2.0 if k else 0.0 for k in mask]))
    return out


def test_make_batch_masks_observation_tokens_exactly():
    cs = trajectories()
    batch = make_batch(cs, pad=0)
    for i, c in enumerate(cs):
        p = len(c.prompt_token_ids) - 1 - batch.start
        row = batch.mask[i, p : p + len(c.token_ids)].tolist()
        assert row == [float(k) for k in c.response_mask]
        assert batch.mask[i].sum() == sum(c.response_mask)


@pytest.mark.parametrize("kl", [0.0, 0.5])
def test_the_update_gradient_is_the_loss_over_model_tokens_only(tiny, kl):
    """The gradient equals the PPO (+ KL) loss over mask-1 tokens, and differs from the one with every response token:
    had an observation token entered the loss or the KL, the first comparison fails."""
    cs = trajectories(seed=3)
    batch = make_batch(cs, pad=0)
    adv = torch.tensor([1.0, -0.5, 0.8, -1.2])
    ref_model = copy.deepcopy(tiny)  # the KL's reference: a perturbed copy, so the KL term has a gradient
    with torch.no_grad():
        for p in ref_model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    master = copy.deepcopy(tiny)
    opt = GradRecorder(master.parameters())
    algo = AlgoCfg(mini_batch_size=len(cs), micro_batch_size=2, grad_clip=1e9, kl_coef=kl)
    metrics, why = policy_update(Precision(master, "float32"), opt, ref_model if kl else None, batch, adv, algo, 0.9,
                                 random.Random(0), {})
    assert why is None

    def grads(mask):
        m = copy.deepcopy(tiny)
        b = copy.copy(batch)
        b.mask = mask
        lp, _ = padded_reference(m, b, 0.9)
        loss = -(adv[:, None] * lp * mask).sum() / mask.sum()
        if kl:
            with torch.no_grad():
                rlp, _ = padded_reference(ref_model, b, 0.9)
            loss = loss + kl * (kl_penalty(lp, rlp, algo.kl_type) * mask).sum() / mask.sum()
        loss.backward()
        return [p.grad for p in m.parameters()]

    everything = torch.zeros_like(batch.mask)
    for i, c in enumerate(cs):
        p = len(c.prompt_token_ids) - 1 - batch.start
        everything[i, p : p + len(c.token_ids)] = 1.0
    want, wrong = grads(batch.mask), grads(everything)
    for g, w in zip(opt.grads[0], want):
        torch.testing.assert_close(g, w, rtol=GRAD_RTOL, atol=GRAD_ATOL)
    assert any(not torch.allclose(g, x, rtol=1e-3, atol=1e-4) for g, x in zip(opt.grads[0], wrong))


def test_strict_check_finds_no_drift_in_canonical_ids_and_names_the_position_of_drift(smollm):
    from tailrl.agent.trajectory import ChatDelta, Trajectory, drift

    _, tok = smollm
    msgs = [{"role": "user", "content": "What is 347 * 29?"}]
    prompt = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    delta = ChatDelta(tok)
    tr = Trajectory(0, 0, 1, prompt, msgs)
    call = tok.encode("<calc>347*29</calc>", add_special_tokens=False)
    tr.add_model(call, [-1.0] * len(call), "<calc>347*29</calc>")
    tr.turns[-1].observation = [{"role": "user", "content": "<result>10063</result>"}]
    tr.add_template(delta.close_ids + delta.observation_ids(tr.turns[-1].observation))
    ans = tok.encode("#### 10063", add_special_tokens=False) + [tok.eos_token_id]
    tr.add_model(ans, [-1.0] * len(ans), "#### 10063")
    assert drift(tok, tr) is None
    assert tok.decode(delta.close_ids) == "<|im_end|>\n"
    assert sum(tr.mask) == len(call) + len(ans) and len(tr.mask) == len(tr.ids)
    # the same text in other tokens (what a sampler may draw): the strict check names the first position that differs
    odd = [t for ch in "<calc>" for t in tok.encode(ch, add_special_tokens=False)]
    tr2 = Trajectory(0, 0, 1, prompt, msgs)
    tr2.add_model(odd, [-1.0] * len(odd), "<calc>")
    assert odd != tok.encode("<calc>", add_special_tokens=False)
    assert drift(tok, tr2) == len(prompt) + next(i for i, (a, b) in enumerate(
        zip(odd, tok.encode("<calc>", add_special_tokens=False))) if a != b)
