"""Length-aware placement of rollout work on workers (RhymeRL HistoPipe, Seer's divided rollout).

Invariants:
- Placement changes where and when a sample runs, never what it emits: every sample keeps its
  (prompt_index, sample_index) and its seed (seed + sample_index), and sampling noise is keyed by (seed, position).
- `place` covers every sample of every group exactly once.
- LPT (longest processing time first) puts each unit on the least loaded worker, largest predicted work first:
  Graham's bound makes the makespan at most 4/3 - 1/(3W) of optimal for exactly known work. RhymeRL's HistoPipe
  balances by lengths predicted from the previous epoch (the ranking of response lengths is stable across epochs);
  its exact "two-tier" algorithm is not public (seed notes), LPT is our choice. Each worker then runs its longest
  predicted units first, so a long response never starts last (Seer's context-aware scheduling).
"""

from __future__ import annotations

import hashlib
import heapq
import math
from collections import OrderedDict
from dataclasses import dataclass

from ..speculative.budgets import expected_remaining
from .cost import StepCost


@dataclass
class Unit:
    """Samples first..first+count-1 of one prompt's group, placed together (they share one prefill)."""

    prompt_index: int
    first: int
    count: int
    predicted: float  # tokens per sample

    @property
    def work(self) -> float:
        return self.predicted * self.count


def prompt_key(prompt) -> int:
    """A stable key for a prompt (token ids, text or chat messages), the same in every process."""
    raw = repr(list(prompt)) if isinstance(prompt, (list, tuple)) else repr(prompt)
    return int.from_bytes(hashlib.blake2b(raw.encode(), digest_size=8).digest(), "little")


class LengthPredictor:
    """Predicted response length of a prompt. Seen in earlier epochs: the mean of its last `keep` epochs'
    lengths (HistoPipe). Unseen: the running mean of its task (or level), else of all prompts, else `prior`.
    Also the expected remaining tokens of a running sample, conditioned on what it has emitted so far."""

    def __init__(self, prior: float, max_prompts: int = 100_000, keep: int = 2, alpha: float = 0.2):
        self.prior, self.max_prompts, self.keep, self.alpha = float(prior), max_prompts, keep, alpha
        self.history: OrderedDict[int, list[list[int]]] = OrderedDict()  # prompt key -> epochs of lengths
        self.task_mean: dict[str, float] = {}
        self.global_mean: float | None = None

    def lengths(self, prompt) -> list[int]:
        return [n for epoch in self.history.get(prompt_key(prompt), []) for n in epoch]

    def predict(self, prompt, task: str | None = None) -> float:
        past = self.lengths(prompt)
        if past:
            return sum(past) / len(past)
        if task is not None and task in self.task_mean:
            return self.task_mean[task]
        return self.global_mean if self.global_mean is not None else self.prior

    def remaining(self, prompt, task: str | None, done: int, cap: int) -> float:
        """E[L - done | L > done] over the prompt's past lengths; beyond all of them (or unseen), the prediction
        minus done, floored at half of what is done (heavy tails: a sample that ran long tends to run on)."""
        left = cap - done
        if left <= 0:
            return 0.0
        past = self.lengths(prompt)
        est = expected_remaining(past, done) if past else max(self.predict(prompt, task) - done, 0.5 * done, 1.0)
        return float(min(est, left))

    def observe(self, prompt, task: str | None, lengths: list[int]) -> None:
        """One epoch's response lengths of a prompt (all its samples)."""
        if not lengths:
            return
        key = prompt_key(prompt)
        epochs = self.history.setdefault(key, [])
        epochs.append(list(lengths))
        del epochs[: -self.keep]
        self.history.move_to_end(key)
        while len(self.history) > self.max_prompts:
            self.history.popitem(last=False)
        mean = sum(lengths) / len(lengths)
        if task is not None:
            self.task_mean[task] = self.task_mean.get(task, mean) + self.alpha * (mean - self.task_mean.get(task, mean))
        g = self.global_mean if self.global_mean is not None else mean
        self.global_mean = g + self.alpha * (mean - g)

    def state_dict(self) -> dict:
        return {"history": list(self.history.items()), "task_mean": dict(self.task_mean), "global_mean": self.global_mean}

    def load_state_dict(self, state: dict) -> None:
        self.history = OrderedDict((k, v) for k, v in state["history"])
        self.task_mean = dict(state["task_mean"])
        self.global_mean = state["global_mean"]


def unit_time(u: Unit, cost: StepCost | None) -> float:
    """A unit's predicted decode time alone on a worker (tokens when there is no cost model)."""
    return u.work if cost is None else cost.base_s * u.predicted + cost.per_token_s * u.work


def split_units(units: list[Unit], workers: int, cost: StepCost | None = None) -> list[Unit]:
    """Divided rollout (Seer): halve the largest unit while there are fewer units than workers or a unit alone
    would take more than a worker's fair share; a single sample is never split. Fair share: total work / W, plus,
    with a cost model, the per-step overhead of the longest prediction (every worker pays it once per step)."""
    units = list(units)
    if not units or workers < 1:
        return units
    if cost is None:
        fair = sum(u.work for u in units) / workers
    else:
        fair = cost.base_s * max(u.predicted for u in units) + cost.per_token_s * sum(u.work for u in units) / workers
    while True:
        splittable = [u for u in units if u.count > 1]
        if not splittable:
            return units
        big = max(splittable, key=lambda u: (unit_time(u, cost), -u.prompt_index))
        if len(units) >= workers and unit_time(big, cost) <= fair:
            return units
        units.remove(big)
        half = big.count // 2
        units += [Unit(big.prompt_index, big.first, half, big.predicted),
                  Unit(big.prompt_index, big.first + half, big.count - half, big.predicted)]


def lpt(works: list[float], workers: int, loads: list[float] | None = None) -> list[int]:
    """The worker of each item: items by decreasing work, each to the currently least loaded worker (ties:
    the lowest index, so the result is deterministic)."""
    heap = [(loads[w] if loads else 0.0, w) for w in range(workers)]
    heapq.heapify(heap)
    out = [0] * len(works)
    for i in sorted(range(len(works)), key=lambda i: (-works[i], i)):
        load, w = heapq.heappop(heap)
        out[i] = w
        heapq.heappush(heap, (load + works[i], w))
    return out


def lpt_cost(units: list[Unit], workers: int, cost: StepCost, max_seqs: int = 256) -> list[int]:
    """LPT under the step-cost model: a worker holding units of total work T tokens, the longest predicted at
    p tokens, takes about base_s * max(p, T / max_seqs) steps' overhead (at most max_seqs run at once) plus
    per_token_s * T. Units by decreasing predicted length, each onto an empty worker unless the least loaded
    busy one would finish sooner with it."""

    def load(p: float, work: float) -> float:
        return cost.base_s * max(p, work / max_seqs) + cost.per_token_s * work

    out = [0] * len(units)
    busy: list[tuple[float, int]] = []  # (load, worker)
    state: dict[int, tuple[float, float]] = {}  # worker -> (longest prediction, work)
    fresh = 0  # workers fresh..W-1 hold nothing yet
    for i in sorted(range(len(units)), key=lambda i: (-units[i].predicted, -units[i].work, i)):
        u = units[i]
        joined = None
        if busy:
            p, work = state[busy[0][1]]
            joined = (max(p, u.predicted), work + u.work)
        if fresh < workers and (joined is None or load(u.predicted, u.work) <= load(*joined)):
            w, fresh = fresh, fresh + 1
            state[w] = (u.predicted, u.work)
        else:
            _, w = heapq.heappop(busy)
            state[w] = joined
        out[i] = w
        heapq.heappush(busy, (load(*state[w]), w))
    return out


def place(units: list[Unit], workers: int, split: bool = True, cost: StepCost | None = None,
          max_seqs: int = 256) -> list[list[Unit]]:
    """HistoPipe placement: (optionally divided) units balanced by LPT (by the step-cost model when given,
    else by tokens); each worker's list longest first."""
    units = split_units(units, workers, cost) if split else list(units)
    plan: list[list[Unit]] = [[] for _ in range(workers)]
    where = lpt_cost(units, workers, cost, max_seqs) if cost is not None else lpt([u.work for u in units], workers)
    for u, w in zip(units, where):
        plan[w].append(u)
    for p in plan:
        p.sort(key=lambda u: (-u.predicted, u.prompt_index, u.first))
    return plan


def affine(plan: list[list[Unit]], live: list[int], last_worker) -> list[int]:
    """The worker of each bin: placement fixed the bins' loads and any permutation keeps them, so each bin (most
    samples first) goes to the free worker that ran most of its samples' prompts last time (its history drafter
    holds them). last_worker(unit) -> that worker or None."""
    order = sorted(range(len(plan)), key=lambda b: -sum(u.count for u in plan[b]))
    free, out = list(live), [0] * len(plan)
    for b in order:
        votes: dict[int, int] = {}
        for u in plan[b]:
            w = last_worker(u)
            if w in free:
                votes[w] = votes.get(w, 0) + u.count
        pick = max(votes, key=lambda w: (votes[w], -w)) if votes else free[0]
        free.remove(pick)
        out[b] = pick
    return out


def static_split(units: list[Unit], workers: int) -> list[list[Unit]]:
    """The baseline (verl's dispatch): contiguous chunks of equal unit count, in dataset order."""
    per = -(-len(units) // workers) if units else 0
    return [units[w * per : (w + 1) * per] for w in range(workers)]


def length_metrics(predicted: list[float], actual: list[float]) -> dict:
    """Predicted against actual length: Pearson correlation and mean absolute error."""
    n = len(actual)
    if n == 0:
        return {}
    mae = sum(abs(p - a) for p, a in zip(predicted, actual)) / n
    mp, ma = sum(predicted) / n, sum(actual) / n
    cov = sum((p - mp) * (a - ma) for p, a in zip(predicted, actual))
    vp = sum((p - mp) ** 2 for p in predicted)
    va = sum((a - ma) ** 2 for a in actual)
    corr = cov / math.sqrt(vp * va) if vp > 0 and va > 0 else 0.0
    return {"cluster/len_pred_corr": corr, "cluster/len_pred_mae": mae}
