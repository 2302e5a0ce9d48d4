"""The update's batch and its forward: completions -> a `Batch`; micro-batches that keep a prompt's samples together;
token logprobs and entropies of the response tokens through the chunked LM head (logprobs.py).

Invariants:
- Values live in one [B, T] layout (`Batch.mask` marks response tokens; column j of row i is the token at
  position `start + 1 + j` of sequence i), whatever micro-batch computed them, so the loss code (algos.py) never
  sees how the forward was cut up.
- The samples of one prompt share one copy of it in the forward (packing.py), rows are packed without padding
  through every matrix product, and only response positions reach the LM head: the result equals one padded
  full-logits forward over the whole batch (tests/rl/test_update.py, tests/rl/test_packing.py) within float rounding.
- Under `autocast` the body's matrix products run in bf16 over fp32 master weights (torch.autocast) and the head
  matmul in bf16; softmax, logsumexp and everything after are fp32."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from .logprobs import CHUNK_ROWS, Warp, head_logprobs
from .packing import group_keys, layout, packed_len, segments, token_segments


@dataclass
class Batch:
    seqs: list[list[int]]  # prompt + response token ids
    prompt_lens: list[int]
    mask: torch.Tensor  # [B, T] float: 1 on response tokens
    rollout_lp: torch.Tensor  # [B, T] the engine's logprob of each response token (0 elsewhere)
    start: int  # position whose hidden state predicts column 0
    pad: int = 0
    groups: list[int] | None = None  # group id per sequence: equal for equal prompt ids (packing.group_keys)

    def __post_init__(self):
        if self.groups is None:
            self.groups = group_keys([s[:p] for s, p in zip(self.seqs, self.prompt_lens)])

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def tokens(self) -> int:
        """Tokens a forward over the whole batch reads (prompts and responses, no padding)."""
        return sum(len(s) - 1 for s in self.seqs)


def make_batch(comps, pad: int) -> Batch:
    """comps: completions that all have a prompt (rejected requests are left out before) and a logprob per token
    (a missing one is an error, never a silent 0)."""
    seqs = [c.prompt_token_ids + c.token_ids for c in comps]
    plens = [len(c.prompt_token_ids) for c in comps]
    start = min(plens) - 1  # first position whose logits predict a response token
    T = max(len(s) for s in seqs) - 1 - start
    mask, rollout = torch.zeros(len(comps), T), torch.zeros(len(comps), T)
    for i, c in enumerate(comps):
        p, n = plens[i] - 1 - start, len(c.token_ids)
        # a multi-turn trajectory's template and observation tokens (response_mask 0) never enter the loss, the KL,
        # the entropy or TIS: every one of them is weighed by this mask (agent/trajectory.py)
        rm = getattr(c, "response_mask", None)
        mask[i, p : p + n] = 1.0 if rm is None else torch.tensor(rm, dtype=torch.float32)
        if len(c.logprobs) != n:  # a 0 would pass for log p = 0: TIS weights min(p, cap), a logprob_diff of -log p
            raise ValueError(f"completion {i} of the batch has {len(c.logprobs)} rollout logprobs for its {n} tokens: "
                             "the rollout must report the logprob of every token it drew (the update's importance "
                             "weights and rollout/logprob_diff compare them with the trainer's)")
        rollout[i, p : p + n] = torch.tensor(c.logprobs, dtype=torch.float32)
    return Batch(seqs, plens, mask, rollout, start, pad)


def mask_truncated(batch: Batch, advantages: torch.Tensor, truncated: list[bool]) -> torch.Tensor:
    """DAPO's overlong filtering (TRL's `mask_truncated_completions`): a response cut at the length cap leaves the
    loss. Its mask row is zeroed, so no normaliser counts it (token-mean's tokens, the seq-means' sequences:
    algos.aggregate), and its advantage becomes 0, so
    `update_plan` does not compute it. Returns the advantages; the group's mean and std keep its reward, as in DAPO."""
    cut = torch.tensor(truncated, dtype=torch.bool)
    batch.mask[cut] = 0.0
    return advantages.masked_fill(cut, 0.0)


def micro_batches(batch: Batch, idx: list[int], size: int, tokens: int = 0) -> list[list[int]]:
    """Splits idx into micro-batches of at most `size` sequences, or with `tokens` > 0 of at most that many packed
    tokens (prompts once per segment, responses, no padding) whatever their count: a prompt's samples stay
    together (one segment, packing.py; a group larger than `size`, or than `tokens`, is cut; a sequence longer than
    `tokens` is a micro-batch alone), segments of similar packed length share a micro-batch (longest first), so
    padding is small. A function of the prompts and lengths only (deterministic)."""
    if tokens > 0:
        segs = token_segments(batch.groups, batch.seqs, batch.prompt_lens, idx, tokens)
    else:
        segs = segments(batch.groups, idx, size)
    lens = {g[0]: packed_len(batch.seqs, batch.prompt_lens, g) for g in segs}
    segs.sort(key=lambda g: (-lens[g[0]], g[0]))
    cost, cap = (lambda g: lens[g[0]], tokens) if tokens > 0 else (len, size)
    out: list[list[int]] = []
    used: list[int] = []
    for g in segs:
        if out and used[-1] + cost(g) <= cap:
            out[-1] = out[-1] + g
            used[-1] += cost(g)
        else:
            out.append(list(g))
            used.append(cost(g))
    return out


def autocast_ctx(model, enabled: bool):
    if not enabled:
        return contextlib.nullcontext()
    return torch.autocast(device_type=model.device.type, dtype=torch.bfloat16)


def sequence_logprobs(model, batch: Batch, idx: list[int], warp: Warp | float, autocast: bool = False,
                      chunk: int = CHUNK_ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    """Token logprobs and entropies [len(idx), T] of the response tokens of sequences idx (0 off the mask) under the
    sampling distribution `warp` (logprobs.py: temperature, top-k, top-p; a float is a temperature alone);
    differentiable when grad is enabled."""
    dev = model.device
    T = batch.mask.shape[1]
    lay = layout(batch.seqs, batch.prompt_lens, batch.groups, idx, batch.start, T, dev)
    with autocast_ctx(model, autocast):
        hidden = model.forward_shared(lay.tokens, lay.positions, lay.shared)  # the body only: rows go to the head
    h = hidden.index_select(0, lay.rows)  # rows repeat (a prompt's last row for each sample): see llama.py's gather
    lp, ent = head_logprobs(h, model.lm_head.weight, lay.targets, warp, chunk,
                            torch.bfloat16 if autocast else None)
    zeros = torch.zeros(len(idx) * T, device=dev)
    return zeros.scatter(0, lay.cols, lp).view(-1, T), zeros.scatter(0, lay.cols, ent).view(-1, T)


def no_grad_logprobs(model, batch: Batch, micro: int, warp: Warp | float, autocast: bool = False,
                     idx: list[int] | None = None, tokens: int = 0) -> torch.Tensor:
    """Logprobs without a graph (old or reference logprobs): [B, T] of the whole batch, or [len(idx), T] of the
    sequences idx, in micro-batches of `micro` sequences or `tokens` packed tokens (`micro_batches`)."""
    idx = list(range(len(batch))) if idx is None else list(idx)
    pos = {i: k for k, i in enumerate(idx)}
    out = torch.zeros(len(idx), batch.mask.shape[1])
    with torch.inference_mode():
        for ids in micro_batches(batch, idx, micro, tokens):
            out[[pos[i] for i in ids]] = sequence_logprobs(model, batch, ids, warp, autocast)[0].to(out.device)
    return out
