"""Inputs on which two kernels that add in another order give other bits: the start-up probe's witnesses
(engine/probe.py).

On random data a bf16 product or attention hides a change of its fp32 accumulation order: the fp32 results move by
an ulp or so and round to the same bf16 in nearly every output (a 16-row tile of a 576 -> 192 product summed in
32-column blocks instead of in one pass: 0 of its 3,072 outputs differ). Over a model's 30 layers and hundreds of
rows a few do, and that is what an Intel CPU with AMX showed (issue 45): every product check of the probe held on
random data while a prompt prefilled beside another prompt gave other logits than alone in 4 rows. Here every
exact result is 0, as the terms cancel in pairs: what a kernel returns is the rounding residue of the order it adds
in, so another order leaves another residue in most outputs (90% of the same tile)."""

from __future__ import annotations

import torch

from ..model.chunked import CHUNK


def cancelling_product(weight: torch.Tensor, rows: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(x [rows, K], w [N, K]) in weight's dtype and device, every row of x @ w.T exactly 0: x = [u, u[:, p]] and
    w = [h, -h[:, p]], h the weight's first K // 2 columns (its magnitudes), p a permutation (no term meets its
    negative in the same pair or block of columns)."""
    n, K = weight.shape
    h = K // 2
    perm = torch.randperm(h, generator=gen).to(weight.device)
    u = torch.randn(rows, h, generator=gen).to(weight.device, weight.dtype)
    half = weight[:, :h]
    odd = K - 2 * h  # an odd K: one column of zeros
    x = torch.cat([u, u[:, perm], u.new_zeros(rows, odd)], 1)
    w = torch.cat([half, -half[:, perm], half.new_zeros(n, odd)], 1)
    return x, w


def cancelling_keys(n: int, heads: int, dim: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(keys, values) [n, heads, CHUNK, dim] fp32 in groups of PAIRED keys: key j + PAIRED // 2 of a group equals key
    j, its value is key j's negated, at magnitudes 2^-6 .. 2^6. A row that sees whole groups (a prefix of a multiple
    of PAIRED keys) weighs a key and its partner alike, so its output is exactly 0 and the kernel returns the
    residue of its order of summation; its log-sum-exp is fp32 and shows the order of the scores' sum directly."""
    g, half = CHUNK // PAIRED, PAIRED // 2
    k = torch.randn(n, heads, g, 1, half, dim, generator=gen)
    v = torch.randn(n, heads, g, 1, half, dim, generator=gen) * 2.0 ** torch.randint(-6, 7, (n, heads, g, 1, half, 1),
                                                                                         generator=gen)
    return (torch.cat([k, k], 3).view(n, heads, CHUNK, dim), torch.cat([v, -v], 3).view(n, heads, CHUNK, dim))


PAIRED = 8  # keys a group of `cancelling_keys` (a key's partner 4 keys on: not in its VNNI pair or the same half)
