"""The policy update's metrics (update.py): each micro-batch's share of its mini-batch's, the non-finite guard's
reason, and the step's: means over the optimizer steps taken, the engine/trainer logprob mismatch, and the update's
token rates."""

from __future__ import annotations

import math

import torch

from ..algos import aggregate

STATS = ("actor/pg_loss", "actor/entropy", "actor/kl", "actor/pg_clipfrac", "actor/ppo_kl", "actor/grad_norm",
         "actor/tis_weight")


def mismatch(trainer_lp: torch.Tensor, rollout_lp: torch.Tensor, mask: torch.Tensor) -> dict:
    """Engine vs trainer logprobs over response tokens: `rollout/logprob_diff` (mean |diff|) and `_max`."""
    d = (trainer_lp.float() - rollout_lp.float()).abs() * mask
    return {"rollout/logprob_diff": float(d.sum() / mask.sum().clamp_min(1)), "rollout/logprob_diff_max": float(d.max())}


def micro_metrics(loss: torch.Tensor, kl: torch.Tensor | None, ent: torch.Tensor, info: dict,
                  tis: torch.Tensor | None, m: torch.Tensor, w: float, ws: float) -> dict:
    """One micro-batch's share of its mini-batch's metrics: the loss terms weighted as in the loss (w), the
    diagnostics as means over the sequences computed (ws); with no TIS the weight is 1."""
    return {"actor/pg_loss": float(loss.detach()) * w,
            "actor/entropy": float(aggregate(ent.detach(), m, "token-mean")) * ws,
            "actor/kl": float(kl.detach()) * w if kl is not None else 0.0,
            "actor/pg_clipfrac": info["pg_clipfrac"] * ws,
            "actor/ppo_kl": info["ppo_kl"] * ws,
            "actor/tis_weight": float(aggregate(tis, m, "token-mean")) * ws if tis is not None else ws}


def add_(acc: dict, d: dict) -> dict:
    """acc[k] += d[k] for every key of d, in d's order."""
    for key, v in d.items():
        acc[key] += v
    return acc


def non_finite(step: dict) -> str | None:
    """Why a mini-batch's optimizer step is dropped: its loss or gradient norm is not finite; None when both are."""
    loss, grad_norm = step["actor/pg_loss"], step["actor/grad_norm"]
    if math.isfinite(loss + step["actor/kl"]) and math.isfinite(grad_norm):
        return None
    return f"non-finite loss ({loss:.4g})" if not math.isfinite(loss) else f"non-finite gradient norm ({grad_norm:.4g})"


def actor_metrics(sums: dict, count: int, skipped: int, algo, batch, old: torch.Tensor, live: list[bool]) -> dict:
    """The step's actor metrics: sums over the `count` optimizer steps taken, as means; the engine/trainer mismatch
    over the sequences computed (live), whose share of the batch is what the zero-advantage skip saved."""
    B, mask = len(live), batch.mask
    live_rows = [i for i in range(B) if live[i]]
    out = {k: v / max(count, 1) for k, v in sums.items()}
    if live_rows:  # engine vs trainer logprobs, over the sequences the trainer computed
        out.update(mismatch(old[live_rows], batch.rollout_lp[live_rows], mask[live_rows]))
    out["actor/lr"] = algo.lr
    out["actor/zero_adv_skipped"] = (B - len(live_rows)) / B
    if not live_rows:  # no sequence computed: no entropy or ratio to report (a 0 would read as a collapsed policy)
        for k in ("actor/entropy", "actor/pg_clipfrac", "actor/ppo_kl"):
            out.pop(k)
    out["train/skipped_steps"] = skipped
    return out


def token_rates(computed: float, algo, batch, dt: float) -> dict:
    """Tokens through forward + backward (prompt and response, no padding), per second of the update phase; and the
    whole batch's tokens per second, the rate a computation of every sequence would have to match."""
    return {"perf/update_tokens_per_s": computed / max(dt, 1e-9),
            "perf/update_batch_tokens_per_s": algo.ppo_epochs * batch.tokens / max(dt, 1e-9)}
