"""Token log-probabilities and entropies through the LM head in chunks of rows: no [tokens, V] float32 logits
tensor outlives one chunk, in the forward or the backward.

Invariant: `head_logprobs(h, W, y, warp)` equals `token_logprobs(h @ W.T, y, ...)` (algos.py, the full-logits
reference) in value and in gradient (w.r.t. h and W), within float rounding: fp32 agrees to ~1e-5, and a bf16
matmul (`compute_dtype=torch.bfloat16`) rounds the logits like an autocast forward would. The backward recomputes
each chunk's logits from the saved hidden rows (one extra matmul per chunk) instead of keeping them: that is what
makes the memory O(chunk * V) and the work linear in the response tokens (prompt rows never reach the head). The
elementwise work over [rows, V] is as much as the matmuls here, so it is kept to a fused log-softmax, one exp and
three in-place passes in the backward (benchmarks/head.py, in git at dc02aa5).

The distribution is the one the engine samples from (`Warp`: temperature, then top-k, then top-p, renormalised;
engine/sampler.py), its support from the sampler's own `warp_mask`, so the engine's reported logprobs, the old and
the new logprobs of the PPO ratio, and the truncated importance weight exp(old - rollout) all refer to one policy.
That is the policy gradient of the objective the samples come from: the tokens are drawn from pi_warped, so
E[A grad log pi_warped] is its gradient and the ratio pi_warped / pi_warped_old its importance weight, while the
temperature-only log-probability would score tokens under a distribution nobody sampled (its ratio to the
engine's is the kept mass, 0.90-0.93 per token at top_p=0.9: a TIS weight off by that much, not a mismatch).
DeepSeek-V3.2 (arXiv 2512.02556, section 3.1, "Keep Sampling Mask") trains under the rollout's truncation mask for
this reason; vLLM's `logprobs_mode=processed_logprobs` (rollout/vllm/llm.py) reports the same warped logprobs
the engine does. The mask is recomputed from the trainer's own logits (it is a step function of them: no gradient
flows through it), with the sampled token always kept: a token the engine drew at the edge of top-p, which the
trainer's rounding (or a policy moved by an earlier mini-batch or a partial rollout's later version) leaves just
outside, gets a finite logprob under support + {token}, not -inf and a NaN ratio. With top_k = 0 and top_p = 1
nothing is masked and the code path is the temperature-only one."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...engine.sampler import warp_mask

CHUNK_ROWS = 1024  # rows of the head per chunk: 1024 x 49152 fp32 logits = 200 MB at most, transient


@dataclass(frozen=True)
class Warp:
    """The sampling distribution tokens are scored under: the rollout's temperature, top_k (0: off), top_p (1: off)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    @staticmethod
    def of(w: "Warp | float") -> "Warp":
        """A Warp, or a bare temperature (no top-k, no top-p)."""
        return w if isinstance(w, Warp) else Warp(float(w))

    @property
    def masks(self) -> bool:
        return self.top_k > 0 or self.top_p < 1


def _chunk_logp(hs: torch.Tensor, w: torch.Tensor, y: torch.Tensor, warp: Warp) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One chunk's log-softmax [rows, V] in fp32 (-inf off the support), from hidden rows already scaled by 1/T and
    in the head's dtype, and the mask of what top-k/top-p left out (None without them; the targets y always kept).
    Temperature goes into the [rows, H] side, never over [rows, V]: every pass over a [rows, V] fp32 tensor costs
    about as much as the head's matmul on this CPU, so the chunk runs as few of them as it can."""
    z = hs @ w.T
    if not warp.masks:
        return torch.log_softmax(z, dim=-1, dtype=torch.float32), None
    n, dev = len(z), z.device
    drop = warp_mask(z.float(), torch.full((n,), warp.top_k, device=dev) if warp.top_k > 0 else None,
                     torch.full((n,), warp.top_p, device=dev) if warp.top_p < 1 else None)
    drop.scatter_(-1, y.unsqueeze(-1), False)
    return torch.log_softmax(z.masked_fill(drop, float("-inf")), dim=-1, dtype=torch.float32), drop


def _row_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """sum(a * b, -1) per row without an [rows, V] temporary."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).view(-1)


class _HeadLogprobs(torch.autograd.Function):
    """(hidden [M, H], head weight [V, H], targets [M]) -> (log p(target) [M], entropy [M]) under
    softmax(h @ W.T / T) over the support (`Warp`). With logp = log_softmax, p = exp(logp) and entropy
    E = -sum p logp: d logp_y / dz = onehot - p and dE / dz = -p (logp + E), for z = h W^T / T; off the support p = 0
    (its logp, -inf, is set to 0 once p is taken, so 0 * log 0 counts 0), and so is the gradient."""

    @staticmethod
    def forward(ctx, h, weight, targets, warp: Warp, chunk: int, compute_dtype):
        w = weight.to(compute_dtype)
        lp = torch.empty(h.shape[0], dtype=torch.float32, device=h.device)
        ent = torch.empty_like(lp)
        for i in range(0, h.shape[0], chunk):
            y = targets[i : i + chunk]
            logp, drop = _chunk_logp((h[i : i + chunk] / warp.temperature).to(compute_dtype), w, y, warp)
            lp[i : i + chunk] = logp.gather(-1, y.unsqueeze(-1)).squeeze(-1)
            p = logp.exp()
            if drop is not None:
                logp.masked_fill_(drop, 0.0)
            ent[i : i + chunk] = -_row_dot(p, logp)
        ctx.save_for_backward(h, weight, targets, ent)
        ctx.warp, ctx.chunk, ctx.compute_dtype = warp, chunk, compute_dtype
        ctx.set_materialize_grads(False)  # an output the loss does not use (the logged entropy) gets None
        return lp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        h, weight, targets, ent = ctx.saved_tensors
        warp, chunk, cd = ctx.warp, ctx.chunk, ctx.compute_dtype
        T = warp.temperature
        w = weight.to(cd)
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        g_h = torch.empty_like(h) if need_h else None
        g_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        for i in range(0, h.shape[0], chunk):
            hs, y = (h[i : i + chunk] / T).to(cd), targets[i : i + chunk]
            gl = g_lp[i : i + chunk].float().unsqueeze(-1) if g_lp is not None else hs.new_zeros(len(hs), 1, dtype=torch.float32)
            logp, drop = _chunk_logp(hs, w, y, warp)
            p = logp.exp()
            if drop is not None:
                logp.masked_fill_(drop, 0.0)
            if g_ent is None:  # dL/dz = g_lp (onehot - p)
                gz = p.mul_(-gl)
            else:  # dL/dz = g_lp (onehot - p) - g_ent p (logp + E) = p * (-g_ent logp - (g_lp + g_ent E)) + g_lp onehot
                ge = g_ent[i : i + chunk].float().unsqueeze(-1)
                gz = p.mul_(logp.mul_(-ge).sub_(gl + ge * ent[i : i + chunk].unsqueeze(-1)))
            gz.scatter_add_(-1, y.unsqueeze(-1), gl)
            gz = gz.to(cd)
            if need_h:  # z = (h / T) W^T: the 1/T lands on the [rows, H] side
                g_h[i : i + chunk] = ((gz @ w).float() / T).to(h.dtype)
            if need_w:
                g_w += (gz.T @ hs).float()
        return g_h, g_w.to(weight.dtype) if need_w else None, None, None, None, None


def head_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, warp: Warp | float = 1.0,
                  chunk: int = CHUNK_ROWS, compute_dtype: torch.dtype | None = None):
    """hidden [M, H] (final-norm outputs of the response positions), weight [V, H] (the LM head), targets [M]
    -> (logp [M], entropy [M]), fp32, differentiable w.r.t. hidden and weight, under the sampling distribution
    `warp` (a Warp, or a bare temperature). compute_dtype: the head matmul's dtype (default: the weight's;
    bf16 under an autocast update)."""
    warp = Warp.of(warp)
    cd = compute_dtype or weight.dtype
    if not torch.is_grad_enabled() or not (hidden.requires_grad or weight.requires_grad):
        with torch.no_grad():
            return _HeadLogprobs.forward(_NoCtx(), hidden, weight, targets, warp, chunk, cd)
    return _HeadLogprobs.apply(hidden, weight, targets, warp, chunk, cd)


class _NoCtx:
    """Stands in for autograd's ctx on a no-grad call (nothing is saved)."""

    def save_for_backward(self, *_):
        pass

    def set_materialize_grads(self, _):
        pass
