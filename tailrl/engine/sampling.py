"""Per-request sampling parameters, validated on construction so a bad value fails with its name."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    n: int = 1  # samples per prompt; they share one prefill
    max_tokens: int = 256
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int | None = None  # per-request; the n samples draw from seed, seed+1, ...
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # where the history drafter files this request's tokens and finds earlier epochs' and siblings' ones: (prompt ids,
    # turn). None: under its own prompt ids, turn 0. A multi-turn agent sets it for turns k >= 1, whose prompt is the
    # whole trajectory so far: epoch 2's turn k then drafts from epoch 1's turn k of the same prompt
    history: tuple | None = None
    # keep_kv: a sample that finishes on a stop string or stop token (not EOS, length or error) keeps its KV blocks,
    # parked under its seq_id, for a later request that continues it (resume); the engine frees them when memory
    # asks, on Engine.drop_kept, or at end_rollout. resume: the seq_id whose kept KV this request continues (its
    # prompt starts with that sequence's prompt and output): only the rest is prefilled, or all of it when the KV
    # was freed meanwhile (engine/scheduler.py)
    keep_kv: bool = False
    resume: int | None = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        checks = [
            (isinstance(self.n, int) and self.n >= 1, "n", "an integer >= 1"),
            (isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens", "an integer >= 1"),
            (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature) and self.temperature >= 0,
             "temperature", "a finite number >= 0 (0 = greedy)"),
            (isinstance(self.top_k, int) and self.top_k >= 0, "top_k", "an integer >= 0 (0 = off)"),
            (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1, "top_p", "in (0, 1]"),
            (self.seed is None or isinstance(self.seed, int), "seed", "an integer or None"),
            (all(isinstance(s, str) and s for s in self.stop), "stop", "a list of non-empty strings"),
            (all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids", "a list of token ids"),
            (self.history is None or (len(self.history) == 2 and isinstance(self.history[1], int)), "history",
             "None or (prompt ids, turn)"),
        ]
        for ok, name, what in checks:
            if not ok:
                raise ValueError(f"invalid sampling value {name}={getattr(self, name)!r}: must be {what}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
