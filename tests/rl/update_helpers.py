"""Shared by the update's tests (test_update.py, test_packing.py): the padded full-logits reference and the check
that micro-batches match it. Plain functions; fixtures live in conftest.py."""

import random
from types import SimpleNamespace

import torch

from tailrl.rl.actor.forward import sequence_logprobs
from tailrl.rl.algos import policy_loss, token_logprobs

def comps(seed: int = 0, n: int = 7):
    """n completions of random prompts (3-9 tokens) and responses (1-14 tokens), as the rollout returns them."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(3, 96) for _ in range(rng.randint(3, 9))]
        resp = [rng.randrange(3, 96) for _ in range(rng.randint(1, 14))]
        out.append(SimpleNamespace(prompt_token_ids=prompt, token_ids=resp, logprobs=[-2.0] * len(resp)))
    return out


class GradRecorder(torch.optim.Optimizer):
    """An optimizer that keeps a copy of the gradients each step hands it and moves nothing."""

    def __init__(self, params):
        super().__init__(list(params), {})
        self.grads = []

    def step(self, closure=None):
        self.grads.append([p.grad.clone() for g in self.param_groups for p in g["params"]])


# fp32 tolerances: the chunked path sums the same products in another order
VALUE_TOL, GRAD_RTOL, GRAD_ATOL = 2e-5, 1e-4, 2e-5


def padded_reference(model, batch, temperature):
    """The old path: one padded forward, full [B, T, V] logits, log-softmax."""
    L = max(len(s) for s in batch.seqs)
    toks = torch.tensor([s + [0] * (L - len(s)) for s in batch.seqs])
    logits, _ = model.forward_full(toks[:, :-1], logits_start=batch.start)
    lp, ent = token_logprobs(logits, toks[:, batch.start + 1 :], temperature)
    return lp * batch.mask, ent * batch.mask


def assert_micro_batches_match_padded(model, batch, micros, adv, chunk: int) -> None:
    """Values and the gradient of a PPO loss summed over the micro-batches equal one padded full-logits forward over
    the whole batch (fp32 tolerances above)."""
    ref_lp, ref_ent = padded_reference(model, batch, 0.8)
    loss, _ = policy_loss(ref_lp, ref_lp.detach(), adv, batch.mask, 0.2, 0.28, "token-mean")
    loss.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    total = float(batch.mask.sum())
    for micro in micros:
        lp, ent = sequence_logprobs(model, batch, micro, 0.8, chunk=chunk)
        torch.testing.assert_close(lp.detach(), ref_lp[micro].detach(), atol=VALUE_TOL, rtol=0)
        torch.testing.assert_close(ent.detach(), ref_ent[micro].detach(), atol=VALUE_TOL, rtol=0)
        m = batch.mask[micro]
        part, _ = policy_loss(lp, lp.detach(), adv[micro], m, 0.2, 0.28, "token-mean")
        (part * float(m.sum()) / total).backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[n], rtol=GRAD_RTOL, atol=GRAD_ATOL, msg=n)
    model.zero_grad(set_to_none=True)


NOISE_FACTOR = 8  # stated, not fitted: how far another cut of an update may land, in units of the measured noise


def assert_same_update(a, b, noise: list) -> None:
    """a, b and each of noise: (weights, optimizer, metrics) of one update computed in other cuts; the noise runs cut
    it into micro-batches of other sizes (the same math, other orders of fp32 sums), and the farthest they land from
    b is this machine's summation noise for the update: Adam divides each gradient by its own scale, so where
    gradients nearly cancel, noise of a few ulps moves a weight by a visible part of a step, and by how much depends
    on the CPU's kernels. a must equal b up to NOISE_FACTOR times that noise (the weights: the largest move of any
    weight; Adam's moments and the loss: relative to their scale), plus 4 fp32 ulps at each tensor's scale; Adam's
    step counts exactly."""
    eps = torch.finfo(torch.float32).eps
    (wa, oa, ma), (wb, ob, mb) = a, b
    loss_noise = max(abs(m["actor/pg_loss"] - mb["actor/pg_loss"]) for _, _, m in noise)
    assert abs(ma["actor/pg_loss"] - mb["actor/pg_loss"]) <= NOISE_FACTOR * loss_noise + 4 * eps * abs(mb["actor/pg_loss"])
    pa, pb = list(wa.named_parameters()), list(wb.parameters())
    moved = max(float((n - q).detach().abs().max()) for w, _, _ in noise for n, q in zip(w.parameters(), pb))
    for key in ("exp_avg", "exp_avg_sq"):
        rel = max(float((on.state[n][key] - ob.state[q][key]).abs().max()) / (float(ob.state[q][key].abs().max()) or 1)
                  for w, on, _ in noise for n, q in zip(w.parameters(), pb))
        for (name, p), q in zip(pa, pb):
            got, want = oa.state[p][key], ob.state[q][key]
            assert float((got - want).abs().max()) <= (NOISE_FACTOR * rel + 4 * eps) * float(want.abs().max()), \
                f"{name} {key}"
    for (name, p), q in zip(pa, pb):
        assert int(oa.state[p]["step"]) == int(ob.state[q]["step"]), name
        diff, bound = float((p - q).detach().abs().max()), NOISE_FACTOR * moved + 4 * eps * float(q.detach().abs().max())
        assert diff <= bound, f"{name}: {diff:.3g} > {bound:.3g} (summation noise {moved:.3g})"
