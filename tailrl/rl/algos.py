"""GRPO / Dr.GRPO / DAPO pieces as plain functions over padded [B, T] tensors with a response mask."""

from __future__ import annotations

import torch

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
KL_KINDS = ("k1", "k3")


def group_advantages(rewards: torch.Tensor, group_size: int, norm_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """rewards [G * n] (groups contiguous) -> advantages: reward minus its group's mean, divided by the
    group's std for GRPO (norm_std) or not for Dr.GRPO."""
    r = rewards.view(-1, group_size).float()
    adv = r - r.mean(-1, keepdim=True)
    if norm_std:
        adv = adv / (r.std(-1, keepdim=True, unbiased=True) + eps) if group_size > 1 else adv
    return adv.view(-1)


def aggregate(values: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """token-mean: over all response tokens of the batch (DAPO); seq-mean-token-mean: per sequence, then over
    sequences (GRPO); seq-mean-token-sum: token sums per sequence, then over sequences (Dr.GRPO uses a constant
    normaliser; callers pass values pre-divided by it)."""
    mask = mask.to(values.dtype)
    if mode == "token-mean":
        return (values * mask).sum() / mask.sum().clamp_min(1)
    if mode == "seq-mean-token-mean":
        per_seq = (values * mask).sum(-1) / mask.sum(-1).clamp_min(1)
        return per_seq.mean()
    if mode == "seq-mean-token-sum":
        return (values * mask).sum(-1).mean()
    raise ValueError(f"unknown loss aggregation {mode!r}; choose one of {', '.join(AGG_MODES)}")


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                clip_low: float = 0.2, clip_high: float = 0.2, agg: str = "token-mean",
                weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """PPO clipped surrogate with decoupled clip range [1 - clip_low, 1 + clip_high] (DAPO clip-higher).
    advantages [B] (one per sequence) or [B, T]; weights [B, T], detached, multiply each token's loss (truncated
    importance sampling against the rollout engine's logprobs)."""
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
    ratio = torch.exp(logp - old_logp)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1 - clip_low, 1 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    loss = aggregate(per_token * weights.detach() if weights is not None else per_token, mask, agg)
    with torch.no_grad():
        m = mask.bool()
        clip_frac = ((clipped > unclipped) & m).float().sum() / m.sum().clamp_min(1)
        approx_kl = aggregate(old_logp - logp, mask, "token-mean")
    return loss, {"pg_clipfrac": float(clip_frac), "ppo_kl": float(approx_kl)}


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token KL(policy || reference) estimate from samples of the policy: k1 = log(p/r);
    k3 = r/p - log(r/p) - 1 (non-negative, low variance; verl's low_var_kl without the clamp)."""
    if kind == "k1":
        return logp - ref_logp
    if kind == "k3":
        d = ref_logp - logp
        return torch.exp(d) - d - 1
    raise ValueError(f"unknown KL estimator {kind!r}; choose one of {', '.join(KL_KINDS)}")


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probabilities of tokens [B, T] under logits [B, T, V] / temperature, and the entropy per position."""
    logp_all = torch.log_softmax(logits.float() / temperature, dim=-1)
    logp = logp_all.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy
