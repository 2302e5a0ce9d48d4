"""Token log-probabilities and entropies through the LM head in chunks of rows: no [tokens, V] float32 logits
tensor outlives one chunk, in the forward or the backward.

Invariant: `head_logprobs(h, W, y, T)` equals `token_logprobs(h @ W.T, y, T)` (algos.py, the full-logits
reference) in value and in gradient (w.r.t. h and W), within float rounding: fp32 agrees to ~1e-5, and a bf16
matmul (`compute_dtype=torch.bfloat16`) rounds the logits like an autocast forward would. The backward recomputes
each chunk's logits from the saved hidden rows (one extra matmul per chunk) instead of keeping them: that is what
makes the memory O(chunk * V) and the work linear in the response tokens (prompt rows never reach the head)."""

from __future__ import annotations

import torch

CHUNK_ROWS = 1024  # rows of the head per chunk: 1024 x 49152 fp32 logits = 200 MB at most, transient


def _chunk_stats(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor, temperature: float):
    """One chunk: logits z = h @ w.T / T (fp32), their logsumexp, the target's logit, softmax p, E_p[z]."""
    z = (h @ w.T).float().div_(temperature)
    lse = torch.logsumexp(z, dim=-1)
    p = torch.exp(z - lse.unsqueeze(-1))
    mean_z = (p * z).sum(-1)
    return z, lse, z.gather(-1, y.unsqueeze(-1)).squeeze(-1), p, mean_z


class _HeadLogprobs(torch.autograd.Function):
    """(hidden [M, H], head weight [V, H], targets [M]) -> (log p(target) [M], entropy [M]) under
    softmax(h @ W.T / T). Gradients: d logp / dz = onehot - p; d entropy / dz = -p * (z - E_p[z])."""

    @staticmethod
    def forward(ctx, h, weight, targets, temperature: float, chunk: int, compute_dtype):
        w = weight.to(compute_dtype)
        lp = torch.empty(h.shape[0], dtype=torch.float32, device=h.device)
        ent = torch.empty_like(lp)
        for i in range(0, h.shape[0], chunk):
            _, lse, zy, _, mean_z = _chunk_stats(h[i : i + chunk].to(compute_dtype), w, targets[i : i + chunk], temperature)
            lp[i : i + chunk] = zy - lse
            ent[i : i + chunk] = lse - mean_z
        ctx.save_for_backward(h, weight, targets)
        ctx.temperature, ctx.chunk, ctx.compute_dtype = temperature, chunk, compute_dtype
        return lp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        h, weight, targets = ctx.saved_tensors
        T, chunk, cd = ctx.temperature, ctx.chunk, ctx.compute_dtype
        w = weight.to(cd)
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        g_h = torch.empty_like(h) if need_h else None
        g_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        for i in range(0, h.shape[0], chunk):
            hc, y = h[i : i + chunk].to(cd), targets[i : i + chunk]
            z, _, _, p, mean_z = _chunk_stats(hc, w, y, T)
            # dL/dz = g_lp * (onehot - p) - g_ent * p * (z - E_p z), then through z = h W^T / T
            gz = p.mul_(-(g_lp[i : i + chunk].unsqueeze(-1) + g_ent[i : i + chunk].unsqueeze(-1) * (z - mean_z.unsqueeze(-1))))
            gz.scatter_add_(-1, y.unsqueeze(-1), g_lp[i : i + chunk].unsqueeze(-1).float())
            gz = gz.div_(T).to(cd)
            if need_h:
                g_h[i : i + chunk] = (gz @ w).to(h.dtype)
            if need_w:
                g_w += (gz.T @ hc).float()
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
