"""Run-time guards on what reaches the weights, and warnings when a policy collapses.

Invariants: an optimizer step is taken only on finite rewards, advantages, loss and gradient norm (the
update skips it otherwise and counts `train/skipped_steps`); `max_skipped` RL steps in a row without an
update stop the run with an error naming the last reason."""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


class RunStalledError(RuntimeError):
    pass


class StepGuard:
    def __init__(self, max_skipped: int, collapse_steps: int = 3, entropy_floor: float = 1e-3):
        self.max_skipped, self.collapse_steps, self.entropy_floor = max_skipped, collapse_steps, entropy_floor
        self.skipped_in_a_row = 0
        self.low_entropy = self.flat_reward = 0

    def after_step(self, step: int, metrics: dict, reason: str | None) -> None:
        """reason: why the step's update was skipped (None when it updated)."""
        if reason is None:
            self.skipped_in_a_row = 0
        else:
            self.skipped_in_a_row += 1
            log.warning("step %d: optimizer step skipped (%s); %d in a row (trainer.max_skipped_steps=%d)", step, reason,
                        self.skipped_in_a_row, self.max_skipped)
            if self.skipped_in_a_row >= self.max_skipped:
                raise RunStalledError(
                    f"{self.skipped_in_a_row} steps in a row without a policy update (last, step {step}: {reason}). "
                    "Check rollout.temperature, the reward functions and their weights, algo.lr and the data; "
                    "the skipped steps did not change the weights.")
            return  # a skipped step says nothing about collapse
        self.low_entropy = self.low_entropy + 1 if metrics.get("actor/entropy", 1.0) < self.entropy_floor else 0
        self.flat_reward = self.flat_reward + 1 if metrics.get("reward/frac_zero_std", 0.0) >= 1.0 else 0
        if self.low_entropy == self.collapse_steps:
            log.warning("policy collapse? entropy below %g for %d steps: the policy samples (almost) one answer",
                        self.entropy_floor, self.collapse_steps)
        if self.flat_reward == self.collapse_steps:
            log.warning("no learning signal for %d steps: every group's samples got the same reward "
                        "(reward/frac_zero_std = 1); the task may be too easy or too hard, or a reward constant",
                        self.collapse_steps)


def check_rollout_labels(examples: list, comps: list, n: int) -> None:
    """The rollout's completions come in (prompt, sample) order, n per prompt, each with the prompt it answered: a
    completion under another prompt's index would be scored against that prompt's answer. A mismatch is a bug in a
    rollout path (the cluster driver mislabelled migrated samples once), so the run stops before training on it."""
    if len(comps) != len(examples) * n:
        raise RuntimeError(f"the rollout returned {len(comps)} completions for {len(examples)} prompts x {n} samples")
    for k, c in enumerate(comps):
        want = (k // n, k % n)
        if (c.prompt_index, c.sample_index) != want or (
                c.finish_reason != "error" and list(c.prompt_token_ids) != list(examples[want[0]].ids)):
            raise RuntimeError(f"rollout completion {k} is labelled (prompt {c.prompt_index}, sample {c.sample_index}) "
                               f"but should answer (prompt {want[0]}, sample {want[1]}) with that prompt's tokens: "
                               "stopping rather than score it against the wrong answer")
