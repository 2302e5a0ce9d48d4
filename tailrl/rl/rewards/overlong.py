"""DAPO's soft overlong punishment (Yu et al. 2025, arXiv 2503.14476, eq. 13): a length-aware reward term that
warns a response running into the length cap before it is cut, instead of only scoring the cut answer.

Invariants: the term is 0 up to L_max - L_cache tokens, falls linearly by penalty / L_cache per token inside the
last L_cache tokens, and is -penalty at L_max (and beyond, which a sampler capped at L_max never reaches); it is
never positive, and buffer 0 is off (every term 0)."""

from __future__ import annotations


def overlong_penalty(length: int, max_tokens: int, buffer: int, penalty: float = 1.0) -> float:
    """The term for a response of `length` tokens (EOS included, as generated) under the cap `max_tokens` (L_max)
    with the soft window `buffer` (L_cache)."""
    if buffer <= 0:
        return 0.0
    start = max_tokens - buffer
    if length <= start:
        return 0.0
    if length <= max_tokens:
        return (start - length) / buffer * penalty
    return -penalty


def overlong_terms(lengths: list[int], max_tokens: int, buffer: int, penalty: float) -> tuple[list[float], dict]:
    """Each response's term and the metrics: `reward/overlong/mean` (the term's mean over the responses) and
    `reward/overlong/frac` (the share with a term below 0)."""
    terms = [overlong_penalty(n, max_tokens, buffer, penalty) for n in lengths]
    n = max(len(terms), 1)
    return terms, {"reward/overlong/mean": sum(terms) / n, "reward/overlong/frac": sum(t < 0 for t in terms) / n}
