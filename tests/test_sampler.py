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
    lp = torch.log_softmax(torch.randn(4, 50, generator=torch.Generator().manual_seed(0)), -1)

    def alone(seed, pos):
        return sample(lp[[0]], [False], [seed], [pos])[0][0]

    batched, _ = sample(lp, [False] * 4, [7, 7, 8, 7], [0, 1, 0, 0])
    assert batched[0] == alone(7, 0)  # in a batch or alone: the same token
    assert len({alone(s, 0) for s in range(40)}) > 5  # seeds differ
    assert len({alone(7, p) for p in range(40)}) > 5  # positions differ


def test_greedy_takes_argmax():
    lp = torch.log_softmax(torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 1.0]]), -1)
    tokens, _ = sample(lp, [True, True], [0, 1], [0, 0])
    assert tokens == [1, 0]
