"""One packed micro-batch of the policy update (update.py): its forward, its loss (the policy loss `algo.loss`
under its clip range, the truncated importance weight, the KL term) and its backward, weighted so that the
micro-batches' losses sum to the mini-batch's under the aggregation mode."""

from __future__ import annotations

import functools

import torch

from ..algos import POLICY_LOSSES, aggregate, kl_penalty
from .forward import Batch, sequence_logprobs
from .logprobs import Warp
from .precision import Precision
from .update_metrics import micro_metrics


def loss_fn(algo) -> tuple:
    """The policy loss `algo.loss` names (algos.py; PPO with its dual clip `algo.clip_ratio_c`) and its clip range
    (clip_low, clip_high): PPO's, GSPO's own (sequence ratios need far smaller clips), or CISPO's weight cap with no
    lower bound (clip_low 1)."""
    clips = {"ppo": (algo.clip_low, algo.clip_high), "gspo": (algo.gspo_clip_low, algo.gspo_clip_high),
             "cispo": (1.0, algo.cispo_clip_high)}
    fn = POLICY_LOSSES[algo.loss]
    return (functools.partial(fn, clip_c=algo.clip_ratio_c) if algo.loss == "ppo" else fn), clips[algo.loss]


def masked_seqs(mask: torch.Tensor) -> int:
    """Sequences with a token on the mask: the seq-mean aggregations' count (a row fully masked is in none)."""
    return int((mask.sum(-1) > 0).sum())


def normalisers(mask: torch.Tensor, mini: list[int], rows: list[int]) -> tuple:
    """A mini-batch's (tokens, sequences) on the mask: the loss's, those of the whole mini-batch (the sequences
    left out included), and the diagnostics', those of the sequences computed (rows)."""
    tokens_in_mini, seqs_in_mini = float(mask[mini].sum().clamp_min(1)), max(masked_seqs(mask[mini]), 1)
    live_tokens = float(mask[rows].sum().clamp_min(1)) if rows else 1.0
    live_seqs = max(masked_seqs(mask[rows]), 1) if rows else 1
    return (tokens_in_mini, seqs_in_mini), (live_tokens, live_seqs)


def share(m: torch.Tensor, agg: str, norm: tuple) -> float:
    """A micro-batch's weight in a mean over norm's (tokens, sequences) under the aggregation mode."""
    tokens, seqs = norm
    return float(m.sum()) / tokens if agg == "token-mean" else masked_seqs(m) / seqs


def micro_loss(logp: torch.Tensor, old_lp: torch.Tensor, m: torch.Tensor, batch: Batch, micro: list[int],
               advantages: torch.Tensor, ref_lp: torch.Tensor | None, algo, objective: tuple) -> tuple:
    """The loss on one micro-batch and its parts (loss, kl or None, TIS weight or None, the policy loss's info).
    objective: (policy loss, clip range, aggregation mode)."""
    pg_loss, clips, agg = objective
    tis = None
    if algo.tis_cap > 0:
        tis = torch.exp(old_lp - batch.rollout_lp[micro].to(logp.device)).clamp(max=algo.tis_cap) * m
    loss, info = pg_loss(logp, old_lp, advantages[micro].to(logp.device), m, *clips, agg, weights=tis)
    kl = aggregate(kl_penalty(logp, ref_lp[micro].to(logp.device), algo.kl_type), m, agg) if ref_lp is not None else None
    if kl is not None:
        loss = loss + algo.kl_coef * kl
    return loss, kl, tis, info


def micro_step(prec: Precision, batch: Batch, micro: list[int], warp: Warp | float, old: torch.Tensor, first: bool,
               advantages: torch.Tensor, ref_lp: torch.Tensor | None, algo, objective: tuple, norms: tuple) -> dict:
    """Forward, loss and backward of one micro-batch, its gradient accumulated into the master (precision.py). On
    the first mini-batch (first) its own logprobs, detached, are its old ones, written into `old`. norms: the
    mini-batch's (`normalisers`). Returns its share of the mini-batch's metrics."""
    policy, agg = prec.model, objective[2]
    m = batch.mask[micro].to(policy.device)
    logp, ent = sequence_logprobs(policy, batch, micro, warp, prec.autocast)
    if first:
        old[micro] = logp.detach().to(old.device)
    old_lp = old[micro].to(logp.device)
    loss, kl, tis, info = micro_loss(logp, old_lp, m, batch, micro, advantages, ref_lp, algo, objective)
    w = share(m, agg, norms[0])
    (loss * w).backward()
    prec.accumulate()
    return micro_metrics(loss, kl, ent, info, tis, m, w, share(m, agg, norms[1]))
