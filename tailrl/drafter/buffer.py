"""Recent rollouts as drafter training data: (tokens, the target's hidden state at each position), tagged by
RL step, bounded in tokens (the oldest go first).

Sampling follows TLT's one-step offset: during step k's long tail the sequences that already finished are
the short ones, so half of each batch comes from earlier steps (by default step k-1), drawn in proportion
to length so the long responses the policy is producing now are not under-represented."""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass

import torch


@dataclass
class DraftSample:
    step: int
    tokens: list[int]  # prompt + response
    hidden: torch.Tensor  # [len(tokens) - 1, H] target hidden states (stored in bfloat16)
    prompt_len: int

    @property
    def train_positions(self) -> int:
        """Positions with a loss: inputs P-1 .. L-3 (each needs the next position's hidden state)."""
        return max(len(self.tokens) - 1 - self.prompt_len, 0)


class DraftBuffer:
    def __init__(self, max_tokens: int = 200_000, steps: int = 2, dtype: torch.dtype = torch.bfloat16):
        self.max_tokens, self.steps, self.dtype = max_tokens, steps, dtype
        self.items: deque[DraftSample] = deque()
        self.tokens = 0

    def __len__(self) -> int:
        return len(self.items)

    def add(self, prompt_ids: list[int], output_ids: list[int], hidden: torch.Tensor | None, step: int) -> bool:
        """One finished sequence; hidden [P + R - 1, H]. Sequences too short to train on are skipped."""
        tokens = list(prompt_ids) + list(output_ids)
        if hidden is None or len(output_ids) < 2 or hidden.shape[0] < len(tokens) - 1:
            return False
        item = DraftSample(step, tokens, hidden[: len(tokens) - 1].detach().to("cpu", self.dtype), len(prompt_ids))
        self.items.append(item)
        self.tokens += len(tokens)
        while self.tokens > self.max_tokens and len(self.items) > 1:
            self.tokens -= len(self.items.popleft().tokens)
        return True

    def add_completions(self, comps, step: int) -> int:
        return sum(self.add(c.prompt_token_ids, c.token_ids, c.hidden_states, step) for c in comps
                   if c.finish_reason != "error")

    def token_counts(self, vocab_size: int) -> torch.Tensor:
        counts = torch.zeros(vocab_size, dtype=torch.long)
        for it in self.items:
            counts += torch.bincount(torch.tensor(it.tokens), minlength=vocab_size)[:vocab_size]
        return counts

    def sample(self, batch_tokens: int, rng: random.Random, step: int | None = None) -> list[DraftSample]:
        """About batch_tokens training positions from the last `steps` RL steps (all steps if step is None)."""
        if not self.items:
            return []
        if step is None:
            pools = [list(self.items)]
        else:
            recent = [it for it in self.items if step - self.steps < it.step <= step]
            current = [it for it in recent if it.step == step]
            older = [it for it in recent if it.step < step]
            pools = [p for p in (current, older) if p] or [list(self.items)[-64:]]
        out, got = [], 0
        for k, pool in enumerate(pools):
            quota = batch_tokens * (k + 1) // len(pools)  # split the budget between the pools
            weights = [max(it.train_positions, 1) for it in pool] if k > 0 else None  # older: favour long ones
            tries = 0
            while got < quota and tries < 4 * len(pool) + 8:
                it = rng.choices(pool, weights=weights)[0] if weights else rng.choice(pool)
                out.append(it)
                got += it.train_positions
                tries += 1
        return out
