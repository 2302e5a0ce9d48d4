"""Token log-probabilities and entropies through the LM head in chunks of rows: no [tokens, V] float32 logits
tensor outlives one chunk, in the forward or the backward.

Invariant: `head_logprobs(h, W, y, T)` equals `token_logprobs(h @ W.T, y, T)` (algos.py, the full-logits
reference) in value and in gradient (w.r.t. h and W), within float rounding: fp32 agrees to ~1e-5, and a bf16
matmul (`compute_dtype=torch.bfloat16`) rounds the logits like an autocast forward would. The backward recomputes
each chunk's logits from the saved hidden rows (one extra matmul per chunk) instead of keeping them: that is what
makes the memory O(chunk * V) and the work linear in the response tokens (prompt rows never reach the head). The
elementwise work over [rows, V] is as much as the matmuls here, so it is kept to a fused log-softmax, one exp and
three in-place passes in the backward (benchmarks/head.py, in git at dc02aa5)."""

from __future__ import annotations

import torch

CHUNK_ROWS = 1024  # rows of the head per chunk: 1024 x 49152 fp32 logits = 200 MB at most, transient


def _chunk_logp(hs: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """One chunk's log-softmax [rows, V] in fp32, from hidden rows already scaled by 1/T and in the head's dtype.
    Temperature goes into the [rows, H] side, never over [rows, V]: every pass over a [rows, V] fp32 tensor costs
    about as much as the head's matmul on this CPU, so the chunk runs as few of them as it can."""
    return torch.log_softmax(hs @ w.T, dim=-1, dtype=torch.float32)


def _row_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """sum(a * b, -1) per row without an [rows, V] temporary."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).view(-1)


class _HeadLogprobs(torch.autograd.Function):
    """(hidden [M, H], head weight [V, H], targets [M]) -> (log p(target) [M], entropy [M]) under
    softmax(h @ W.T / T). With logp = log_softmax, p = exp(logp) and entropy E = -sum p logp:
    d logp_y / dz = onehot - p and dE / dz = -p (logp + E), for z = h W^T / T."""

    @staticmethod
    def forward(ctx, h, weight, targets, temperature: float, chunk: int, compute_dtype):
        w = weight.to(compute_dtype)
        lp = torch.empty(h.shape[0], dtype=torch.float32, device=h.device)
        ent = torch.empty_like(lp)
        for i in range(0, h.shape[0], chunk):
            logp = _chunk_logp((h[i : i + chunk] / temperature).to(compute_dtype), w)
            lp[i : i + chunk] = logp.gather(-1, targets[i : i + chunk].unsqueeze(-1)).squeeze(-1)
            ent[i : i + chunk] = -_row_dot(logp.exp(), logp)
        ctx.save_for_backward(h, weight, targets, ent)
        ctx.temperature, ctx.chunk, ctx.compute_dtype = temperature, chunk, compute_dtype
        ctx.set_materialize_grads(False)  # an output the loss does not use (the logged entropy) gets None
        return lp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        h, weight, targets, ent = ctx.saved_tensors
        T, chunk, cd = ctx.temperature, ctx.chunk, ctx.compute_dtype
        w = weight.to(cd)
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        g_h = torch.empty_like(h) if need_h else None
        g_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        for i in range(0, h.shape[0], chunk):
            hs, y = (h[i : i + chunk] / T).to(cd), targets[i : i + chunk]
            gl = g_lp[i : i + chunk].float().unsqueeze(-1) if g_lp is not None else hs.new_zeros(len(hs), 1, dtype=torch.float32)
            logp = _chunk_logp(hs, w)
            p = logp.exp()
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


def head_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                  chunk: int = CHUNK_ROWS, compute_dtype: torch.dtype | None = None):
    """hidden [M, H] (final-norm outputs of the response positions), weight [V, H] (the LM head), targets [M]
    -> (logp [M], entropy [M]), fp32, differentiable w.r.t. hidden and weight. compute_dtype: the head matmul's
    dtype (default: the weight's; bf16 under an autocast update)."""
    cd = compute_dtype or weight.dtype
    if not torch.is_grad_enabled() or not (hidden.requires_grad or weight.requires_grad):
        with torch.no_grad():
            return _HeadLogprobs.forward(_NoCtx(), hidden, weight, targets, temperature, chunk, cd)
    return _HeadLogprobs.apply(hidden, weight, targets, temperature, chunk, cd)


class _NoCtx:
    """Stands in for autograd's ctx on a no-grad call (nothing is saved)."""

    def save_for_backward(self, *_):
        pass

    def set_materialize_grads(self, _):
        pass
