"""The data-parallel side of the update: which sequences each trainer rank computes, and the few sums that make
N ranks' update the one-process update (issue 28).

Invariants:
- A rank computes whole groups (a prompt's samples share one copy of it, packing.py): the groups of a list of
  sequences are dealt to the ranks round-robin in their order of appearance, so every rank knows every rank's
  share from the batch alone (each rank holds the whole batch of token ids; it is small).
- Every rank runs the same number of forward/backward passes (FSDP2 gathers each layer's shards in every
  pass): a rank with fewer micro-batches runs padding passes (`None` in `rank_micros`) on a real row with
  weight 0, which add exactly 0 to every gradient.
- Loss normalisers are those of the whole mini-batch (computed from the whole batch, so the ranks' gradients
  sum to the one-process gradient; FSDP2's reduce-scatter sums, it does not average: `fsdp.apply_fsdp`), and
  the step's loss sums and the gradient norm are global, so a non-finite value on one rank skips the optimizer
  step on all of them.
- With one rank (`SINGLE`) every function here is the identity of the one-process code path."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .forward import Batch, micro_batches, sequence_logprobs
from .logprobs import Warp


@dataclass(frozen=True)
class Ranks:
    rank: int = 0
    world: int = 1

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        """Sums t over the ranks, in place."""
        if self.world > 1:
            import torch.distributed as dist

            dist.all_reduce(t)
        return t

    def sum_floats(self, values: dict) -> dict:
        """The dict's numbers summed over the ranks (one collective)."""
        if self.world == 1:
            return values
        t = self.all_reduce_(torch.tensor([float(v) for v in values.values()], dtype=torch.float64))
        return dict(zip(values, t.tolist()))

    def share(self, groups: list[int], rows: list[int], rank: int | None = None) -> list[int]:
        """The rows of `rows` that rank computes: whole groups, dealt round-robin in order of appearance."""
        if self.world == 1:
            return list(rows)
        order = {g: k for k, g in enumerate(dict.fromkeys(groups[i] for i in rows))}
        r = self.rank if rank is None else rank
        return [i for i in rows if order[groups[i]] % self.world == r]


SINGLE = Ranks()


def reshard(ranks: Ranks, model) -> None:
    """The root's shards back in place after a forward without backward (FSDP2 keeps the root gathered after
    its forward), so that the module's parameters are the sharded ones the optimizer holds."""
    if ranks.world > 1 and model is not None:
        model.reshard()


def rank_micros(ranks: Ranks, batch: Batch, rows: list[int], size: int, tokens: int = 0) -> list:
    """This rank's micro-batches of rows, then `None` (a padding pass) up to the count of the busiest rank."""
    if ranks.world == 1:
        return micro_batches(batch, rows, size, tokens)
    per = [micro_batches(batch, ranks.share(batch.groups, rows, r), size, tokens) for r in range(ranks.world)]
    most = max(len(p) for p in per)
    return per[ranks.rank] + [None] * (most - len(per[ranks.rank]))


def padding_pass(model, batch: Batch, warp: Warp | float, autocast: bool, grad: bool) -> None:
    """A forward (and with grad a backward of 0 x the loss) on row 0: the collectives of a pass, no gradient."""
    lp, _ = sequence_logprobs(model, batch, [0], warp, autocast)
    if grad:
        (lp.sum() * 0.0).backward()


def shared_logprobs(ranks: Ranks, model, batch: Batch, micro: int, warp: Warp | float, autocast: bool,
                    idx: list[int], tokens: int = 0) -> torch.Tensor:
    """No-grad logprobs [B, T] of the sequences idx (0 on the other rows), each computed by one rank, summed."""
    out = torch.zeros_like(batch.mask)
    with torch.no_grad():
        for ids in rank_micros(ranks, batch, idx, micro, tokens):
            if ids is None:
                padding_pass(model, batch, warp, autocast, grad=False)
                continue
            out[ids] = sequence_logprobs(model, batch, ids, warp, autocast)[0].to(out.device)
    reshard(ranks, model)
    return ranks.all_reduce_(out)


def clip_grad_norm(ranks: Ranks, params: list, max_norm: float) -> float:
    """Clips by the global gradient norm (over every rank's shards) and returns it."""
    if ranks.world == 1:
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads, 2.0)
    if isinstance(norm, DTensor):  # a partial norm over this rank's shards: reduce it to the global one
        norm = norm.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return float(norm)
