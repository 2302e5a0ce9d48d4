"""The policy update of one RL step: old/reference logprobs, mini-batch steps of the policy loss `algo.loss`
(PPO-clipped by default; GSPO, CISPO: algos.py) with gradient accumulation over micro-batches in which a prompt's
samples share one copy of it (packing.py; a response is never split, so GSPO's sequence ratio sees all of it),
truncated importance sampling, and the non-finite guard. One micro-batch's forward, loss and backward are
micro_step.py's; the metrics, update_metrics.py's.

Invariants:
- `optimizer.step()` runs only when the mini-batch loss and the gradient norm are finite; otherwise the
  gradients are dropped and the step is counted in `train/skipped_steps` (the weights never see NaN/inf).
- The PPO ratio's old logprobs are the trainer's own (never the engine's): the first mini-batch's own forward,
  detached, for its sequences (no optimizer step has run yet), and a no-grad pass for the other sequences, run
  only when the policy moves within the batch (more than one optimizer step). The engine's logprobs
  (`Batch.rollout_lp`, bf16 rollout) enter only through the mismatch metrics and, with `algo.tis_cap > 0`, the
  truncated importance weight min(exp(old - rollout), cap), detached (verl's TIS for vLLM rollouts).
- Sequences with advantage exactly 0 are not computed (`update_plan`) while no KL term needs them: the mini-batch
  partition, the loss normalisers and the number of AdamW steps are those of the full computation, so the
  weights after the update are the same up to float summation order (tests/rl/test_update.py)."""

from __future__ import annotations

import random
import time

import torch

from ..algos import loss_agg
from .forward import Batch
from .logprobs import Warp
from .micro_step import loss_fn, micro_step, normalisers
from .packing import packed_tokens, segments
from .precision import Precision
from .ranks import SINGLE, Ranks, clip_grad_norm, padding_pass, rank_micros, reshard, shared_logprobs
from .update_metrics import STATS, actor_metrics, add_, non_finite, token_rates
from .update_metrics import mismatch  # noqa: F401 - also what tests import from here


def update_plan(groups: list[int], advantages: torch.Tensor, algo, rng: random.Random,
                has_ref: bool) -> tuple[list, list[bool]]:
    """The mini-batches of every PPO epoch and which sequences need a forward/backward.

    groups: a group id per sequence (the samples of one prompt). Each epoch shuffles the groups' order and cuts the
    sequences, a group's samples next to each other, into mini-batches, as verl does: a prompt's samples then share
    one copy of it in the forward (packing.py). A sequence whose advantage is exactly 0 (its whole GRPO group got the
    same reward) has a zero policy-gradient loss and a zero gradient, so it is left out when nothing else acts on it
    (no KL term); the mini-batch partition and every loss normaliser stay those of the whole batch."""
    B = len(groups)
    members = segments(groups, list(range(B)), B)  # each group's sequences, in index order
    minis = []
    for _ in range(algo.ppo_epochs):
        rng.shuffle(members)
        order = [i for g in members for i in g]
        minis += [order[m0 : m0 + algo.mini_batch_size] for m0 in range(0, B, algo.mini_batch_size)]
    if not algo.skip_zero_advantage or has_ref:
        return minis, [True] * B
    live = (advantages != 0).tolist()  # NaN != 0: a non-finite advantage is never skipped silently
    return minis, live


def policy_update(prec: Precision, optimizer, ref, batch: Batch, advantages: torch.Tensor, algo, warp: Warp | float,
                  rng: random.Random, timing: dict, ranks: Ranks = SINGLE) -> tuple[dict, str | None]:
    """warp: the rollout's sampling distribution (temperature, top-k, top-p: logprobs.py), under which every
    logprob here is computed, the reference's too (so its KL is 0 at the reference policy); prec: the fp32 master
    (the optimizer's parameters) and the module that computes (precision.py); ref: a
    frozen reference module or None; ranks: this trainer rank among N data-parallel ones (ranks.py: each computes
    whole groups of every mini-batch, and every rank returns the same metrics and takes the same decision).
    Returns the step's actor metrics and, when no optimizer step was taken, why.

    Exactness of the work skipped (`algo.skip_zero_advantage`): the left-out sequences add exactly 0 to every
    mini-batch loss and gradient; a mini-batch left with no sequence still takes its AdamW step, on zero gradients
    (Adam's moments move the weights then, as they would in the full computation)."""
    a, policy, autocast = algo, prec.model, prec.autocast
    B = advantages.shape[0]
    mask = batch.mask
    minis, live = update_plan(batch.groups, advantages, a, rng, ref is not None)
    objective = (*loss_fn(a), loss_agg(a.loss, a.loss_agg))
    live_rows = [i for i in range(B) if live[i]]
    first = set(minis[0])
    t = time.perf_counter()
    # the trainer's logprobs before any optimizer step: the first mini-batch's own forward gives them for its
    # sequences; a no-grad pass gives the rest, needed only when the policy moves within the batch
    old, old_rest = torch.zeros_like(mask), torch.zeros_like(mask)
    if len(minis) > 1:
        need = [i for i in live_rows if i not in first]
        if need:
            old_rest = shared_logprobs(ranks, policy, batch, a.micro_batch_size, warp, autocast, need,
                                       a.micro_batch_tokens)
    timing["timing_s/old_log_prob"] = time.perf_counter() - t
    t = time.perf_counter()
    ref_lp = (shared_logprobs(ranks, ref, batch, a.micro_batch_size, warp, autocast, list(range(B)),
                              a.micro_batch_tokens) if ref is not None else None)
    timing["timing_s/ref"] = time.perf_counter() - t
    t = time.perf_counter()
    prec.train()
    sums = dict.fromkeys(STATS, 0.0)
    count = skipped = computed = 0
    reason = None
    for k, mini in enumerate(minis):
        rows = [i for i in mini if live[i]]
        norms = normalisers(mask, mini, rows)
        optimizer.zero_grad(set_to_none=True)
        prec.zero_grad()
        step = dict.fromkeys(sums, 0.0)
        for micro in rank_micros(ranks, batch, rows, a.micro_batch_size, a.micro_batch_tokens):
            if micro is None:  # this rank has fewer micro-batches than another: a pass that adds 0 (ranks.py)
                padding_pass(policy, batch, warp, autocast, grad=True)
                continue
            computed += packed_tokens(batch.seqs, batch.prompt_lens, batch.groups, micro)
            add_(step, micro_step(prec, batch, micro, warp, old, k == 0, advantages, ref_lp, a, objective, norms))
        if k == 0:  # every rank's first-mini-batch logprobs (each row computed by one rank), then the rest's
            old = ranks.all_reduce_(old).add_(old_rest)
        step = ranks.sum_floats(step)
        reshard(ranks, policy)
        if not rows:  # no gradient to compute: AdamW still steps, on zeros
            step["actor/tis_weight"] = 1.0
            for p in prec.master.parameters():
                if p.requires_grad:
                    p.grad = torch.zeros_like(p)
        step["actor/grad_norm"] = clip_grad_norm(ranks, [p for p in prec.master.parameters() if p.requires_grad],
                                                 a.grad_clip)
        why = non_finite(step)
        if why is not None:
            reason = why
            optimizer.zero_grad(set_to_none=True)
            skipped += 1
            continue
        optimizer.step()
        prec.after_step()
        count += 1
        add_(sums, step)
    prec.eval()
    optimizer.zero_grad(set_to_none=True)
    prec.zero_grad()
    timing["timing_s/update"] = dt = time.perf_counter() - t
    out = actor_metrics(sums, count, skipped, a, batch, old, live)
    out.update(token_rates(ranks.sum_floats({"c": computed})["c"], a, batch, dt))
    return out, reason if count == 0 else None
