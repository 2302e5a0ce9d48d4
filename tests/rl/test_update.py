"""The update's forward: chunked LM-head logprobs and entropies equal the full-logits ones (values and gradients),
micro-batches equal one padded batch, bf16 compute with fp32 master weights accumulates in fp32,
and truncated importance sampling weighs each token's loss."""

import random
from types import SimpleNamespace

import pytest
import torch

from tailrl.config import AlgoCfg
from tailrl.rl.algos import policy_loss, token_logprobs
from tailrl.rl.actor.forward import make_batch, micro_batches, no_grad_logprobs
from tailrl.rl.actor.logprobs import head_logprobs
from tailrl.rl.actor.precision import Precision
from tailrl.rl.actor.update import mismatch, policy_update
from tests.helpers import tiny_model
from tests.rl.update_helpers import (GRAD_ATOL, GRAD_RTOL, VALUE_TOL, assert_micro_batches_match_padded, assert_same_update,
                                  GradRecorder, comps, padded_reference)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model(tmp_path_factory, "llama", dtype=torch.float32).requires_grad_(True)


@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_chunked_head_equals_full_logits_values_and_gradients(chunk):
    torch.manual_seed(0)
    h = torch.randn(37, 16, requires_grad=True)
    w = (torch.randn(50, 16) * 0.5).requires_grad_()
    y = torch.randint(0, 50, (37,))
    g_lp, g_ent = torch.randn(37), torch.randn(37)
    lp, ent = head_logprobs(h, w, y, 0.7, chunk=chunk)
    (lp @ g_lp + ent @ g_ent).backward()
    got = (lp.detach(), ent.detach(), h.grad.clone(), w.grad.clone())
    h.grad = w.grad = None
    ref_lp, ref_ent = token_logprobs((h @ w.T)[None], y[None], 0.7)
    (ref_lp[0] @ g_lp + ref_ent[0] @ g_ent).backward()
    torch.testing.assert_close(got[0], ref_lp[0].detach(), atol=VALUE_TOL, rtol=0)
    torch.testing.assert_close(got[1], ref_ent[0].detach(), atol=VALUE_TOL, rtol=0)
    torch.testing.assert_close(got[2], h.grad, rtol=GRAD_RTOL, atol=GRAD_ATOL)
    torch.testing.assert_close(got[3], w.grad, rtol=GRAD_RTOL, atol=GRAD_ATOL)


def test_micro_batches_group_lengths_and_cover_every_sequence():
    batch = make_batch(comps(n=9), pad=0)
    micros = micro_batches(batch, list(range(9)), 4)
    assert sorted(i for m in micros for i in m) == list(range(9)) and [len(m) for m in micros] == [4, 4, 1]
    lens = [len(batch.seqs[i]) for m in micros for i in m]
    assert lens == sorted(lens, reverse=True)


def test_a_completion_without_a_logprob_per_token_is_an_error_not_zeros():
    """A rollout that reports fewer (or no) logprobs than tokens: the batch refuses it, naming the completion (a
    0 would read as log p = 0 and set the TIS weight to min(p, cap))."""
    cs = comps(n=3)
    cs[1].logprobs = cs[1].logprobs[:-1]
    with pytest.raises(ValueError, match=r"completion 1 of the batch has \d+ rollout logprobs for its \d+ tokens"):
        make_batch(cs, pad=0)
    cs[1].logprobs = []
    with pytest.raises(ValueError, match="completion 1 of the batch has 0 rollout logprobs"):
        make_batch(cs, pad=0)


def test_length_grouped_chunked_forward_equals_padded_batch(tiny):
    """Values and the gradient of a PPO loss: micro-batches of 3 (head in chunks of 4 rows) against one padded
    full-logits forward over the whole batch."""
    batch = make_batch(comps(), pad=0)
    adv = torch.randn(len(batch), generator=torch.Generator().manual_seed(1))
    assert_micro_batches_match_padded(tiny, batch, micro_batches(batch, list(range(len(batch))), 3), adv, chunk=4)


def test_bf16_compute_keeps_fp32_master_and_refreshes_the_copy(tiny):
    import copy

    master = copy.deepcopy(tiny)
    prec = Precision(master, "bfloat16")
    assert prec.model.dtype == torch.bfloat16 and master.dtype == torch.float32
    opt = torch.optim.AdamW(master.parameters(), lr=1e-3)
    batch = make_batch(comps(), pad=0)
    adv = torch.randn(len(batch), generator=torch.Generator().manual_seed(2))
    before = {n: p.detach().clone() for n, p in master.named_parameters()}
    algo = AlgoCfg(mini_batch_size=len(batch), micro_batch_size=3)
    # the bf16 copy's logprobs before any step (the update's old logprobs: same micro-batches, same kernels)
    expected = mismatch(no_grad_logprobs(prec.model, batch, 3, 1.0), batch.rollout_lp, batch.mask)
    metrics, why = policy_update(prec, opt, None, batch, adv, algo, 1.0, random.Random(0), {})
    assert why is None and metrics["perf/update_tokens_per_s"] > 0
    assert all(p.grad is None for p in prec.model.parameters())  # moved into the master, then dropped
    moved = [n for n, p in master.named_parameters() if not torch.equal(p, before[n])]
    assert moved and all(opt.state[p]["exp_avg"].dtype == torch.float32 for p in master.parameters())
    for (n, p), c in zip(master.named_parameters(), prec.model.parameters()):
        assert torch.equal(c, p.to(torch.bfloat16)), n
    # trainer (bf16) vs "engine" logprobs (a constant -2.0 here): the mismatch metrics are those of the bf16 copy
    for key in ("rollout/logprob_diff", "rollout/logprob_diff_max"):
        assert metrics[key] == pytest.approx(expected[key], rel=1e-6, abs=1e-6), key


def test_policy_loss_multiplies_each_tokens_loss_by_its_weight():
    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    old, rollout = logp.detach(), torch.tensor([[-1.5, -1.0, -0.5]])
    mask, adv = torch.ones(1, 3), torch.tensor([1.0])
    loss, _ = policy_loss(logp, old, adv, mask, weights=torch.tensor([[1.2, 0.3, 1.0]]))
    plain, _ = policy_loss(logp, old, adv, mask)
    assert float(loss.detach()) == pytest.approx(-2.5 / 3) and float(plain.detach()) == pytest.approx(-1.0)
    d = mismatch(old, rollout, mask)
    assert d["rollout/logprob_diff"] == pytest.approx(0.5) and d["rollout/logprob_diff_max"] == pytest.approx(1.0)


# rollout ratios exp(old - rollout) given to the response tokens in turn, and the weights that a cap of 2 makes of
# them: written out, so that neither a reversed ratio (0.5 -> 2, 4 -> 0.25) nor a missing cap (4 -> 4) passes
TIS_RAW, TIS_WEIGHT, TIS_CAP = (0.5, 1.0, 1.5, 4.0), (0.5, 1.0, 1.5, 2.0), 2.0


def test_update_weighs_each_tokens_loss_by_the_capped_rollout_ratio(tiny):
    """policy_update with algo.tis_cap: the rollout logprobs sit below/above the trainer's by known amounts, so each
    token's weight is known; the loss, the gradient handed to the optimizer and `actor/tis_weight` equal those of
    the PPO loss (ratio 1 in the first mini-batch) with these weights written in."""
    import copy

    batch = make_batch(comps(seed=5, n=6), pad=0)
    adv = torch.tensor([1.0, -0.5, 0.8, -1.2, 0.3, 2.0])
    temp, mask = 0.9, batch.mask
    with torch.no_grad():
        trainer_lp, _ = padded_reference(tiny, batch, temp)
    k = torch.cumsum(mask.flatten(), 0).view_as(mask).long() - 1  # the response tokens numbered 0, 1, 2, ...
    raw, weight = (torch.tensor(v)[k % 4] * mask for v in (TIS_RAW, TIS_WEIGHT))
    assert {1.5, 4.0} <= set(raw[mask.bool()].tolist()), "the case needs weights below and above the cap"
    batch.rollout_lp = (trainer_lp - torch.log(raw.clamp_min(1e-9))) * mask
    master = copy.deepcopy(tiny)
    opt = GradRecorder(master.parameters())
    algo = AlgoCfg(mini_batch_size=len(batch), micro_batch_size=4, tis_cap=TIS_CAP, grad_clip=1e9)
    metrics, why = policy_update(Precision(master, "float32"), opt, None, batch, adv, algo, temp, random.Random(0), {})
    assert why is None and len(opt.grads) == 1
    # the reference: the same loss, one padded forward, the weights written in
    ref = copy.deepcopy(tiny)
    lp, _ = padded_reference(ref, batch, temp)
    loss = -(adv[:, None] * weight * lp * mask).sum() / mask.sum()
    loss.backward()
    n = float(mask.sum())
    assert metrics["actor/tis_weight"] == pytest.approx(float(weight.sum()) / n, abs=1e-5)
    assert metrics["actor/pg_loss"] == pytest.approx(float(-(adv[:, None] * weight * mask).sum()) / n, abs=1e-5)
    assert metrics["rollout/logprob_diff"] == pytest.approx(float(raw.clamp_min(1e-9).log().abs().mul(mask).sum()) / n,
                                                            abs=1e-5)
    for (name, p), g in zip(ref.named_parameters(), opt.grads[0]):
        torch.testing.assert_close(g, p.grad, rtol=GRAD_RTOL, atol=GRAD_ATOL, msg=name)
    norm = float(torch.stack([p.grad.norm() for p in ref.parameters()]).norm())
    assert metrics["actor/grad_norm"] == pytest.approx(norm, rel=1e-4)


def run_update(model, batch, adv, algo, seed=0):
    import copy

    master = copy.deepcopy(model)
    opt = torch.optim.AdamW(master.parameters(), lr=1e-3, weight_decay=0.0)
    metrics, why = policy_update(Precision(master, "float32"), opt, None, batch, adv, algo, 0.9, random.Random(seed), {})
    assert why is None
    return master, opt, metrics


def test_skipping_zero_advantage_sequences_gives_the_same_update(tiny):
    """Groups whose rewards are all equal (advantage 0) are not computed; the weights and Adam's state after the
    update equal those of computing every sequence. Two PPO epochs of 3 mini-batches: the old logprobs come from the
    first mini-batch's forward and a no-grad pass, and one mini-batch has only zero advantages (AdamW still steps)."""
    batch = make_batch(comps(seed=3, n=12), pad=0)
    adv = torch.tensor([0.0, 0.0, 0.0, 0.0, 1.2, -0.4, -0.8, 0.0, 0.0, 0.7, 0.0, -0.7])
    algo = AlgoCfg(mini_batch_size=4, micro_batch_size=2, ppo_epochs=2, clip_low=0.2, clip_high=0.28)
    from tailrl.rl.actor.update import update_plan

    minis, live = update_plan(batch.groups, adv, algo, random.Random(0), has_ref=False)
    assert any(not any(live[i] for i in m) for m in minis), "the case needs a mini-batch with only zero advantages"
    # the same update computed both ways (an all-zero mini-batch after others: Adam's moments move the weights)
    skip, opt_s, m_s = run_update(tiny, batch, adv, algo)
    full, opt_f, m_f = run_update(tiny, batch, adv, AlgoCfg(**{**vars(algo), "skip_zero_advantage": False}))
    assert m_s["actor/zero_adv_skipped"] == pytest.approx(7 / 12) and m_f["actor/zero_adv_skipped"] == 0
    assert m_s["perf/update_tokens_per_s"] < m_s["perf/update_batch_tokens_per_s"]
    noise = [run_update(tiny, batch, adv, AlgoCfg(**{**vars(algo), "skip_zero_advantage": False, "micro_batch_size": m}))
             for m in (1, 4)]
    assert_same_update((skip, opt_s, m_s), (full, opt_f, m_f), noise)
    moved = max(float((p - q).detach().abs().max()) for p, q in zip(skip.parameters(), tiny.parameters()))
    assert moved > 1e-4  # the update did something, so the equality above is not trivial
    # a KL term acts on every sequence: nothing is skipped then
    assert all(update_plan(batch.groups, adv, algo, random.Random(0), has_ref=True)[1])


def test_all_zero_advantages_still_step_adam_on_zero_gradients(tiny):
    batch = make_batch(comps(seed=4, n=6), pad=0)
    algo = AlgoCfg(mini_batch_size=3, micro_batch_size=2)
    master, opt, m = run_update(tiny, batch, torch.zeros(6), algo)
    assert m["actor/zero_adv_skipped"] == 1.0 and m["perf/update_tokens_per_s"] == 0
    assert "rollout/logprob_diff" not in m and "actor/entropy" not in m  # nothing computed, nothing measured
    assert all(int(opt.state[p]["step"]) == 2 for p in master.parameters())
    assert all(torch.equal(p, q) for p, q in zip(master.parameters(), tiny.parameters()))  # Adam from rest: no move


def test_fused_adamw_where_possible_and_it_steps_like_the_default_kernels():
    from tailrl.rl.actor.precision import make_adamw

    torch.manual_seed(0)
    a = [torch.nn.Parameter(torch.randn(300)), torch.nn.Parameter(torch.randn(7, 5))]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    exact = [torch.nn.Parameter(p.detach().double()) for p in a]  # the same steps in float64: the reference
    start = [p.detach().clone() for p in a]
    fused = make_adamw(a, lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)
    plain = torch.optim.AdamW(b, lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)
    ref = torch.optim.AdamW(exact, lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)
    assert fused.defaults["fused"] is True and not plain.defaults.get("fused")
    for step in range(3):
        g = [torch.randn_like(p) for p in a]
        for p, q, r, gi in zip(a, b, exact, g):
            p.grad, q.grad, r.grad = gi.clone(), gi.clone(), gi.double()
        fused.step()
        plain.step()
        ref.step()
    # both fp32 kernels within their own rounding of the float64 steps: 3 steps of a few fp32 roundings each,
    # allowed as 16 fp32 ulps at the weights' scale (an Adam step here moves a weight by ~1e-2, a wrong one by that)
    for p, q, r, p0 in zip(a, b, exact, start):
        bound = 16 * torch.finfo(torch.float32).eps * float(r.detach().abs().max())
        for got in (p, q):
            assert float((got.detach().double() - r.detach()).abs().max()) <= bound
        assert float((p - p0).detach().abs().mean()) > 5e-3  # 3 steps of lr 1e-2 moved the weights
    # a parameter that the fused kernel cannot take: the default kernels
    assert not make_adamw([torch.nn.Parameter(torch.zeros(3, device="meta"))], lr=1e-3).defaults.get("fused")


def test_chunked_head_gradient_without_the_entropy_term():
    """A loss of the log-probabilities alone (the entropy only logged): the backward skips the entropy's term and
    its gradients still equal the full-logits reference."""
    torch.manual_seed(1)
    h = torch.randn(29, 16, requires_grad=True)
    w = (torch.randn(50, 16) * 0.5).requires_grad_()
    y = torch.randint(0, 50, (29,))
    g = torch.randn(29)
    lp, ent = head_logprobs(h, w, y, 0.7, chunk=8)
    (lp @ g).backward()
    got = (h.grad.clone(), w.grad.clone())
    h.grad = w.grad = None
    ref_lp, _ = token_logprobs((h @ w.T)[None], y[None], 0.7)
    (ref_lp[0] @ g).backward()
    torch.testing.assert_close(got[0], h.grad, rtol=GRAD_RTOL, atol=GRAD_ATOL)
    torch.testing.assert_close(got[1], w.grad, rtol=GRAD_RTOL, atol=GRAD_ATOL)


def grouped_comps(seed: int, prompts: int, n: int):
    """n samples per prompt (a GRPO group each), responses of 1-40 tokens."""
    rng = random.Random(seed)
    out = []
    for _ in range(prompts):
        prompt = [rng.randrange(3, 96) for _ in range(rng.randint(3, 9))]
        for _ in range(n):
            resp = [rng.randrange(3, 96) for _ in range(rng.randint(1, 40))]
            out.append(SimpleNamespace(prompt_token_ids=list(prompt), token_ids=resp, logprobs=[-2.0] * len(resp)))
    return out


def test_token_budget_micro_batches_fit_the_budget_and_keep_groups_together():
    from tailrl.rl.actor.packing import packed_len, packed_tokens

    batch = make_batch(grouped_comps(seed=5, prompts=6, n=4), pad=0)
    batch.seqs[3] = batch.seqs[3] + list(range(3, 93)) * 2  # one sequence longer than the budget: a micro-batch alone
    idx = list(range(len(batch)))
    budget = 150
    micros = micro_batches(batch, idx, 1, tokens=budget)
    assert sorted(i for m in micros for i in m) == idx
    sizes = [packed_tokens(batch.seqs, batch.prompt_lens, batch.groups, m) for m in micros]
    assert micros[0] == [3] and sizes[0] > budget and all(s <= budget for s in sizes[1:])
    assert max(map(len, micros)) > 4  # more sequences than a group: the count is not the limit
    for g in set(batch.groups):  # a group that fits the budget is never cut
        members = [i for i in idx if batch.groups[i] == g]
        if 3 not in members and packed_len(batch.seqs, batch.prompt_lens, members) <= budget:
            assert sum(set(members) <= set(m) for m in micros) == 1, g
    assert micro_batches(batch, idx, 3) == micro_batches(batch, idx, 3, tokens=0)  # 0: by sequence count
    # a group past a small budget: cut in index order into maximal pieces that fit
    from tailrl.rl.actor.packing import token_segments

    pieces = token_segments(batch.groups, batch.seqs, batch.prompt_lens, idx, 40)
    assert [i for p in pieces for i in p] == sorted(idx, key=lambda i: (batch.groups[i], i)) and len(pieces) > 8
    for a, b in zip(pieces, pieces[1:]):
        assert len(a) == 1 or packed_len(batch.seqs, batch.prompt_lens, a) <= 40
        if batch.groups[a[0]] == batch.groups[b[0]]:  # the next member did not fit
            assert packed_len(batch.seqs, batch.prompt_lens, a + b[:1]) > 40
    assert any(len(p) > 1 for p in pieces)


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean"])
def test_token_budget_update_equals_sequence_count_update(tiny, loss_agg):
    """Micro-batches by a token budget cut the batch differently from micro-batches of 2 sequences; the weights and
    Adam's state after the update (2 PPO epochs, 2 mini-batches each) are the same up to fp32 summation order."""
    batch = make_batch(grouped_comps(seed=6, prompts=4, n=3), pad=0)
    adv = torch.randn(len(batch), generator=torch.Generator().manual_seed(7))
    algo = AlgoCfg(mini_batch_size=6, micro_batch_size=2, ppo_epochs=2, loss_agg=loss_agg)
    by_tokens = AlgoCfg(**{**vars(algo), "micro_batch_tokens": 120})
    assert micro_batches(batch, list(range(6)), 2) != micro_batches(batch, list(range(6)), 2, tokens=120)
    seqs, opt_s, m_s = run_update(tiny, batch, adv, algo)
    toks, opt_t, m_t = run_update(tiny, batch, adv, by_tokens)
    noise = [run_update(tiny, batch, adv, AlgoCfg(**{**vars(algo), "micro_batch_size": m})) for m in (1, 3)]
    assert_same_update((toks, opt_t, m_t), (seqs, opt_s, m_s), noise)
    moved = max(float((p - q).detach().abs().max()) for p, q in zip(toks.parameters(), tiny.parameters()))
    assert moved > 1e-4


def test_negative_micro_batch_tokens_is_a_config_error():
    from tailrl.config import Config, ConfigError

    cfg = Config()
    cfg.algo.micro_batch_tokens = -1
    with pytest.raises(ConfigError, match="algo.micro_batch_tokens"):
        cfg.validate()


def test_masked_truncated_responses_leave_the_update(tiny):
    """DAPO's overlong filtering: with the truncated rows masked, what they hold changes nothing (their tokens are
    not computed, their tokens leave the normalisers); unmasked, the same change moves the weights."""
    from tailrl.rl.actor.forward import mask_truncated

    algo = AlgoCfg(mini_batch_size=4, micro_batch_size=2)
    adv = torch.tensor([0.9, -0.3, -0.6, 1.1, -1.1, 0.5, -0.5, 0.2])
    cut = [False, True, False, False, True, False, True, False]
    runs = {}
    for other in (False, True):
        cs = comps(seed=5, n=8)
        if other:  # the truncated responses hold other tokens
            rng = random.Random(9)
            for c, t in zip(cs, cut):
                if t:
                    c.token_ids = [rng.randrange(3, 96) for _ in c.token_ids]
        plain = make_batch(cs, pad=0)
        masked = make_batch(cs, pad=0)
        a = mask_truncated(masked, adv.clone(), cut)
        assert a.tolist() == [0.0 if t else float(v) for v, t in zip(adv, cut)]
        assert masked.mask[torch.tensor(cut)].sum() == 0 and masked.mask.sum() < plain.mask.sum()
        runs[other] = (run_update(tiny, plain, adv, algo)[0], run_update(tiny, masked, a, algo))
    (p0, (m0, _, s0)), (p1, (m1, _, s1)) = runs[False], runs[True]
    assert s0["actor/zero_adv_skipped"] == pytest.approx(3 / 8)
    assert all(torch.equal(a, b) for a, b in zip(m0.parameters(), m1.parameters()))
    assert max(float((a - b).abs().max()) for a, b in zip(p0.parameters(), p1.parameters())) > 1e-5
