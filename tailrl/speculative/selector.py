"""Per-batch choice of speculation strategy: off, or a drafter with a draft budget.

Expected throughput of an arm at batch size B (RLHFSpec-style cost model):
    B * (1 + accepted per sequence-step) / (T_step(B, R) + B * draft cost),  R = B * (1 + drafted)
with T_step fitted per batch-size bucket from that bucket's own steps (speculative/step_cost.py: c * B + r * draft rows +
v * [verifies]; what a row costs against a sequence changes with the batch), and acceptance and draft size tracked
per arm. Before a bucket's first step, T_forward measured over every forward (time against tokens in the pass)
plus a step's overhead outside it (sampling, acceptance, KV compaction; plain and speculative apart) stand in.
On top, a bucketed epsilon-greedy bandit (after TLT): per batch-size bucket and arm, the prediction is scaled by
a correction factor, an EMA of measured over predicted tokens / s, and with probability epsilon a random arm
among those within 15% of the best is tried, which also keeps the cost model's table filled."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import numpy as np

from .config import SpecConfig
from .step_cost import StepCost, attention_units, batch_bucket


@dataclass(frozen=True)
class Arm:
    drafter: str  # "" = off
    budget: int = 0

    def __str__(self) -> str:
        return f"{self.drafter}:{self.budget}" if self.drafter else "off"


OFF = Arm("")


def _overhead_key(spec: bool, rows: float) -> tuple[bool, int]:
    """Selector.step_overhead's key: plain or speculative, and the bucket of rows in the pass."""
    return spec, batch_bucket(max(int(rows), 1))


class CostModel:
    """Seconds of one forward as a function of the tokens in it: EMA per geometric bucket, interpolated."""

    def __init__(self, alpha: float = 0.3):
        self.alpha = alpha
        self.table: dict[int, list[float]] = {}  # bucket -> [mean tokens, mean seconds]

    @staticmethod
    def _bucket(tokens: int) -> int:
        return tokens if tokens <= 8 else 8 + round(math.log(tokens / 8) / math.log(1.25))

    def record(self, tokens: int, seconds: float) -> None:
        b = self._bucket(tokens)
        cell = self.table.get(b)
        if cell is None:
            self.table[b] = [float(tokens), seconds]
        else:
            cell[0] += self.alpha * (tokens - cell[0])
            cell[1] += self.alpha * (seconds - cell[1])

    def predict(self, tokens: float) -> float | None:
        if not self.table:
            return None
        pts = sorted(self.table.values())
        lo = [p for p in pts if p[0] <= tokens]
        hi = [p for p in pts if p[0] > tokens]
        if lo and hi:
            (t0, s0), (t1, s1) = lo[-1], hi[0]
            return s0 + (s1 - s0) * (tokens - t0) / (t1 - t0)
        if lo:  # beyond the largest measured pass: no cheaper than linear growth from it
            t0, s0 = lo[-1]
            return s0 * tokens / t0
        return hi[0][1]  # below the smallest: at least as cheap as it (optimistic; measuring corrects it)


class PassCost:
    """Seconds of one decode/verify forward as a + b * rows + c * sequences, least squares over the recent passes
    (forgetting factor `decay` per pass). The rows alone do not say it: a batch-invariant pass pads every
    sequence's attention to 4 query rows over the whole cache (engine/invariant.py), so 17 rows of one sequence cost
    about a plain step of one (26 ms here), and 17 rows of 16 sequences twice that. The selector predicts passes from
    it (`forward_s`) and tells from it where a deeper draft is free (`cheap_rows`); None until passes of different
    shapes separate the three terms (the rows-only table stands in until then)."""

    def __init__(self, decay: float = 0.99):
        self.decay = decay
        self.xx = np.zeros((3, 3))
        self.xy = np.zeros(3)
        self._w: np.ndarray | None = None

    def record(self, rows: int, seqs: int, seconds: float) -> None:
        x = np.array([1.0, rows, seqs])
        self.xx = self.decay * self.xx + np.outer(x, x)
        self.xy = self.decay * self.xy + seconds * x
        self._w = None

    def predict(self, rows: float, seqs: float) -> float | None:
        if self._w is None:
            # scaled so the rank test compares like with like (rows run to hundreds, the constant is 1)
            d = np.sqrt(np.maximum(np.diag(self.xx), 1e-12))
            a = self.xx / np.outer(d, d)
            if np.linalg.matrix_rank(a, tol=1e-6) < 3:
                return None
            self._w = np.linalg.solve(a, self.xy / d) / d
        return float(self._w @ np.array([1.0, rows, seqs]))


class Rate:
    """Extra tokens (or drafted nodes) per sequence-step, as exponentially decayed sums over sequence-steps:
    a 32-sequence step weighs 32 single-sequence shadow observations, and one lucky sequence moves it little."""

    def __init__(self, half_life: float = 200.0):
        self.decay = 0.5 ** (1 / half_life)
        self.total = 0.0
        self.weight = 0.0

    def add(self, value_sum: float, seq_steps: int) -> None:
        d = self.decay**seq_steps
        self.total = self.total * d + value_sum
        self.weight = self.weight * d + seq_steps

    def mean(self, default: float) -> float:
        return self.total / self.weight if self.weight > 0 else default


class Selector:
    margin = 1.05  # speculate only where the model expects at least this gain over plain decoding

    def __init__(self, cfg: SpecConfig, drafters: list[str] | None = None, alpha: float = 0.2,
                 budgets: tuple[int, ...] | None = None):
        """budgets: the arms' draft budgets (default cfg.budgets; the speculator passes them cut to whole query
        blocks where the verifier attends in blocks, speculative/budgets.py:block_budget)."""
        self.cfg = cfg
        drafters = list(cfg.drafters if drafters is None else drafters)
        self.budgets = tuple(cfg.budgets if budgets is None else budgets)
        self.drafter_arms = [Arm(d, b) for d in drafters for b in self.budgets]
        # how the verifier's attention reads keys (step_cost.attention_units): (query rows per read, 0 = all of a
        # sequence's rows at once; keys per chunk). The speculator sets it from the engine's passes
        self.attend = (0, 256)
        self.arms = ([OFF] if cfg.mode == "auto" else []) + self.drafter_arms
        self.alpha = alpha
        self.cost = CostModel()
        self.pass_cost = PassCost()
        # a step's seconds per batch-size bucket, c * B + r * (draft rows) + v * [verifies]: what arms are predicted
        # from once their bucket has run a step (the global fits above only stand in before that; one line through
        # all batch sizes priced a plain step of 2 at 57 ms where it costs 25, and made plain decoding look slow)
        self.step_cost = StepCost()
        self.accept = {a: Rate() for a in self.drafter_arms}  # shadow drafts measure it even while unused
        self.drafted = {a: Rate() for a in self.drafter_arms}
        self.draft_cost = {d: 0.0 for d in drafters}  # seconds per sequence proposal
        # seconds per row outside the forward and drafting, for plain and for speculative steps (None: not yet seen)
        self.overhead: dict[bool, float | None] = {False: None, True: None}
        # seconds per step outside the forward and drafting, per (speculative?, bucket of rows in the pass). On a
        # CPU sampling grows with the rows (per-row above is right); on a GPU a step's host work and small kernels
        # cost about the same at 4 rows as at 64 (2 ms against a 3 ms forward), which per-row would split wrongly
        self.step_overhead: dict[tuple[bool, int], float] = {}
        self._first_overhead: dict[tuple[bool, int], float] = {}  # a bucket's first sample, until its second
        self.correction: dict[tuple[int, Arm], float] = {}  # measured / predicted reward per bucket and arm
        self.rng = random.Random(cfg.seed)

    def chunks(self, contexts: list[int] | None) -> float:
        """The key chunks a plain pass over sequences holding `contexts` tokens reads (0 without contexts): computed
        once a step; an arm's pass reads them once per query block of its rows (`units`)."""
        return attention_units(contexts, [1] * len(contexts), 0, self.attend[1]) if contexts else 0.0

    def units(self, chunks: float, q: float) -> float:
        """Key chunks a pass reads where every sequence verifies q rows (a draft crossing into a new chunk aside)."""
        block = self.attend[0]
        return chunks * (math.ceil(q / block) if block else 1)

    def predict(self, arm: Arm, B: int, chunks: float = 0.0) -> float | None:
        """Expected tokens per second for B sequences (None: not measured yet); chunks: the key chunks a plain pass
        over them reads (`chunks`), for the attention's share of a step."""
        if arm == OFF:
            t = self.plain_step_s(B, chunks)
            return B / t if t else None
        est = self._acceptance(arm)
        if est is None:
            return None
        accepted, drafted = est
        rows = B * (1 + drafted)
        local = self.local_step_s(B, rows, self.units(chunks, 1 + drafted))
        if local is not None:
            return B * (1 + accepted) / (local + B * self.draft_cost[arm.drafter])
        t = self.forward_s(rows, B)
        if t is None:
            return None
        # a verify step does all that a plain step of as many rows does, and more: never predict it cheaper (two
        # noisy estimates otherwise let near-empty drafts, which cost a plain step, beat plain decoding's margin)
        plain = self.step_overhead.get(_overhead_key(False, rows), 0.0)  # where measured
        outside = max(self.overhead_s(True, rows), plain)
        step_s = t + outside + B * self.draft_cost[arm.drafter]
        return B * (1 + accepted) / step_s

    def _acceptance(self, arm: Arm) -> tuple[float, float] | None:
        """(accepted, drafted) per sequence-step of an arm. An arm not measured yet borrows the acceptance of its
        drafter's largest measured smaller budget, a lower bound (a longer draft of the same drafter accepts at least
        as much), at its full budget of rows: so a drafter is tried first at its smallest budget, which costs least
        where the batch is large, and its deeper budgets win where that bound already pays (the tail, where shadow
        drafts then measure them). None: nothing of the drafter measured yet."""
        if self.accept[arm].weight > 0:
            return self.accept[arm].mean(0.0), self.drafted[arm].mean(arm.budget)
        smaller = [a for a in self.drafter_arms if a.drafter == arm.drafter and a.budget < arm.budget
                   and self.accept[a].weight > 0]
        if not smaller:
            return None
        return self.accept[max(smaller, key=lambda a: a.budget)].mean(0.0), float(arm.budget)

    def cheap_rows(self, B: int, rows: int, slack: float = 1.15) -> bool:
        """Whether a forward of `rows` rows over B sequences is predicted to cost at most `slack` times a plain step
        of the B (the long tail on a CPU, where a pass streams the weights once whatever its few rows:
        benchmarks/verify_cost.py, in git at 103a651). False while the cost of rows and of sequences is not yet told
        apart."""
        plain, wide = self.pass_cost.predict(B, B), self.pass_cost.predict(rows, B)
        return plain is not None and wide is not None and plain > 0 and wide <= slack * plain

    def local_step_s(self, B: int, rows: float, units: float = 0.0) -> float | None:
        """Seconds of a step of `rows` rows over B sequences reading `units` key chunks (drafting aside) from the
        bucket's own fit; None before the bucket's first step."""
        return self.step_cost.seconds(B, rows, units)

    def end_rollout(self) -> None:
        self.step_cost.end_rollout()

    def plain_step_s(self, B: int, chunks: float = 0.0) -> float | None:
        """Expected seconds of a plain decode step of B sequences (forward and sampling) reading `chunks` key chunks."""
        local = self.local_step_s(B, B, chunks)
        if local is not None:
            return local
        t = self.forward_s(B, B)
        return t + self.overhead_s(False, B) if t else None

    def forward_s(self, rows: float, B: int) -> float | None:
        """Expected seconds of a forward of `rows` rows over B sequences: the rows-and-sequences fit where it has
        separated them (the same rows cost less over fewer sequences), else the table of passes by rows."""
        t = self.pass_cost.predict(rows, B)
        return t if t is not None and t > 0 else self.cost.predict(rows)

    def _record_step_overhead(self, key: tuple[bool, int], outside: float) -> None:
        """A step's time outside the forward is the step's work plus whatever paused the process (a collection, a
        cache re-layout, another tenant): outliers, and all of them upward. So the estimate starts from the smaller
        of the first two steps, and a later step may raise it by at most half (a tenth after the EMA) per step. An
        arm that looks slow is no longer chosen, so an outlier that stuck would never be measured away."""
        seen = self.step_overhead.get(key)
        if seen is None:
            first = self._first_overhead.pop(key, None)
            if first is None:
                self._first_overhead[key] = outside
            else:
                self.step_overhead[key] = min(first, outside)
            return
        self.step_overhead[key] = seen + self.alpha * (min(outside, 1.5 * seen) - seen)

    def overhead_s(self, spec: bool, rows: float) -> float:
        """Seconds a step of this many rows spends outside the forward and drafting: as measured for passes of
        about as many rows, else the per-row rate times rows."""
        seen = self.step_overhead.get(_overhead_key(spec, rows))
        return seen if seen is not None else rows * (self.overhead[spec] or 0.0)

    def score(self, arm: Arm, B: int, chunks: float = 0.0) -> float:
        p = self.predict(arm, B, chunks)
        if p is None:
            return float("inf")  # nothing measured yet: try it
        return p * self.correction.get((batch_bucket(B), arm), 1.0)

    def choose(self, B: int, contexts: list[int] | None = None) -> Arm:
        if len(self.arms) == 1:
            return self.arms[0]
        chunks = self.chunks(contexts)
        scores = {a: self.score(a, B, chunks) for a in self.arms}
        if OFF in scores:
            scores[OFF] *= self.margin
        best = max(scores.values())
        if self.rng.random() < self.cfg.epsilon:  # explore among arms that are not hopeless, and plain decoding:
            # the baseline costs little to re-measure, and a stale estimate of it would keep every drafter chosen
            return self.rng.choice([a for a, v in scores.items() if v >= 0.85 * best or a == OFF])
        return max(scores, key=scores.get)

    def _ema(self, table: dict, key, value: float) -> None:
        table[key] += self.alpha * (value - table[key])

    def record(self, arm: Arm, B: int, tokens_in_pass: int, forward_s: float, step_s: float,
               emitted: int, drafted: int, draft_s: float, units: float = 0.0, chunks: float = 0.0) -> None:
        """One decode step of B sequences that emitted `emitted` tokens from `drafted` draft nodes; units: the key
        chunks its pass read (attention_units), chunks: those a plain pass over the same sequences reads."""
        predicted = self.predict(arm, B, chunks)
        self.cost.record(tokens_in_pass, forward_s)
        self.pass_cost.record(tokens_in_pass, B, forward_s)
        self.step_cost.record(B, tokens_in_pass, step_s - draft_s, units)
        if predicted:
            key = (batch_bucket(B), arm)
            ratio = min(max((emitted / step_s) / predicted, 0.25), 4.0)
            self.correction[key] = self.correction.get(key, 1.0) + self.alpha * (ratio - self.correction.get(key, 1.0))
        spec = arm != OFF
        outside = max(step_s - forward_s - draft_s, 0.0)
        per_row = outside / max(tokens_in_pass, 1)
        seen = self.overhead[spec]
        self.overhead[spec] = per_row if seen is None else seen + self.alpha * (per_row - seen)
        self._record_step_overhead(_overhead_key(spec, tokens_in_pass), outside)
        if spec:
            self.accept[arm].add(emitted - B, B)
            self.drafted[arm].add(drafted, B)
            self._ema(self.draft_cost, arm.drafter, draft_s / B)

    def forget(self, drafter: str) -> None:
        """Drops what was measured of a drafter's arms: they count as unmeasured, so they are tried again."""
        for arm in self.drafter_arms:
            if arm.drafter == drafter:
                self.accept[arm], self.drafted[arm] = Rate(), Rate()
        self.correction = {k: v for k, v in self.correction.items() if k[1].drafter != drafter}

    def record_forward(self, tokens_in_pass: int, forward_s: float) -> None:
        self.cost.record(tokens_in_pass, forward_s)

    def record_shadow(self, drafter: str, accepted: int, drafted: int) -> None:
        """A draft that was not verified, compared with the tokens the sequence went on to emit: for a
        deterministic draft its matched length is distributed as its accepted length would have been."""
        for arm in self.drafter_arms:
            if arm.drafter == drafter:
                self.accept[arm].add(min(accepted, arm.budget), 1)
                self.drafted[arm].add(min(drafted, arm.budget), 1)
