"""Learned-drafter settings: architecture, drafting shape, training and spot (long-tail) training."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DrafterConfig:
    enabled: bool = False  # RL: build (or load) a learned drafter and offer it to the selector
    path: str = ""  # warm start: a drafter folder from `tailrl drafter train` (empty: random init)
    draft_vocab: int = 4096  # the head predicts only the most frequent tokens (0 = the full vocabulary)
    topk: int = 4  # children per expanded node and nodes expanded per level of the draft tree
    min_prob: float = 0.02  # drop draft nodes whose cumulative draft probability falls below this
    # training (TLT's EAGLE recipe: SmoothL1 on the next hidden state + 0.1 x soft cross-entropy)
    lr: float = 5e-5  # online; the offline warm start (`tailrl drafter train`) defaults to 3e-4
    weight_decay: float = 0.01
    warmup_steps: int = 20
    grad_clip: float = 1.0
    hidden_weight: float = 1.0
    ce_weight: float = 0.1
    batch_tokens: int = 2048  # tokens per drafter optimizer step
    max_window: int = 512  # tokens per training sample (the end of long sequences)
    buffer_tokens: int = 200_000  # recent (hidden state, token) positions kept for training
    buffer_steps: int = 2  # train on the last K RL steps (TLT's one-step offset sampling)
    # spot training during the rollout's long tail
    spot: bool = True
    spot_threads: int = 1  # CPU threads the spot trainer takes from the rollout while it runs
    spot_share: float = 0.05  # spot training runs at most this share of the previous RL step's time
    # an RL step's share left unspent is saved up, to at most this many steps' shares: a drafter step longer than
    # one step's share (4.6 s against 0.7 s on a 2-core CPU, RESULTS 14) runs every few RL steps, not never
    spot_bank: int = 8
    spot_micro_tokens: int = 256  # micro-batch size: pausing waits for one micro-batch at most

    def __post_init__(self):
        if self.draft_vocab < 0:
            raise ValueError(f"drafter.draft_vocab={self.draft_vocab} must be >= 0 (0 = full vocabulary)")
        if self.topk < 1:
            raise ValueError(f"drafter.topk={self.topk} must be >= 1")
        if not 0 <= self.min_prob < 1:
            raise ValueError(f"drafter.min_prob={self.min_prob} must be in [0, 1)")
        if self.lr <= 0 or self.batch_tokens < 16 or self.max_window < 8:
            raise ValueError("drafter.lr must be > 0, batch_tokens >= 16 and max_window >= 8")
        if self.buffer_tokens < self.batch_tokens or self.buffer_steps < 1:
            raise ValueError("drafter.buffer_tokens must be >= batch_tokens and buffer_steps >= 1")
        if self.spot_threads < 1 or not 0 <= self.spot_share <= 1 or self.spot_bank < 1:
            raise ValueError("drafter.spot_threads must be >= 1, spot_share in [0, 1] and spot_bank >= 1")
