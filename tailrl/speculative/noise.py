"""Sampling noise keyed by (request seed, output position, vocabulary index): a counter-based hash, no
generator state.

A position's key is a splitmix64 hash of (seed, position), computed the same way, bit for bit, in Python
integers and in int64 torch ops on any device. A token is drawn by Gumbel-max: argmax over the vocabulary of
logp + G, where G[v] is a Gumbel variate from a 32-bit hash of (key, v) in int32 torch ops on the logits'
device. So the token at output position i of a request depends only on its seed and i, whichever way (plain
decode, any draft tree, any batch, any worker, a resumed run, CPU or GPU) it is reached, and no host-side
generator is made per row. Gumbel-max (not an inverse CDF) because a draw then flips under float noise in the
logits only where the two best perturbed scores nearly tie; a CDF sums the noise of the whole vocabulary.
Rejection sampling takes its per-child uniforms from `uniform(seed, position, 1 + k)`."""

from __future__ import annotations

import math

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


def hash_tensor(seeds, positions, index=0, device=None) -> torch.Tensor:
    """Vectorised `hash3` as int64 (the same bits), shaped as the broadcast of seeds, positions and index."""
    def t(x):
        if isinstance(x, torch.Tensor):
            return x.to(device=device or x.device, dtype=torch.long)
        vals = [signed64(v) for v in x] if isinstance(x, (list, tuple)) else signed64(x)
        return torch.tensor(vals, dtype=torch.long, device=device)

    s, p, i = t(seeds), t(positions), t(index)
    z = _tmix(s + signed64(_K1))
    z = _tmix(z + p * signed64(_K1))
    return _tmix(z + (i + 1) * signed64(_K1))


def uniforms(seeds, positions, index=0, device=None) -> torch.Tensor:
    """Vectorised `uniform`: float64 tensor of the broadcast shape of seeds, positions and index."""
    return (_srl(hash_tensor(seeds, positions, index, device), 11).double() + 0.5) * 2.0**-53


# ---- draws ----------------------------------------------------------------------------------------------

_GOLDEN32 = -1640531527  # 0x9E3779B9 as int32
_M1, _M2 = 0x7FEB352D, -2073254261  # lowbias32 multipliers (0x846CA68B as int32)


def _srl32(z: torch.Tensor, k: int) -> torch.Tensor:
    return (z >> k) & ((1 << (32 - k)) - 1)


def row_keys(seeds, positions, device=None) -> torch.Tensor:
    """int32 keys [N] of (seed, position) pairs: the low 32 bits of hash3(seed, position, 0)."""
    z = (hash_tensor(seeds, positions, 0, device) + (1 << 31)) & 0xFFFFFFFF
    return (z - (1 << 31)).to(torch.int32)


def gumbel_at(keys: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Gumbel noise (float32) of (key, vocabulary index) pairs, int32 keys and indices broadcast together: a
    lowbias32 hash, 23 random bits per uniform, never 0 or 1."""
    x = keys.to(torch.int32) + idx.to(torch.int32) * _GOLDEN32
    x = x ^ _srl32(x, 16)
    x = x * _M1
    x = x ^ _srl32(x, 15)
    x = x * _M2
    x = x ^ _srl32(x, 16)
    u = (_srl32(x, 9).float() + 0.5) * (1.0 / (1 << 23))
    return -torch.log(-torch.log(u))


def gumbel(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """Gumbel noise [N, vocab] (float32) for int32 row keys [N]."""
    return gumbel_at(keys[:, None], torch.arange(vocab, dtype=torch.int32, device=keys.device)[None])


# the largest value gumbel_at can take (its largest uniform), plus a margin for float32 rounding in the bound below
GUMBEL_MAX = float(-torch.log(-torch.log(torch.tensor((((1 << 23) - 1) + 0.5) / (1 << 23))))) + 0.01


def _full_argmax(x: torch.Tensor, keys: torch.Tensor, rows: int = 32) -> torch.Tensor:
    """argmax of x + noise over the whole vocabulary, a few rows at a time (the noise of many rows at once
    outgrows the CPU's caches: 536 rows at once took 4-5x longer than in blocks of 32)."""
    return torch.cat([(x[i : i + rows] + gumbel(keys[i : i + rows], x.shape[-1])).argmax(-1)
                      for i in range(0, len(x), rows)]) if len(x) else x.argmax(-1)


def row_top(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(max, the first index attaining it) per row of x [N, V] (a row with a NaN: its index is not defined here),
    as `x.max(-1)`, which on a CPU took 25x the
    time of `amax` (1.3 ms of a 32-row step's 5 ms of sampling over 49k tokens): the maxima of blocks of the row,
    then the first block holding the row's maximum searched alone."""
    N, V = x.shape
    blk = 1024
    while blk >= 64 and V % blk:
        blk //= 2
    if blk < 64 or V < 4 * blk or not x.is_contiguous():
        return x.max(-1)
    blocks = x.view(N, V // blk, blk)
    peaks = blocks.amax(-1)
    top = peaks.amax(-1)
    j = (peaks == top[:, None]).to(torch.uint8).argmax(-1)  # argmax of a 0/1 row: its first 1
    rows = torch.arange(N, device=x.device)
    return top, j * blk + blocks[rows, j].argmax(-1)


def gumbel_argmax(logp: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """One token per row of log-probabilities [N, V] (-inf = excluded) with the rows' keyed Gumbel noise:
    argmax over v of logp[v] + G(key, v), computed exactly without the noise of the whole vocabulary.

    No noise exceeds GUMBEL_MAX, so a token can beat the row's top token a (whose score logp[a] + G(key, a) is
    a lower bound of the winner's) only if logp[v] >= logp[a] + G(key, a) - GUMBEL_MAX. Noise is computed for
    those candidates alone (a few dozen at the temperatures RL samples at, against a vocabulary of ~50k), with
    the same float32 sums as the full argmax, and ties go to the lowest index as in torch.argmax: the tokens are
    the full computation's, bit for bit (tests/engine/test_sampler.py), at a fraction of its cost, which otherwise
    grows with every verified draft row."""
    x = logp.float()
    N, V = x.shape
    if x.is_cuda:  # the device computes the whole vocabulary's noise in a few kernels; pruning would wait for it
        return (x + gumbel(keys, V)).argmax(-1) if N else x.argmax(-1)
    if N == 0:
        return x.argmax(-1)
    top, a = row_top(x)
    if not bool(torch.isfinite(top).all()):
        return _full_argmax(x, keys)  # NaN rows: whatever the full computation says
    keys = keys.to(torch.int32)
    bound = top + gumbel_at(keys, a) - GUMBEL_MAX
    r, v = (x >= bound[:, None]).nonzero(as_tuple=True)  # row-major: within a row, indices ascend
    if len(r) > N * V // 8:  # flat rows (high temperature): pruning saves nothing
        return _full_argmax(x, keys)
    score = x[r, v] + gumbel_at(keys[r], v)
    best = torch.full((N,), float("-inf"), device=x.device).scatter_reduce(0, r, score, "amax")
    win = score == best[r]
    return torch.full((N,), V, dtype=torch.long, device=x.device).scatter_reduce(0, r[win], v[win], "amin")


def gumbel_py(key: int, v: int) -> float:
    """`gumbel` for one entry in Python integers (the same hash bits; float64 instead of float32 logs)."""
    x = (key + v * (_GOLDEN32 & 0xFFFFFFFF)) & 0xFFFFFFFF
    x ^= x >> 16
    x = (x * _M1) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * (_M2 & 0xFFFFFFFF)) & 0xFFFFFFFF
    x ^= x >> 16
    return -math.log(-math.log(((x >> 9) + 0.5) / (1 << 23)))


def draw(logp: torch.Tensor, seed: int, position: int) -> int:
    """One token from log-probabilities [V] with the noise of (seed, position). Small vocabularies (tests,
    toy models) take a Python path: a tensor op costs more than the whole draw there."""
    V = logp.shape[-1]
    if V > 256:
        return int(gumbel_argmax(logp[None], row_keys([seed], [position], logp.device))[0])
    key = hash3(seed, position, 0) & 0xFFFFFFFF
    lp = logp.tolist()
    return max((x + gumbel_py(key, v), v) for v, x in enumerate(lp) if x != float("-inf"))[1]


def draw_without_replacement(logp: torch.Tensor, seed: int, stream: int, k: int) -> list[int]:
    """k distinct tokens from logp [V] in draw order (Gumbel top-k: each is a draw from the renormalised rest),
    the order a rejection sampler over children sampled without replacement expects."""
    k = min(k, int(torch.isfinite(logp).sum()))
    scores = logp.float() + gumbel(row_keys([seed], [stream], logp.device), logp.shape[-1])[0]
    return torch.topk(scores, k).indices.tolist()
