"""Shared by the update's tests (test_update.py, test_packing.py): the padded full-logits reference and the check
that micro-batches match it. Plain functions; fixtures live in conftest.py."""

import torch

from tailrl.rl.actor.forward import sequence_logprobs
from tailrl.rl.algos import policy_loss, token_logprobs

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
