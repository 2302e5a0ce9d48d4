"""DAPO's dynamic sampling (Yu et al. 2025, arXiv 2503.14476, section 3.2; verl's `filter_groups`): a group whose
samples are all right or all wrong (eq. 11: 0 < #correct < G) adds nothing to learn from and only shrinks the batch.
What "alike" means is `algo.filter_metric`: acc (DAPO's, and `filter_groups.metric=acc` in verl's DAPO recipe: the
strict verifier's 0/1, `reward.accuracy`) or reward (the total, shaping and overlong terms included: any spread,
which has a gradient, but also one a length term alone makes: a group all right but for one response a token into
the overlong window gets GRPO advantages of +0.35 and -2.47 from that term, whatever its size). The step keeps
sampling rounds of `trainer.prompts_per_step` prompts, drops such groups, and stops once `prompts_per_step`
informative groups are in hand (the batch is cut to exactly that many, in the order drawn) or `algo.max_gen_rounds`
rounds ran (the update then takes the informative groups it has, and the metrics say so).

Invariants: a group stays whole (GRPO's mean and std are over all `rollout.n` samples); the rounds draw their prompts
from the one data loader and their seeds from (run seed, step, round, prompt), so a resumed run samples exactly what
the run that never stopped samples; round 0 is the step that dynamic sampling off runs."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

# reward metrics that count events (summed over rounds); the rest are means over samples (weighted by their count)
_SUMMED = ("reward/errors", "reward/timeouts", "reward/invalid", "rollout/rejected", "rollout/preemptions",
           "timing_s/sync", "rollout/partial_launched", "rollout/partial_carried", "rollout/partial_restarted")
_PEAK = ("rollout/peak_kv_gb", "rollout/peak_running", "rollout/partial_horizon")


def informative(values: torch.Tensor, group_size: int) -> list[bool]:
    """Per group (contiguous, group_size samples each): do its values (rewards, or 0/1 correct) differ?"""
    g = values.view(-1, group_size)
    return (g.max(-1).values > g.min(-1).values).tolist()


@dataclass
class Gathered:
    """The step's rounds: what the update trains on (`examples`, `comps` with prompt indices into `examples`,
    `rewards`, `correct`), and all that was sampled and scored (for the metrics)."""

    group_size: int
    want: int  # informative groups wanted (dynamic sampling) or 0 (off: every group of the one round)
    metric: str = "acc"  # what an informative group's samples differ in: acc (correct) | reward (algo.filter_metric)
    examples: list = field(default_factory=list)
    comps: list = field(default_factory=list)
    rewards: list = field(default_factory=list)
    correct: list = field(default_factory=list)
    sampled: list = field(default_factory=list)  # every completion of every round, rejected ones included
    all_comps: list = field(default_factory=list)  # accepted completions of every round
    all_rewards: list = field(default_factory=list)
    all_correct: list = field(default_factory=list)
    rounds: int = 0
    filtered: int = 0  # groups left out as not informative
    reward_only: int = 0  # of those, groups whose rewards differed (metric acc: a hint for custom rewards)
    surplus: int = 0  # informative groups beyond `want` (sampled in the last round, not trained on)
    reward_metrics: list = field(default_factory=list)  # (metrics, samples) per round
    rollout_metrics: list = field(default_factory=list)  # (metrics, tokens, seconds) per round

    @property
    def full(self) -> bool:
        return self.want > 0 and len(self.examples) >= self.want

    def add(self, examples: list, comps: list, rewards: torch.Tensor | None, correct: list[bool]) -> None:
        """One round's accepted completions (whole groups, in (prompt, sample) order) and their scores."""
        self.rounds += 1
        n = self.group_size
        if not comps:
            return
        self.all_comps += comps
        self.all_rewards += rewards.tolist()
        self.all_correct += correct
        by = torch.tensor(correct, dtype=torch.float32) if self.metric == "acc" else rewards
        keep = informative(by, n) if self.want else [True] * (len(comps) // n)
        spread = informative(rewards, n)
        for g, ok in enumerate(keep):
            if not ok:
                self.filtered += 1
                self.reward_only += spread[g]
                continue
            if self.want and len(self.examples) >= self.want:
                self.surplus += 1
                continue
            group = comps[g * n : (g + 1) * n]
            self.examples.append(examples[group[0].prompt_index])
            k = len(self.examples) - 1
            self.comps += [dataclasses.replace(c, prompt_index=k) for c in group]
            self.rewards += rewards[g * n : (g + 1) * n].tolist()
            self.correct += correct[g * n : (g + 1) * n]

    def metrics(self) -> dict:
        """The rounds' reward and rollout metrics over everything sampled, and dynamic sampling's own."""
        out = merge([(m, w) for m, w in self.reward_metrics], self.all_rewards, self.all_correct, self.group_size)
        out.update(merge_rollout(self.rollout_metrics))
        out["rollout/gen_rounds"] = self.rounds
        out["rollout/filtered_groups"] = self.filtered
        if self.want:  # sampled beyond the step's need (the last round's extra informative groups), not trained on
            out["rollout/surplus_groups"] = self.surplus
        out["rollout/informative_groups"] = len(self.examples) if self.want else sum(
            informative(torch.tensor(self.rewards), self.group_size)) if self.rewards else 0
        if self.want:  # 1: the rounds ran out (algo.max_gen_rounds) short of `want` groups; the update took fewer
            out["rollout/round_limit"] = float(not self.full)
        return out


def _weighted(parts: list[tuple[dict, float]]) -> dict:
    out, total = {}, {}
    for m, w in parts:
        for k, v in m.items():
            if not isinstance(v, (int, float)):
                out.setdefault(k, v)
                continue
            if k in _SUMMED:
                out[k] = out.get(k, 0) + v
            elif k in _PEAK:
                out[k] = max(out.get(k, v), v)
            else:
                out[k] = out.get(k, 0.0) + v * w
                total[k] = total.get(k, 0.0) + w
    return {k: v / total[k] if total.get(k) else v for k, v in out.items()}


def merge(parts: list[tuple[dict, float]], rewards: list[float], correct: list[bool], group_size: int) -> dict:
    """Reward metrics over all rounds: counts summed, per-function means weighted by samples, and the reward's mean,
    std and zero-std share recomputed over every sample scored."""
    if not parts:
        return {}
    if len(parts) == 1:
        return dict(parts[0][0])
    out = _weighted(parts)
    r = torch.tensor(rewards)
    out["reward/mean"] = float(r.mean())
    out["reward/std"] = float(r.std()) if len(r) > 1 else 0.0
    out["reward/frac_zero_std"] = 1.0 - sum(informative(r, group_size)) / (len(r) // group_size)
    out["acc/mean"] = sum(correct) / len(correct)
    return out


def merge_rollout(parts: list[tuple[dict, int, float]]) -> dict:
    """Rollout metrics over all rounds: counts summed, peaks the max, rates weighted by tokens, and the throughput
    recomputed as all tokens over all generation seconds."""
    if not parts:
        return {}
    if len(parts) == 1:
        return dict(parts[0][0])
    out = _weighted([(m, tokens) for m, tokens, _ in parts])
    tokens, seconds = sum(p[1] for p in parts), sum(p[2] for p in parts)
    out["perf/gen_tokens_per_s"] = tokens / seconds if seconds > 0 else 0.0
    return out
