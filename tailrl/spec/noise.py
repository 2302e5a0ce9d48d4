"""Sampling noise keyed by (request seed, output position, index): a counter-based hash, no generator state.

Every random number the engine uses is `uniform(seed, position, index)`: a splitmix64 hash of the triple,
computed the same way, bit for bit, in Python integers and in int64 torch ops on any device. So the token at
output position i of a request depends only on its seed and i, whichever way (plain decode, any draft tree,
any batch, any worker, a resumed run, CPU or GPU) it is reached, and no host-side generator is created per
row. Draws use the inverse CDF of the warped distribution with one uniform per token (index 0); rejection
sampling takes its per-child uniforms from indices 1, 2, ... of the same position."""

from __future__ import annotations

import torch

M64 = (1 << 64) - 1
_K1, _K2, _K3 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def signed64(x: int) -> int:
    x &= M64
    return x - (1 << 64) if x >> 63 else x


# ---- Python integers ------------------------------------------------------------------------------------

def _mix(z: int) -> int:
    z = ((z ^ (z >> 30)) * _K2) & M64
    z = ((z ^ (z >> 27)) * _K3) & M64
    return z ^ (z >> 31)


def hash3(seed: int, position: int, index: int = 0) -> int:
    z = _mix((seed + _K1) & M64)
    z = _mix((z + position * _K1) & M64)
    return _mix((z + (index + 1) * _K1) & M64)


def uniform(seed: int, position: int, index: int = 0) -> float:
    """A uniform in (0, 1) for (seed, position, index): 53 random bits, never exactly 0 or 1."""
    return ((hash3(seed, position, index) >> 11) + 0.5) * 2.0**-53


# ---- torch int64 (wrapping multiply, logical shifts by masking) -----------------------------------------

def _srl(z: torch.Tensor, k: int) -> torch.Tensor:
    return (z >> k) & ((1 << (64 - k)) - 1)


def _tmix(z: torch.Tensor) -> torch.Tensor:
    z = (z ^ _srl(z, 30)) * signed64(_K2)
    z = (z ^ _srl(z, 27)) * signed64(_K3)
    return z ^ _srl(z, 31)


def uniforms(seeds, positions, index=0, device=None) -> torch.Tensor:
    """Vectorised `uniform`: float64 tensor of the broadcast shape of seeds, positions and index."""
    def t(x):
        if isinstance(x, torch.Tensor):
            return x.to(device=device or x.device, dtype=torch.long)
        vals = [signed64(v) for v in x] if isinstance(x, (list, tuple)) else signed64(x)
        return torch.tensor(vals, dtype=torch.long, device=device)

    s, p, i = t(seeds), t(positions), t(index)
    z = _tmix(s + signed64(_K1))
    z = _tmix(z + p * signed64(_K1))
    z = _tmix(z + (i + 1) * signed64(_K1))
    return (_srl(z, 11).double() + 0.5) * 2.0**-53


# ---- draws ----------------------------------------------------------------------------------------------

def inverse_cdf(logp: torch.Tensor, u: torch.Tensor, block: int = 256) -> torch.Tensor:
    """Rows of log-probabilities [N, V] (need not be normalised; -inf = excluded) and uniforms [N] -> one
    token per row, token t with probability p_t / sum(p). Never returns a token of probability 0.

    Two levels, so no [N, V] float64 cumulative sum is built: block sums pick the block that holds u's share of
    the mass, then a cumulative sum inside that block picks the token. Every row is computed on its own, so a
    row's token does not depend on the other rows of the batch."""
    N, V = logp.shape
    p = logp.float().exp()
    if V % block:
        p = torch.nn.functional.pad(p, (0, block - V % block))
    blocks = p.view(N, -1, block)
    cb = blocks.sum(-1, dtype=torch.float64).cumsum(-1)
    x = u.to(device=p.device, dtype=torch.float64) * cb[:, -1]
    b = torch.searchsorted(cb, x[:, None]).squeeze(-1).clamp_(max=cb.shape[1] - 1)
    before = torch.where(b > 0, cb.gather(1, (b - 1).clamp(min=0)[:, None]).squeeze(-1), torch.zeros_like(x))
    inner = blocks[torch.arange(N, device=p.device), b].double().cumsum(-1)
    i = torch.searchsorted(inner, (x - before)[:, None]).squeeze(-1).clamp_(max=block - 1)
    return (b * block + i).clamp_(max=V - 1)


def draw(logp: torch.Tensor, seed: int, position: int, index: int = 0) -> int:
    """One token from log-probabilities [V] with the uniform of (seed, position, index)."""
    u = torch.tensor([uniform(seed, position, index)], dtype=torch.float64)
    return int(inverse_cdf(logp[None], u)[0])


def draw_without_replacement(logp: torch.Tensor, seed: int, stream: int, k: int) -> list[int]:
    """k distinct tokens drawn one after another from logp [V], each from the renormalised rest: the order is
    the draw order a rejection sampler over children sampled without replacement expects."""
    x = logp.double().clone()
    out: list[int] = []
    for j in range(min(k, int(torch.isfinite(x).sum()))):
        tok = draw(x, seed, stream, j)
        out.append(tok)
        x[tok] = float("-inf")
    return out
