"""Sampling noise keyed by (request seed, output position): the same token position always sees the same
noise, whichever way (plain decode, any draft tree, any batch) it is reached."""

from __future__ import annotations

import torch


def position_generator(seed: int, position: int) -> torch.Generator:
    """Independent stream per (seed, position): a splitmix64 hash of the pair seeds the generator."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 0x632BE59BD9B4E019) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return torch.Generator().manual_seed((z ^ (z >> 31)) & 0x7FFFFFFFFFFFFFFF)


def gumbel(generator: torch.Generator, vocab: int) -> torch.Tensor:
    u = torch.rand(vocab, generator=generator, dtype=torch.float64)
    return -torch.log(-torch.log(u))


def draw(logp: torch.Tensor, generator: torch.Generator) -> int:
    """Gumbel-max draw of one token from log-probabilities [V]."""
    return int((logp.double() + gumbel(generator, logp.shape[-1]).to(logp.device)).argmax())
