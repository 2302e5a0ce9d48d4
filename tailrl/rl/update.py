"""The policy update of one RL step: padded batch, old/reference logprobs, PPO-clipped mini-batch steps with
gradient accumulation, and the non-finite guard.

Invariant: `optimizer.step()` runs only when the mini-batch loss and the gradient norm are finite; otherwise
the gradients are dropped and the step is counted in `train/skipped_steps` (the weights never see NaN/inf)."""

from __future__ import annotations

import math
import random
import time

import torch

from .algos import aggregate, kl_penalty, policy_loss, token_logprobs


def pad_batch(seqs: list[list[int]], pad: int) -> torch.Tensor:
    L = max(len(s) for s in seqs)
    return torch.tensor([s + [pad] * (L - len(s)) for s in seqs])


def make_batch(comps, pad: int) -> dict:
    """comps: completions that all have a prompt (rejected requests are left out before)."""
    seqs = [c.prompt_token_ids + c.token_ids for c in comps]
    tokens = pad_batch(seqs, pad)
    start = min(len(c.prompt_token_ids) for c in comps) - 1  # first position whose logits predict a response token
    T = tokens.shape[1] - 1 - start
    mask = torch.zeros(len(comps), T)
    for i, c in enumerate(comps):
        p = len(c.prompt_token_ids) - 1 - start
        mask[i, p : p + len(c.token_ids)] = 1.0 if c.finish_reason != "error" else 0.0
    return {"tokens": tokens, "targets": tokens[:, start + 1 :], "start": start, "mask": mask}


def logprobs(model, batch, idx, temperature: float, grad: bool):
    toks = batch["tokens"][idx].to(model.device)
    with torch.set_grad_enabled(grad):
        logits, _ = model.forward_full(toks[:, :-1], logits_start=batch["start"])
        return token_logprobs(logits, batch["targets"][idx].to(model.device), temperature)


def no_grad_logprobs(model, batch, micro: int, temperature: float) -> torch.Tensor:
    B = batch["tokens"].shape[0]
    with torch.inference_mode():
        return torch.cat([logprobs(model, batch, list(range(i, min(i + micro, B))), temperature, False)[0]
                          for i in range(0, B, micro)])


def policy_update(policy, optimizer, ref, batch, advantages: torch.Tensor, algo, temperature: float,
                  rng: random.Random, timing: dict) -> tuple[dict, str | None]:
    """Returns the step's actor metrics and, when no optimizer step was taken, why."""
    a = algo
    B = advantages.shape[0]
    n_updates = a.ppo_epochs * -(-B // a.mini_batch_size)
    t = time.perf_counter()
    # old logprobs are needed once the policy moves within the batch; a single on-policy update uses its own
    old = no_grad_logprobs(policy, batch, a.micro_batch_size, temperature) if n_updates > 1 else None
    timing["timing_s/old_log_prob"] = time.perf_counter() - t
    t = time.perf_counter()
    ref_lp = no_grad_logprobs(ref, batch, a.micro_batch_size, temperature) if ref is not None else None
    timing["timing_s/ref"] = time.perf_counter() - t
    t = time.perf_counter()
    policy.train()
    mask = batch["mask"]
    sums = {"actor/pg_loss": 0.0, "actor/entropy": 0.0, "actor/kl": 0.0, "actor/pg_clipfrac": 0.0,
            "actor/ppo_kl": 0.0, "actor/grad_norm": 0.0}
    count = skipped = 0
    reason = None
    for _ in range(a.ppo_epochs):
        order = list(range(B))
        rng.shuffle(order)
        for m0 in range(0, B, a.mini_batch_size):
            mini = order[m0 : m0 + a.mini_batch_size]
            tokens_in_mini = float(mask[mini].sum().clamp_min(1))
            optimizer.zero_grad(set_to_none=True)
            step = dict.fromkeys(sums, 0.0)
            for u0 in range(0, len(mini), a.micro_batch_size):
                micro = mini[u0 : u0 + a.micro_batch_size]
                m = mask[micro].to(policy.device)
                logp, ent = logprobs(policy, batch, micro, temperature, True)
                old_lp = old[micro].to(logp.device) if old is not None else logp.detach()
                loss, info = policy_loss(logp, old_lp, advantages[micro].to(logp.device), m, a.clip_low,
                                         a.clip_high, a.loss_agg)
                kl = aggregate(kl_penalty(logp, ref_lp[micro].to(logp.device), a.kl_type), m, a.loss_agg) if ref_lp is not None else None
                if kl is not None:
                    loss = loss + a.kl_coef * kl
                # weight micro losses so their sum is the mini-batch loss under the aggregation mode
                w = float(m.sum()) / tokens_in_mini if a.loss_agg == "token-mean" else len(micro) / len(mini)
                (loss * w).backward()
                step["actor/pg_loss"] += float(loss.detach()) * w
                step["actor/entropy"] += float(aggregate(ent.detach(), m, "token-mean")) * w
                step["actor/kl"] += float(kl.detach()) * w if kl is not None else 0.0
                step["actor/pg_clipfrac"] += info["pg_clipfrac"] * w
                step["actor/ppo_kl"] += info["ppo_kl"] * w
            grad_norm = float(torch.nn.utils.clip_grad_norm_(policy.parameters(), a.grad_clip))
            step["actor/grad_norm"] = grad_norm
            if not math.isfinite(step["actor/pg_loss"] + step["actor/kl"]) or not math.isfinite(grad_norm):
                reason = (f"non-finite loss ({step['actor/pg_loss']:.4g})" if not math.isfinite(step["actor/pg_loss"])
                          else f"non-finite gradient norm ({grad_norm:.4g})")
                optimizer.zero_grad(set_to_none=True)
                skipped += 1
                continue
            optimizer.step()
            count += 1
            for k, v in step.items():
                sums[k] += v
    policy.eval()
    optimizer.zero_grad(set_to_none=True)
    timing["timing_s/update"] = time.perf_counter() - t
    out = {k: v / max(count, 1) for k, v in sums.items()}
    out["actor/lr"] = a.lr
    out["train/skipped_steps"] = skipped
    return out, reason if count == 0 else None
