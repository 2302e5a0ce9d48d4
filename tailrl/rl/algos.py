"""GRPO / Dr.GRPO / DAPO pieces, and the GSPO and CISPO policy losses, as plain functions over padded [B, T]
tensors with a response mask. Every policy loss returns (loss, {"pg_clipfrac", "ppo_kl"}) and takes `weights`
(truncated importance sampling), so the update calls any of them the same way (POLICY_LOSSES)."""

from __future__ import annotations

import math

import torch

from ..engine.sampler import warp_mask

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
# each policy loss's aggregation as its paper and verl define it (algo.loss_agg=auto): DAPO's token-mean for PPO
# (verl's default), the paper's 1/G sum_i 1/|y_i| sum_t for GSPO (eq. 5-7; verl's compute_policy_loss_gspo forces
# seq-mean-token-mean), token-mean for CISPO (MiniMax-M1 eq. 4)
PAPER_AGG = {"ppo": "token-mean", "gspo": "seq-mean-token-mean", "cispo": "token-mean"}
KL_KINDS = ("k1", "k3")


def group_advantages(rewards: torch.Tensor, group_size: int, norm_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """rewards [G * n] (groups contiguous) -> advantages: reward minus its group's mean, divided by the
    group's std for GRPO (norm_std) or not for Dr.GRPO."""
    r = rewards.view(-1, group_size).float()
    adv = r - r.mean(-1, keepdim=True)
    if norm_std:
        adv = adv / (r.std(-1, keepdim=True, unbiased=True) + eps) if group_size > 1 else adv
    return adv.view(-1)


def loss_agg(loss: str, agg: str) -> str:
    """The aggregation `algo.loss_agg` means for `algo.loss`: 'auto' is the loss's own (PAPER_AGG)."""
    return PAPER_AGG[loss] if agg == "auto" else agg


def aggregate(values: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """token-mean: over all response tokens of the batch (DAPO); seq-mean-token-mean: per sequence, then over
    sequences (GRPO, GSPO); seq-mean-token-sum: token sums per sequence, then over sequences (Dr. GRPO's sum over
    tokens; its paper also divides by a constant, the generation budget, which only scales the loss: not applied
    here, so the loss is Dr. GRPO's times that constant). The seq-means are over the sequences with at least one
    token on the mask: a row left fully out (algo.mask_truncated) is in no normaliser, as in verl's agg_loss."""
    mask = mask.to(values.dtype)
    if mode == "token-mean":
        return (values * mask).sum() / mask.sum().clamp_min(1)
    tokens = mask.sum(-1)
    seqs = (tokens > 0).sum().clamp_min(1)
    if mode == "seq-mean-token-mean":
        return ((values * mask).sum(-1) / tokens.clamp_min(1)).sum() / seqs
    if mode == "seq-mean-token-sum":
        return (values * mask).sum() / seqs
    raise ValueError(f"unknown loss aggregation {mode!r}; choose one of {', '.join(AGG_MODES)}")


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                clip_low: float = 0.2, clip_high: float = 0.2, agg: str = "token-mean",
                weights: torch.Tensor | None = None, clip_c: float = 0.0) -> tuple[torch.Tensor, dict]:
    """PPO clipped surrogate with decoupled clip range [1 - clip_low, 1 + clip_high] (DAPO clip-higher).
    advantages [B] (one per sequence) or [B, T]; weights [B, T], detached, multiply each token's loss (truncated
    importance sampling against the rollout engine's logprobs). clip_c > 1: dual-clip PPO (Ye et al. 2020, arXiv
    1912.09729; verl's clip_ratio_c): where the advantage is negative the loss is capped at -A * clip_c, so a token
    whose ratio ran far above 1 (off-policy) no longer pushes with a gradient that grows with the ratio; 0: off."""
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
    ratio = torch.exp(logp - old_logp)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1 - clip_low, 1 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    if clip_c > 0:
        per_token = torch.where(adv < 0, torch.minimum(per_token, -adv * clip_c), per_token)
    loss = aggregate(per_token * weights.detach() if weights is not None else per_token, mask, agg)
    return loss, _info(clipped > unclipped, logp, old_logp, mask)


def _info(clipped: torch.Tensor, logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> dict:
    """pg_clipfrac: the share of response tokens whose ratio was clipped; ppo_kl: mean old - new logprob."""
    with torch.no_grad():
        m = mask.bool()
        frac = (clipped & m).float().sum() / m.sum().clamp_min(1)
        return {"pg_clipfrac": float(frac), "ppo_kl": float(aggregate(old_logp - logp, mask, "token-mean"))}


def gspo_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
              clip_low: float = 3e-4, clip_high: float = 4e-4, agg: str = "seq-mean-token-mean",
              weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """GSPO (Zheng et al. 2025, arXiv 2507.18071): the importance ratio of a whole response, length-normalised,
    s_i = exp(mean over its response tokens of (logp - old_logp)), clipped at [1 - clip_low, 1 + clip_high] (the
    paper's clips are tiny, 3e-4 / 4e-4, as a sequence ratio moves far less than a token's), and the PPO surrogate
    -min(s_i A, clip(s_i) A) on it.

    Computed in the paper's GSPO-token form: s_i,t = sg[s_i] * exp(logp_t - sg[logp_t]), whose value is s_i at
    every token and whose gradient at token t is s_i * grad logp_t (eq. 17-18), so the loss is per token and goes
    through `aggregate`. With agg=seq-mean-token-mean (the paper's 1/G sum_i 1/|y_i| sum_t) its gradient equals
    sequence-level GSPO's exactly, s_i A_i / |y_i| on each token; token-mean instead weighs a response by its
    length. A clipped sequence (s_i past the clip on the side its advantage pushes) has zero gradient. The log
    ratio is capped at 10 before exp (verl's guard against overflow). advantages [B] or [B, T]."""
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
    m = mask.to(logp.dtype)
    seq_log_ratio = ((logp - old_logp) * m).sum(-1) / m.sum(-1).clamp_min(1)
    # the detached sequence log ratio added last, so its value is not rounded into logp's (verl PR 2775)
    s = torch.exp((logp - logp.detach() + seq_log_ratio.detach().unsqueeze(-1)).clamp(max=10.0))
    unclipped = -adv * s
    clipped = -adv * s.clamp(1 - clip_low, 1 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    loss = aggregate(per_token * weights.detach() if weights is not None else per_token, mask, agg)
    return loss, _info(clipped > unclipped, logp, old_logp, mask)


def cispo_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
               clip_low: float = 1.0, clip_high: float = 4.0, agg: str = "token-mean",
               weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """CISPO (MiniMax-M1, arXiv 2506.13585, eq. 4-5): -sg(clip(r_t, 1 - clip_low, 1 + clip_high)) * A * logp_t with
    r_t = exp(logp_t - old_logp_t), token-mean over the batch in the paper. The importance weight is clipped and
    detached, never the update: every token keeps its gradient, clip(r_t) * A * grad logp_t, also where r_t is past
    the clip (PPO drops those, among them the rare "fork" tokens the paper found GRPO clipping away). clip_low=1
    is no lower bound (weight >= 0), as in the paper; the loss's value is a log-likelihood, not a ratio, so it is
    not on PPO's scale. The log ratio is clamped to [-20, 20] before exp (verl's guard)."""
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
    ratio = torch.exp((logp - old_logp).detach().clamp(-20.0, 20.0))
    weight = ratio.clamp(1 - clip_low, 1 + clip_high)
    per_token = -weight * adv * logp
    loss = aggregate(per_token * weights.detach() if weights is not None else per_token, mask, agg)
    return loss, _info(weight != ratio, logp, old_logp, mask)


POLICY_LOSSES = {"ppo": policy_loss, "gspo": gspo_loss, "cispo": cispo_loss}


LR_SCHEDULES = ("constant", "cosine")


def lr_at(lr: float, schedule: str, step: int, steps: int, warmup: int = 0, min_ratio: float = 0.0) -> float:
    """The learning rate of RL step `step` (0-based) of `steps`: a linear warmup over the first `warmup` steps, then
    constant, or a cosine from lr down to lr * min_ratio at the last step (verl's and TRL's cosine schedule, per RL
    step: every optimizer step of an RL step's update takes the same rate). A function of the step alone, so a
    resumed run takes the rates the uninterrupted one took."""
    if step < warmup:
        return lr * (step + 1) / (warmup + 1)
    if schedule == "constant" or steps - warmup <= 1:
        return lr
    if schedule == "cosine":
        progress = min((step - warmup) / (steps - warmup - 1), 1.0)
        return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))
    raise ValueError(f"unknown learning-rate schedule {schedule!r}; choose one of {', '.join(LR_SCHEDULES)}")


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token KL(policy || reference) estimate from samples of the policy: k1 = log(p/r);
    k3 = r/p - log(r/p) - 1 (non-negative, low variance; verl's low_var_kl without the clamp)."""
    if kind == "k1":
        return logp - ref_logp
    if kind == "k3":
        d = ref_logp - logp
        return torch.exp(d) - d - 1
    raise ValueError(f"unknown KL estimator {kind!r}; choose one of {', '.join(KL_KINDS)}")


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0, top_k: int = 0,
                   top_p: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probabilities of tokens [B, T] under logits [B, T, V] / temperature, then top-k, then top-p (the
    sampler's `warp_mask`, each token kept in its own row's support), and the entropy per position: the full-logits
    reference of the update's chunked head (rl/actor/logprobs.py, which says why the trainer warps)."""
    x = logits.float() / temperature
    drop = None
    if top_k > 0 or top_p < 1:
        rows = x.reshape(-1, x.shape[-1])
        n = len(rows)
        drop = warp_mask(rows, torch.full((n,), top_k) if top_k > 0 else None,
                         torch.full((n,), float(top_p)) if top_p < 1 else None).view(x.shape)
        drop.scatter_(-1, tokens.unsqueeze(-1), False)
        x = x.masked_fill(drop, float("-inf"))
    logp_all = torch.log_softmax(x, dim=-1)
    logp = logp_all.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    p = logp_all.exp()
    entropy = -(p * (logp_all if drop is None else logp_all.masked_fill(drop, 0.0))).sum(-1)
    return logp, entropy
