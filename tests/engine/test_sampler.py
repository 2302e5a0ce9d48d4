import math

import pytest
import torch
from scipy.stats import chisquare

from tailrl.engine import SamplingParams
from tailrl.engine.sampler import sample, warp_tensors, warped_logprobs


def warp(logits, **kw):
    p = SamplingParams(**kw)
    return warped_logprobs(logits[None], *warp_tensors([p], "cpu"))[0]


def test_temperature_scales_logits():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    assert torch.allclose(warp(logits, temperature=0.5).exp(), torch.softmax(logits / 0.5, -1))


def test_top_k_keeps_k_largest():
    lp = warp(torch.tensor([0.1, 3.0, 2.0, -1.0, 2.5]), top_k=2)
    assert torch.isfinite(lp).tolist() == [False, True, False, False, True]
    assert lp.exp().sum() == pytest.approx(1.0)


def test_top_p_keeps_smallest_set_reaching_p():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    lp = warp(probs.log(), top_p=0.7)  # 0.5 < 0.7 so the 0.3 token is needed too; 0.8 >= 0.7 stops there
    assert torch.isfinite(lp).tolist() == [True, True, False, False]
    assert lp.exp()[:2].tolist() == pytest.approx([0.625, 0.375])


def test_rows_warp_independently():
    logits = torch.tensor([[0.0, 1.0, 2.0], [0.0, 1.0, 2.0]])
    params = [SamplingParams(top_k=1), SamplingParams(temperature=2.0)]
    lp = warped_logprobs(logits, *warp_tensors(params, "cpu"))
    assert torch.isfinite(lp[0]).sum() == 1
    assert torch.allclose(lp[1].exp(), torch.softmax(logits[1] / 2, -1))


def test_gumbel_sampling_follows_the_distribution():
    """Chi-square over 20k draws (fixed seed, significance 0.001): the sampler draws from softmax."""
    probs = torch.tensor([0.4, 0.25, 0.2, 0.1, 0.05])
    lp = probs.log()[None].expand(20000, -1)
    tokens, lps = sample(lp, [False] * 20000, list(range(20000)), [3] * 20000)  # 20000 requests, one position
    counts = torch.bincount(torch.tensor(tokens), minlength=5).double()
    assert chisquare(counts.numpy(), (probs.double() * 20000).numpy()).pvalue > 1e-3
    assert lps[0] == pytest.approx(math.log(probs[tokens[0]].item()))


def test_noise_depends_on_seed_and_position_only():
    """A sampled row draws argmax(logp + noise) with the noise a function of its (seed, position) alone: rows 0 and 3
    share (7, 0) and have other logits, so each is its own logits plus that same noise, in the batch or alone."""
    from tailrl.speculative.noise import gumbel, row_keys

    lp = torch.log_softmax(torch.randn(4, 50, generator=torch.Generator().manual_seed(0)), -1)

    def alone(row, seed, pos):
        return sample(lp[[row]], [False], [seed], [pos])[0][0]

    lp[3] = lp[0].clone().index_fill_(0, torch.tensor(alone(0, 7, 0)), -math.inf)  # row 0's logits, its draw banned
    seeds, positions = [7, 7, 8, 7], [0, 1, 0, 0]
    batched, _ = sample(lp, [False] * 4, seeds, positions)
    for r, (s, p) in enumerate(zip(seeds, positions)):
        noise = gumbel(row_keys([s], [p]), 50)[0]
        assert batched[r] == alone(r, s, p) == int((lp[r] + noise).argmax()), r
    assert batched[3] != batched[0]  # the same noise over other logits: another token
    assert len({alone(0, s, 0) for s in range(40)}) > 5  # seeds differ
    assert len({alone(0, 7, p) for p in range(40)}) > 5  # positions differ


def test_greedy_takes_argmax():
    lp = torch.log_softmax(torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 1.0]]), -1)
    tokens, _ = sample(lp, [True, True], [0, 1], [0, 0])
    assert tokens == [1, 0]


@pytest.mark.parametrize("temperature", [0.3, 0.7, 1.0, 3.0])
def test_pruned_gumbel_argmax_draws_the_full_computations_tokens(temperature):
    """gumbel_argmax computes noise only for tokens that can win: its draws must equal argmax(logp + noise of the
    whole vocabulary) bit for bit, on peaked and flat rows, with -inf (top-k) entries and exact ties."""
    from tailrl.speculative.noise import _full_argmax, gumbel, gumbel_argmax, row_keys

    g = torch.Generator().manual_seed(1)
    logits = torch.randn(300, 5000, generator=g) * 4  # flat at T=3 (full path), peaked at T=0.3 (a few candidates)
    logits[:40, :200] = logits[:40, 200:400]  # duplicated values: ties among candidates
    logits[40:80] = logits[40:80].masked_fill(logits[40:80] < 2, float("-inf"))
    lp = torch.log_softmax(logits / temperature, -1)
    for seed in range(5):
        keys = row_keys([seed] * 300, list(range(300)))
        want = (lp + gumbel(keys, 5000)).argmax(-1)
        assert torch.equal(gumbel_argmax(lp, keys), want)
        assert torch.equal(_full_argmax(lp, keys), want)
    nan = lp.clone()
    nan[3] = float("nan")  # a NaN row does not break the others
    assert torch.equal(gumbel_argmax(nan, keys)[4:], want[4:])


def test_warping_in_row_blocks_equals_one_block():
    from tailrl.engine.sampler import _warp

    logits = (torch.randn(70, 3000, generator=torch.Generator().manual_seed(2)) * 3).bfloat16()
    params = [SamplingParams(temperature=0.7), SamplingParams(top_k=5), SamplingParams(top_p=0.8)] * 23
    params.append(SamplingParams())
    wt = warp_tensors(params, "cpu")
    assert torch.equal(warped_logprobs(logits, *wt, rows=8), _warp(logits, *wt))


def test_a_row_without_top_p_is_not_cut_beside_rows_with_it():
    """top-p warps the whole batch once any row uses it; a row with top_p = 1 must keep every token, as alone (the
    cumulative mass reaches 1.0 by rounding before the last tokens: they were cut, so the row's distribution
    depended on its batch-mates)."""
    from tailrl.engine.sampler import warped_logprobs

    g = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(8, 4096, generator=g)
    temps = torch.ones(8)
    top_p = torch.tensor([0.9, 1.0] * 4)
    mixed = warped_logprobs(logits, temps, None, top_p)
    alone = warped_logprobs(logits[1::2], temps[1::2], None, None)
    assert torch.isfinite(mixed[1::2]).all()
    assert torch.equal(mixed[1::2], alone)
    assert torch.isinf(mixed[0::2]).any()  # the top-p rows are still cut


@pytest.mark.parametrize("V", [49152, 151936, 1000, 300])
def test_row_top_is_max_with_the_first_index(V):
    """row_top (blocks' maxima, then the first block holding the row's maximum) returns what x.max(-1) returns:
    the maximum and its first index, with ties inside a block, across blocks and in the last element."""
    from tailrl.speculative.noise import row_top

    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, V, generator=g)
    x[1, [5, V - 3]] = 9.0  # a tie across blocks: the first wins
    x[2, [V // 2, V // 2 + 1]] = 9.0  # a tie inside a block
    x[3, -1] = 9.0
    x[4] = 0.0  # a flat row: index 0
    x[5, :] = float("-inf")
    x[5, V - 7] = -1.0
    top, idx = row_top(x)
    ref_top, ref_idx = x.max(-1)
    assert torch.equal(top, ref_top) and torch.equal(idx, ref_idx)
    top, idx = row_top(x[:, : V - 1])  # a view that is not contiguous
    assert torch.equal(idx, x[:, : V - 1].max(-1)[1])
