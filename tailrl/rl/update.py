"""The policy update of one RL step: old/reference logprobs, PPO-clipped mini-batch steps with gradient
accumulation over length-grouped micro-batches, truncated importance sampling, and the non-finite guard.

Invariants:
- `optimizer.step()` runs only when the mini-batch loss and the gradient norm are finite; otherwise the
  gradients are dropped and the step is counted in `train/skipped_steps` (the weights never see NaN/inf).
- The PPO ratio's old logprobs are the trainer's own (never the engine's): recomputed in a no-grad pass when the
  policy moves within the batch (more than one optimizer step), else the current pass's logprobs, detached, which
  are exactly the trainer's old logprobs. The engine's logprobs (`Batch.rollout_lp`, bf16 rollout) enter only
  through the mismatch metrics and, with `algo.tis_cap > 0`, the truncated importance weight
  min(exp(old - rollout), cap), detached (verl's TIS for vLLM rollouts)."""

from __future__ import annotations

import math
import random
import time

import torch

from .algos import aggregate, kl_penalty, policy_loss
from .forward import Batch, length_micro_batches, no_grad_logprobs, sequence_logprobs
from .precision import Precision

STATS = ("actor/pg_loss", "actor/entropy", "actor/kl", "actor/pg_clipfrac", "actor/ppo_kl", "actor/grad_norm",
         "actor/tis_weight")


def mismatch(trainer_lp: torch.Tensor, rollout_lp: torch.Tensor, mask: torch.Tensor) -> dict:
    """Engine vs trainer logprobs over response tokens: `rollout/logprob_diff` (mean |diff|) and `_max`."""
    d = (trainer_lp.float() - rollout_lp.float()).abs() * mask
    return {"rollout/logprob_diff": float(d.sum() / mask.sum().clamp_min(1)), "rollout/logprob_diff_max": float(d.max())}


def policy_update(prec: Precision, optimizer, ref, batch: Batch, advantages: torch.Tensor, algo, temperature: float,
                  rng: random.Random, timing: dict) -> tuple[dict, str | None]:
    """prec: the fp32 master (the optimizer's parameters) and the module that computes (precision.py); ref: a
    frozen reference module or None. Returns the step's actor metrics and, when no optimizer step was taken, why."""
    a, policy, autocast = algo, prec.model, prec.autocast
    B = advantages.shape[0]
    mask = batch.mask
    n_updates = a.ppo_epochs * -(-B // a.mini_batch_size)
    t = time.perf_counter()
    old = no_grad_logprobs(policy, batch, a.micro_batch_size, temperature, autocast) if n_updates > 1 else None
    timing["timing_s/old_log_prob"] = time.perf_counter() - t
    t = time.perf_counter()
    ref_lp = no_grad_logprobs(ref, batch, a.micro_batch_size, temperature, autocast) if ref is not None else None
    timing["timing_s/ref"] = time.perf_counter() - t
    t = time.perf_counter()
    first_pass = torch.zeros_like(mask)  # the trainer's logprobs before any optimizer step (when old is None)
    prec.train()
    sums = dict.fromkeys(STATS, 0.0)
    count = skipped = 0
    reason = None
    for _ in range(a.ppo_epochs):
        order = list(range(B))
        rng.shuffle(order)
        for m0 in range(0, B, a.mini_batch_size):
            mini = order[m0 : m0 + a.mini_batch_size]
            tokens_in_mini = float(mask[mini].sum().clamp_min(1))
            optimizer.zero_grad(set_to_none=True)
            prec.zero_grad()
            step = dict.fromkeys(sums, 0.0)
            for micro in length_micro_batches(batch, mini, a.micro_batch_size):
                m = mask[micro].to(policy.device)
                logp, ent = sequence_logprobs(policy, batch, micro, temperature, autocast)
                if old is None:
                    first_pass[micro] = logp.detach().to(first_pass.device)
                old_lp = old[micro].to(logp.device) if old is not None else logp.detach()
                tis = None
                if a.tis_cap > 0:
                    tis = torch.exp(old_lp - batch.rollout_lp[micro].to(logp.device)).clamp(max=a.tis_cap) * m
                loss, info = policy_loss(logp, old_lp, advantages[micro].to(logp.device), m, a.clip_low,
                                         a.clip_high, a.loss_agg, weights=tis)
                kl = aggregate(kl_penalty(logp, ref_lp[micro].to(logp.device), a.kl_type), m, a.loss_agg) if ref_lp is not None else None
                if kl is not None:
                    loss = loss + a.kl_coef * kl
                # weight micro losses so their sum is the mini-batch loss under the aggregation mode
                w = float(m.sum()) / tokens_in_mini if a.loss_agg == "token-mean" else len(micro) / len(mini)
                (loss * w).backward()
                prec.accumulate()
                step["actor/pg_loss"] += float(loss.detach()) * w
                step["actor/entropy"] += float(aggregate(ent.detach(), m, "token-mean")) * w
                step["actor/kl"] += float(kl.detach()) * w if kl is not None else 0.0
                step["actor/pg_clipfrac"] += info["pg_clipfrac"] * w
                step["actor/ppo_kl"] += info["ppo_kl"] * w
                step["actor/tis_weight"] += float(aggregate(tis, m, "token-mean")) * w if tis is not None else w
            grad_norm = float(torch.nn.utils.clip_grad_norm_(prec.master.parameters(), a.grad_clip))
            step["actor/grad_norm"] = grad_norm
            if not math.isfinite(step["actor/pg_loss"] + step["actor/kl"]) or not math.isfinite(grad_norm):
                reason = (f"non-finite loss ({step['actor/pg_loss']:.4g})" if not math.isfinite(step["actor/pg_loss"])
                          else f"non-finite gradient norm ({grad_norm:.4g})")
                optimizer.zero_grad(set_to_none=True)
                skipped += 1
                continue
            optimizer.step()
            prec.after_step()
            count += 1
            for k, v in step.items():
                sums[k] += v
    prec.eval()
    optimizer.zero_grad(set_to_none=True)
    prec.zero_grad()
    timing["timing_s/update"] = dt = time.perf_counter() - t
    out = {k: v / max(count, 1) for k, v in sums.items()}
    out.update(mismatch(old if old is not None else first_pass, batch.rollout_lp, mask))
    out["actor/lr"] = a.lr
    out["train/skipped_steps"] = skipped
    # tokens through forward + backward (prompt and response, no padding), per second of the update phase
    out["perf/update_tokens_per_s"] = a.ppo_epochs * batch.tokens / max(dt, 1e-9)
    return out, reason if count == 0 else None
