"""The rewards role: the configured reward functions (runner.py, where one bad function or sample fails
alone) and the strict verifier behind `acc/mean`, scoring a step's completions against their prompts' rows.

Invariant: a completion is scored against the row of the prompt it answered (`prompt_index`); the rollout's
labels are checked before (guards.check_rollout_labels). DAPO's overlong term (overlong.py) enters training
scores only (group_size > 1): an eval judges answers, not their length; `acc/mean` never includes it."""

from __future__ import annotations

import torch

from ...config import Config
from .runner import RewardRunner
from .builtin import accuracy_verifier
from .overlong import overlong_terms


class Rewarder:
    def __init__(self, cfg: Config):
        r = cfg.reward
        self.runner = RewardRunner(r.functions, r.weights, r.timeout_s, r.max_failed_steps)
        self.verifier = accuracy_verifier(r.accuracy, r.functions)
        self.overlong = (cfg.rollout.max_tokens, r.overlong_buffer, r.overlong_penalty)

    def close(self) -> None:
        self.runner.close()

    def score(self, examples: list, comps, group_size: int) -> tuple[torch.Tensor, dict, list[bool]]:
        """(the reward of each completion, the step's reward metrics, whether each is correct by the verifier)."""
        prompts = [examples[c.prompt_index].prompt for c in comps]
        texts = [c.text for c in comps]
        columns = {"answer": [examples[c.prompt_index].answer for c in comps]}
        for key in examples[0].columns:
            columns[key] = [examples[c.prompt_index].columns.get(key) for c in comps]
        trajs = [getattr(c, "trajectory", None) or {} for c in comps]  # (tests score plain namespaces)
        if any(trajs):  # multi-turn: the whole conversation and its tool calls
            columns["conversation"] = [t.get("conversation") for t in trajs]
            columns["tool_calls"] = [t.get("tool_calls", []) for t in trajs]
        total, st = self.runner(prompts, texts, columns)
        correct = [self.verifier(t, **{k: v[i] for k, v in columns.items()}) for i, t in enumerate(texts)]
        over = {}
        if group_size > 1 and self.overlong[1] > 0:
            terms, over = overlong_terms([len(c.token_ids) for c in comps], *self.overlong)
            total = [t + p for t, p in zip(total, terms)]
        rewards = torch.tensor(total)
        groups = rewards.view(-1, group_size)
        metrics = {"reward/mean": float(rewards.mean()), "reward/std": float(rewards.std()) if len(rewards) > 1 else 0.0,
                   "reward/frac_zero_std": float((groups.std(-1) == 0).float().mean()) if group_size > 1 else 0.0,
                   "acc/mean": sum(correct) / len(correct), "reward/errors": st.errors, "reward/timeouts": st.timeouts,
                   "reward/invalid": st.invalid}
        for name, v in st.per_fn.items():
            metrics[f"reward/{name.split(':')[-1]}/mean"] = v
        metrics.update(over)
        return rewards, metrics, correct
