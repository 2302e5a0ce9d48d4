"""One sample being generated, and the completion it becomes."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .sampling import SamplingParams
from .stats import SeqStats


@dataclass
class Completion:
    seq_id: int  # the engine's id of the sequence (add_requests / import_ returned it)
    prompt_index: int
    sample_index: int
    prompt_token_ids: list[int]
    token_ids: list[int]  # includes the EOS / stop token when generation ended on one
    text: str
    logprobs: list[float]  # of each token under the warped distribution it was sampled from
    finish_reason: str  # "stop" (EOS, stop token or string), "length", or "error"
    error: str | None = None
    timing: dict = field(default_factory=dict)  # queue_s, ttft_s, total_s
    stats: dict = field(default_factory=dict)
    # the target's last hidden state at every position but the last token, [prompt + output - 1, H], when the
    # engine captures them (for drafter training)
    hidden_states: object = field(default=None, repr=False)
    # a multi-turn trajectory (agent/ builds it; the engine never does): 1 on the tokens the policy sampled, 0 on
    # template and tool-observation tokens (None: every token is sampled), and its conversation and tool calls
    response_mask: list[int] | None = None
    trajectory: dict | None = field(default=None, repr=False)
    continues: int | None = None  # the finished turn this request went on from (its params.resume): a turn's chain

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "hidden_states"}


@dataclass
class Sequence:
    """A sample being generated: its tokens, how it samples, where its KV lives, and whether it finished.
    Its timings and counts are in `stats` (engine/stats.py); the speculator keeps its drafter state, draft
    depth and shadow drafts by `seq_id` (speculative/speculator.py) and drops them when the sequence leaves."""

    seq_id: int
    prompt_index: int
    sample_index: int
    prompt_ids: list[int]
    params: SamplingParams
    seed: int  # with the output position, keys the sampling noise
    max_tokens: int  # params.max_tokens clamped to the context
    stop_ids: frozenset[int]
    stats: SeqStats = field(default_factory=SeqStats)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    slot: int = -1  # its row in the KV block tables while running
    finish_reason: str | None = None
    error: str | None = None
    text: str = ""
    # chunks of the target's last hidden states, one row per cached token, when the engine captures them (the
    # learned drafter reads them; the completion returns them for drafter training)
    hidden: list = field(default_factory=list)
    kept: int = 0  # positions whose K/V its row already held when admitted (a resumed request): not prefilled

    @property
    def cache_len(self) -> int:
        """Tokens whose K/V are in the cache: the prompt and every output token but the last sampled one."""
        return len(self.prompt_ids) + len(self.output_ids) - 1

    def hidden_rows(self, start: int, end: int):
        """Rows start..end-1 of the captured hidden states (positions in prompt + output)."""
        rows, pos = [], 0
        for chunk in self.hidden:
            n = chunk.shape[0]
            if pos + n > start and pos < end:
                rows.append(chunk[max(start - pos, 0) : end - pos])
            pos += n
        return torch.cat(rows) if len(rows) != 1 else rows[0]

    @property
    def reserved_len(self) -> int:
        return len(self.prompt_ids) + self.max_tokens

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def finish(self, reason: str, error: str | None = None) -> None:
        self.finish_reason, self.error, self.stats.t_finish = reason, error, time.perf_counter()

    def to_completion(self) -> Completion:
        return Completion(
            seq_id=self.seq_id,
            prompt_index=self.prompt_index,
            sample_index=self.sample_index,
            prompt_token_ids=self.prompt_ids,
            token_ids=self.output_ids,
            text=self.text,
            logprobs=self.logprobs,
            finish_reason=self.finish_reason or "error",
            error=self.error,
            timing=self.stats.timing(),
            hidden_states=self.hidden_rows(0, self.cache_len) if self.hidden and self.cache_len > 0 else None,
            stats=self.stats.counts(),
            continues=self.params.resume,
        )
