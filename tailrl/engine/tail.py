"""The rollout's long tail: ONE definition, used by every tail metric and by the spot trainer's lender.

**A step is in the tail when at most a quarter of the rollout's sequences run in it** (`in_tail`: 0 < running and
4 * running <= N; N = the rollout's sequences, prompts x samples). The last quarter is where a rollout's time goes
to a few long responses (RhymeRL, Seer and TLT report the tail this way), where a batch is too small to fill the
machine, and so where speculation and the spot trainer (TLT: the drafter trains on the idle capacity) pay.
Metrics from it: `rollout/tail_share`, `rollout/tail_s`, `rollout/body_s`, `spec/tail_speedup_est`,
`spec/body_speedup_est` (below, from the step records) and `spec/tail_tokens_per_s` (engine/stats.py); the lender
(drafter/train.py: SpotLender) lends threads exactly while `in_tail` holds.

The split of a rollout's time, from its step records (pure functions of the engine's `StepRecord`s, in step order):
- a step's **running** count is its decode batch (the sequences in the pass); a prefill step counts the batch of the
  decode step that follows it (the sequences it admitted run from then on). A rollout admits all its sequences at
  once unless the KV cache is short; sequences waiting for room (or preempted, to be recomputed) are not counted.
- `rollout/tail_share` = tail seconds / all seconds, both measured (`StepRecord.total_s`: the engine's time for
  the step, drafting and the speculator's feedback included, one-time CUDA-graph capture excluded).
- **SD-off estimate** of a step: `StepRecord.plain_est_s` for a decode step that has one. The speculator fills it in
  from the selector's cost model: the step's emitted tokens / B plain decode steps, each priced at the fitted
  plain-step cost of the step's batch-size bucket at the step's contexts (`speculative/step_cost.py`), the same
  estimator as `spec/speedup_est`. Prefill steps, and every step of a run without a speculator (SD off), count at
  their measured time, so SD off gives speedups of exactly 1.
- `spec/tail_speedup_est` = SD-off estimate / measured seconds over the tail's steps; `spec/body_speedup_est` the same
  over the body's. Both are 1.0 where the part has no time (no tail: every sequence ran to the end together).
It assumes the same running counts step by step with SD off, which holds where SD changes speed only (the same
tokens: batch-invariant decoding); `benchmarks/e2e.py` measures SD on against SD off for the whole rollout."""

from __future__ import annotations

from dataclasses import dataclass, field

TAIL_FRACTION = 0.25  # the tail: at most this share of the rollout's sequences still running


def tail_size(n_seqs: int) -> int:
    """The most sequences running in a tail step of a rollout of n_seqs sequences (0: too few to have a tail)."""
    return int(TAIL_FRACTION * n_seqs)


def in_tail(running: int, n_seqs: int) -> bool:
    """Whether a step with `running` sequences in it is in the long tail of a rollout of n_seqs sequences."""
    return 0 < running <= tail_size(n_seqs)


@dataclass
class TailSplit:
    """Seconds of a rollout split into body and tail, measured (`*_s`) and as SD-off estimate (`*_off_s`), and the
    running count over time: `timeline` holds [measured s, SD-off estimate s, running] at the end of each stretch of
    steps with the same running count (cumulative seconds from the rollout's start)."""

    body_s: float = 0.0
    tail_s: float = 0.0
    body_off_s: float = 0.0
    tail_off_s: float = 0.0
    timeline: list[list[float]] = field(default_factory=list)

    @property
    def tail_share(self) -> float:
        total = self.body_s + self.tail_s
        return self.tail_s / total if total > 0 else 0.0

    @property
    def tail_share_off(self) -> float:
        total = self.body_off_s + self.tail_off_s
        return self.tail_off_s / total if total > 0 else 0.0

    @property
    def tail_speedup(self) -> float:
        return self.tail_off_s / self.tail_s if self.tail_s > 0 else 1.0

    @property
    def body_speedup(self) -> float:
        return self.body_off_s / self.body_s if self.body_s > 0 else 1.0


def running_counts(records: list) -> list[int]:
    """Per record, the sequences running in it: a decode step's batch; a prefill step the next decode step's batch
    (its own batch if none follows); 0 for an idle step."""
    out, after = [0] * len(records), None
    for i in range(len(records) - 1, -1, -1):
        r = records[i]
        if r.kind == "decode":
            out[i] = after = r.batch
        elif r.kind == "prefill":
            out[i] = after if after is not None else r.batch
    return out


def off_estimate(record) -> float:
    """The step's SD-off seconds: the speculator's plain-decoding estimate where it made one, else the measured time."""
    return record.plain_est_s if record.kind == "decode" and record.plain_est_s > 0 else record.total_s


def split_tail(records: list, n_seqs: int) -> TailSplit:
    """The rollout's body/tail split (see the module docstring). n_seqs: the rollout's sequences (N >= 1)."""
    if n_seqs < 1:
        raise ValueError(f"a rollout has at least one sequence (got n_seqs={n_seqs})")
    out = TailSplit()
    on = off = 0.0
    for r, running in zip(records, running_counts(records)):
        if r.kind not in ("decode", "prefill"):
            continue
        t, t_off = r.total_s, off_estimate(r)
        if in_tail(running, n_seqs):
            out.tail_s += t
            out.tail_off_s += t_off
        else:
            out.body_s += t
            out.body_off_s += t_off
        on, off = on + t, off + t_off
        if out.timeline and out.timeline[-1][2] == running:
            out.timeline[-1][:2] = [on, off]
        else:
            out.timeline.append([on, off, running])
    return out


def tail_metrics(records: list, n_seqs: int) -> dict:
    """The trainer's per-step tail metrics (and the report's timeline, rounded to ms) from one rollout's records."""
    s = split_tail(records, n_seqs)
    return {"rollout/tail_share": s.tail_share, "rollout/tail_share_off_est": s.tail_share_off,
            "rollout/tail_s": s.tail_s, "rollout/body_s": s.body_s,
            "spec/tail_speedup_est": s.tail_speedup, "spec/body_speedup_est": s.body_speedup,
            "rollout/timeline": [[round(a, 3), round(b, 3), int(c)] for a, b, c in s.timeline]}
