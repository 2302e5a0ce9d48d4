"""Per decode step: speculate or not, with which drafter and how deep, from what was measured on this engine.

Every arm, plain decoding (OFF) among them, is priced the same way, in one place (`goodput`):

    tokens / s of arm (drafter, budget) at B sequences = B * (1 + accepted) / (T(shape) + B * draft_s)
    tokens / s of OFF                                   = B / T(plain shape)

- T is the step-time model (speculative/step_cost.py): seconds of a pass by what it carries (sequences, draft rows,
  weight streams, key reads), least squares over this engine's own steps per batch-size bucket; a term a bucket has
  not measured takes the pooled price, and a draft row never measured costs what a plain step's row does;
- accepted and drafted: tokens per sequence-step the arm's drafts added and cost, measured on its verified steps and
  on shadow drafts (the drafter's proposals scored against what the sequence then emitted), an unmeasured budget
  borrowing the acceptance of its drafter's largest measured smaller budget (a lower bound);
- draft_s: the drafter's seconds per sequence proposal, or for a drafter whose proposal is one batched pass per
  draft level (the self drafter), levels x a level's seconds at this batch size (draft_cost.py);
- what a token is worth (`worth`): acceptance per sequence (SeqAccept), and where no request waits, a token saves
  the marginal row it would have cost later, whole steps only at the acceptance of the sequences the rollout waits
  for.

The arm chosen is the argmax, a drafter arm only where it beats OFF by `margin`. What keeps this honest when a
price is wrong is measurement of the arm not chosen: per bucket, a **probe** runs the other side (OFF while
speculating, the best drafter arm while decoding plainly) every `interval` steps of the bucket; the interval
starts at PROBE_MIN and doubles up to PROBE_MAX each time the choice survives a probe, and falls back to PROBE_MIN
when the choice flips. So where drafts never pay, speculation costs at most 1 step in PROBE_MAX once measured, and
where the prior is wrong either way the measured steps correct T within a few probes (tests/speculative/test_selector.py: a
fake clock). The same model prices the tail (deep drafts where a pass streams the weights whatever its few rows)
and the body (draft rows that open a new product call cost a weight stream). `decision` holds why the last step
chose what it chose (predicted tokens / s of the arm and of OFF): the step records and the metrics carry it. Over
whole rollouts the ledger (ledger.py) checks what the steps' prices cannot: a rollout estimated slower than SD off
makes the next ones decode plainly."""

from __future__ import annotations

import random
from dataclasses import dataclass

from .arms import OFF, Arm, Decision
from .config import SpecConfig
from .draft_cost import DraftCost
from .ledger import Ledger
from .rates import Rate, SeqAccept, critical_factor
from .step_cost import Geometry, Shape, StepTime, batch_bucket

PROBE_MIN, PROBE_MAX = 8, 64  # steps of a bucket between probes of the arm not chosen
# what exploration may cost: a probe or first try runs only while the seconds it is predicted to lose against the
# arm chosen (`_regret`) fit in a credit that every decode step adds this share of its seconds to (at most
# CREDIT_STEPS steps' worth banked). On a first visit probes and tries cost 3-4% of the rollout before.
EXPLORE_SHARE, CREDIT_STEPS = 0.01, 200
# the guard: per bucket, speculative steps' measured tokens / s (each token at what it was worth) over the model's
# plain step for the same sequences; below 1 over GUARD_STEPS (decayed) such steps, the bucket decodes plainly
# whatever the prices say, until probes measure speculation paying again
GUARD_STEPS, GUARD_HALF_LIFE = 3.0, 8.0


@dataclass
class _Probe:
    spec: bool = False  # the side chosen last
    interval: int = PROBE_MIN
    since: int = 0  # steps of the bucket since the other side last ran
    turn: int = 0  # probes made while speculating (which arm the next one runs: _probe_arm)


class Selector:
    margin = 1.03  # a drafter arm must beat plain decoding by this much
    try_cost = 1.15  # a drafter never measured is first tried where its step costs at most this much of a plain one
    far = 0.8  # below this share of plain decoding's goodput, an arm is probed only every PROBE_MAX steps

    def __init__(self, cfg: SpecConfig, drafters: list[str] | None = None, budgets: tuple[int, ...] | None = None):
        """budgets: the arms' draft budgets (default cfg.budgets; the speculator passes them cut to whole query
        blocks where the verifier attends in blocks, speculative/budgets.py:block_budget)."""
        self.cfg = cfg
        drafters = list(cfg.drafters if drafters is None else drafters)
        self.budgets = tuple(cfg.budgets if budgets is None else budgets)
        self.drafter_arms = [Arm(d, b) for d in drafters for b in self.budgets]
        self.arms = ([OFF] if cfg.mode == "auto" else []) + self.drafter_arms
        self.geometry = Geometry()  # the speculator sets the engine's
        self.time = StepTime()
        self.accept = {a: Rate() for a in self.drafter_arms}
        self.drafted = {a: Rate() for a in self.drafter_arms}
        self.draft = DraftCost(drafters)  # what a proposal costs (draft_cost.py; the speculator names `leveled`)
        self.probes: dict[int, _Probe] = {}
        self.credit: float | None = None  # seconds exploration may still lose (EXPLORE_SHARE); None: no step yet
        self.guard: dict[int, Rate] = {}  # bucket -> measured speedup of its speculative steps (GUARD_STEPS)
        self.decision = Decision()
        self.ledger = Ledger()  # the rollouts' own SD-off estimates: a rollout that lost makes the next ones plain
        self.rng = random.Random(cfg.seed)
        self._memo: tuple[list[int], dict] | None = None  # (contexts, arm -> step_s) while `choose` runs

    # ---- pricing ----------------------------------------------------------------------------------------------

    def acceptance(self, arm: Arm) -> tuple[float, float] | None:
        """(accepted, drafted) tokens per sequence-step of a drafter arm; None: nothing of its drafter measured."""
        if self.accept[arm].weight > 0:
            return self.accept[arm].mean(0.0), self.drafted[arm].mean(arm.budget)
        smaller = [a for a in self.drafter_arms if a.drafter == arm.drafter and a.budget < arm.budget
                   and self.accept[a].weight > 0]
        if not smaller:
            return None
        return self.accept[max(smaller, key=lambda a: a.budget)].mean(0.0), float(arm.budget)

    def plain_step_s(self, contexts: list[int]) -> float | None:
        """Predicted seconds of a plain decode step over sequences holding `contexts` keys."""
        return self.time.seconds(self.geometry.uniform(contexts, 0))

    def worth(self, contexts: list[int], factors: list[float] | None = None, remaining: list[int | None] | None = None,
              queued: bool = False) -> float:
        """What an accepted token of these sequences is worth, in the arms' mean acceptance per sequence (1: each
        the plain step's share T / B, what it is worth where every sequence gains alike or finished sequences
        make room for waiting ones: `queued`).

        Where no request waits, a rollout's wall is its steps until the last sequence ends: a token a sequence
        gains early saves the row it would have cost later (m = T(B) - T(B - 1), the marginal row), and only the
        sequences the rollout waits for save whole steps (F = T - B m, the part of a step no row pays for). So
        a token is worth m, and F more at the acceptance of the critical sequences (`critical_factor`). On a CPU
        below a call's 32 rows a step costs about the same for 4 sequences as for 32: speculation that finished 28
        easy sequences early left the 4 hard ones 40 steps of almost the same price and bought nothing
        (benchmarks/RESULTS.md section 25)."""
        B = len(contexts)
        f = factors if factors is not None and len(factors) == B else [1.0] * B
        mean = sum(f) / max(B, 1)
        if queued or B < 2 or remaining is None or len(remaining) != B:
            return mean
        t, t1 = self.plain_step_s(contexts), self.plain_step_s(contexts[:-1])
        if not t or t1 is None:
            return mean
        share = t / B
        m = min(max(t - t1, 0.0), share)
        return (m * sum(f) + (t - B * m) * critical_factor(f, remaining)) / (share * B)

    def goodput(self, arm: Arm, contexts: list[int], hardness: float = 1.0) -> float | None:
        """Predicted tokens per second of the arm over these sequences (None: not predictable yet). hardness: how
        much of the arm's measured acceptance these very sequences get (the mean of their SeqAccept.factor)."""
        B = len(contexts)
        if arm == OFF:
            t = self.plain_step_s(contexts)
            return B / t if t else None
        est = self.acceptance(arm)
        if est is None:
            return None
        t = self.step_s(arm, contexts)
        return B * (1 + est[0] * hardness) / t if t else None

    def step_s(self, arm: Arm, contexts: list[int]) -> float | None:
        """Predicted seconds of a step of the arm over these sequences, drafting included (an arm never measured:
        its full budget). Within `choose` each arm is priced once (`_memo`)."""
        memo = self._memo
        if memo is not None and memo[0] is contexts:
            if arm not in memo[1]:
                memo[1][arm] = self._step_s(arm, contexts)
            return memo[1][arm]
        return self._step_s(arm, contexts)

    def _step_s(self, arm: Arm, contexts: list[int]) -> float | None:
        if arm == OFF:
            return self.plain_step_s(contexts)
        est = self.acceptance(arm)
        drafted = est[1] if est is not None else arm.budget
        t = self.time.seconds(self.geometry.uniform(contexts, min(drafted, arm.budget)))
        return t + self.draft.seconds(arm, len(contexts)) if t else None

    def _regret(self, arm: Arm, chosen: Arm, scores: dict, contexts: list[int]) -> float:
        """Seconds a step of `arm` is predicted to lose against one of `chosen`: its seconds less what the chosen
        arm would take for the tokens it yields (unpriced acceptance: it yields what a plain step does)."""
        t = self.step_s(arm, contexts)
        if not t:
            return 0.0
        s, c = scores.get(arm), scores.get(chosen)
        if not c or c == float("inf"):
            return 0.0
        if s is None or s == float("inf"):
            return max(t - len(contexts) / c, 0.0)
        return max(t * (1 - s / c), 0.0)

    def free_depth(self, contexts: list[int], slack: float = 0.1) -> int:
        """The deepest budget whose draft rows the model prices at most `slack` of a plain step (the tail on a CPU,
        where a pass streams the weights whatever its few rows); 0 where none or not measured yet."""
        plain = self.plain_step_s(contexts)
        if not plain or not self.time.measured(len(contexts)):
            return 0
        ok = [b for b in self.budgets
              if self.time.seconds(self.geometry.uniform(contexts, b)) <= (1 + slack) * plain]
        return max(ok, default=0)

    # ---- choosing ---------------------------------------------------------------------------------------------

    def choose(self, B: int, contexts: list[int] | None = None, factors: list[float] | None = None,
               remaining: list[int | None] | None = None, queued: bool = False) -> Arm:
        """The arm for a decode step of B sequences holding `contexts` keys (default: short contexts). factors:
        per sequence, its share of the drafters' acceptance (SeqAccept); remaining, queued: `worth`'s. Arms are
        ranked by goodput at what their tokens are worth to the rollout's end; the decision reports the arm's
        and OFF's plain predicted tokens / s. While the ledger rests (ledger.py), OFF, priced at nothing."""
        if self.ledger.resting and self.cfg.mode == "auto":
            self.decision = Decision(OFF, far=True)
            return OFF
        contexts = list(contexts) if contexts is not None else [1] * B
        self._memo = (contexts, {})
        try:
            return self._choose(B, contexts, factors, remaining, queued)
        finally:
            self._memo = None

    def _choose(self, B: int, contexts: list[int], factors, remaining, queued: bool) -> Arm:
        mean = sum(factors) / B if factors is not None and len(factors) == B and B else 1.0
        if len(self.arms) == 1:
            self.decision = Decision(self.arms[0], self.goodput(self.arms[0], contexts, mean))
            return self.arms[0]
        worth = self.worth(contexts, factors, remaining, queued)
        scores = {a: self.goodput(a, contexts, worth) for a in self.arms}
        off = scores.get(OFF)
        untried = [a for a in self.drafter_arms if scores[a] is None]
        spec = [a for a in self.drafter_arms if scores[a] is not None]
        best = max(spec, key=lambda a: scores[a], default=None)
        trial = min(untried, key=lambda a: a.budget, default=None)
        if trial is not None and off is not None and self._cheap(trial, contexts) and (
                OFF not in scores or self._spend(self._regret(trial, best or OFF, scores, contexts))):
            best = trial  # a drafter never measured: its smallest budget is tried first, where that costs little
            scores[best] = float("inf")
        if OFF not in scores:  # a fixed drafter mode
            arm = best if best is not None else self.drafter_arms[0]
            self.decision = Decision(arm, scores.get(arm))
            return arm
        if off is None or best is None:  # nothing measured yet: plain decoding prices the bucket first
            self.decision = Decision(OFF, off, off)
            return OFF
        want_spec = scores[best] >= self.margin * off and not self.vetoed(B)
        if want_spec and self.cfg.epsilon and self.rng.random() < self.cfg.epsilon:
            near = [a for a in spec if scores[a] >= 0.85 * scores[best]]  # budgets near the best, measured too
            best = self.rng.choice(near) if near else best
        # a probe of an arm predicted far below plain decoding waits PROBE_MAX steps: it mostly costs
        chosen = best if want_spec else OFF
        other = self._probe_arm(B, best, peek=True) if want_spec else best
        far = not want_spec and scores[best] < self.far * off
        probe = self._probe(B, want_spec, far=far, regret=self._regret(other, chosen, scores, contexts))
        arm = (self._probe_arm(B, best) if want_spec else best) if probe else chosen
        predicted = self.goodput(arm, contexts, mean) if arm != OFF and scores[arm] != float("inf") else scores[arm]
        self.decision = Decision(arm, predicted, off, probe, self.probes[batch_bucket(B)].interval / 2 if probe else 1.0,
                                 worth, far or self.vetoed(B))
        return arm

    def vetoed(self, B: int) -> bool:
        """Whether the bucket's speculative steps measured slower than its plain ones (the guard)."""
        g = self.guard.get(batch_bucket(B))
        return g is not None and g.weight >= GUARD_STEPS and g.mean(1.0) < 1.0

    def _probe_arm(self, B: int, best: Arm, peek: bool = False) -> Arm:
        """While speculating, probes take turns: OFF every other one, between them the budgets next to the best's
        and the other drafters' best measured arms (a price no step measures is never corrected otherwise).
        peek: the arm the next probe would run, without taking the turn."""
        p = self.probes.get(batch_bucket(B)) or _Probe()
        turn = p.turn + 1
        if not peek:
            p.turn = turn
        if turn % 2:
            return OFF
        i = self.budgets.index(best.budget)
        near = [Arm(best.drafter, self.budgets[j]) for j in (i - 1, i + 1) if 0 <= j < len(self.budgets)]
        others = [a for a in self.drafter_arms if a.drafter != best.drafter and a.budget == best.budget]
        options = near + others
        return options[(turn // 2) % len(options)] if options else OFF

    def _cheap(self, arm: Arm, contexts: list[int]) -> bool:
        """Whether a step of the arm is predicted to cost at most TRY_COST of a plain one (drafts not measured
        yet cost a plain row each: speculative/step_cost.py): where a first try is cheap, the tail on a CPU."""
        plain = self.plain_step_s(contexts)
        t = self.time.seconds(self.geometry.uniform(contexts, arm.budget))
        return bool(plain) and t is not None and t <= self.try_cost * plain

    def _probe(self, B: int, want_spec: bool, far: bool = False, regret: float = 0.0) -> bool:
        """Whether this step of B sequences runs the side not chosen (module docstring: probes); far: the side
        not chosen is predicted far below, and is probed only every PROBE_MAX steps; regret: the seconds the probe
        is predicted to lose: a probe that is due waits until the exploration credit covers it."""
        p = self.probes.setdefault(batch_bucket(B), _Probe(want_spec))
        if want_spec != p.spec:  # the choice flipped: watch it closely again
            p.spec, p.interval, p.since = want_spec, PROBE_MIN, 0
            return False
        p.since += 1
        if p.since < (PROBE_MAX if far else p.interval) or not self._spend(regret):
            return False
        p.since = 0
        p.interval = min(2 * p.interval, PROBE_MAX)
        return True

    def _spend(self, regret: float) -> bool:
        """Takes `regret` seconds from the exploration credit if it holds them."""
        if regret > (self.credit or 0.0):
            return False
        self.credit -= regret
        return True

    # ---- feedback ---------------------------------------------------------------------------------------------

    def record(self, arm: Arm, shape: Shape, step_s: float, emitted: int, drafted: int, draft_s: float,
               levels: int = 0) -> None:
        """One decode step as it ran: the pass's shape, its seconds (drafting included), the tokens it emitted, the
        draft rows of the arm it verified, and (a drafter priced per level) the draft levels its proposal ran."""
        B = shape.seqs
        cap = CREDIT_STEPS * EXPLORE_SHARE * step_s
        # the first step banks half the cap: a short run (a few rollouts) still tries its drafters once
        self.credit = min(self.credit + EXPLORE_SHARE * step_s, cap) if self.credit is not None else cap / 2
        weight = self.decision.weight if self.decision.arm == arm else 1.0
        self.time.record(shape, max(step_s - draft_s, 0.0), weight)
        if arm != OFF:
            plain = self.time.seconds(shape.plain())
            if plain and step_s > 0:
                worth = self.decision.worth if self.decision.arm == arm else 1.0
                g = self.guard.setdefault(batch_bucket(B), Rate(GUARD_HALF_LIFE))
                g.add((B + (emitted - B) * worth) * plain / (B * step_s), 1)
            self.accept[arm].add(emitted - B, B)
            self.drafted[arm].add(drafted, B)
            self.draft.record(arm, B, draft_s, levels)

    def record_shadow(self, drafter: str, accepted: int, drafted: int) -> None:
        """A draft that was not verified, compared with the tokens the sequence went on to emit: for a
        deterministic draft its matched length is distributed as its accepted length would have been."""
        for arm in self.drafter_arms:
            if arm.drafter == drafter:
                self.accept[arm].add(min(accepted, arm.budget), 1)
                self.drafted[arm].add(min(drafted, arm.budget), 1)

    def forget(self, drafter: str) -> None:
        """Drops what was measured of a drafter's acceptance: its arms count as unmeasured and are tried again."""
        for arm in self.drafter_arms:
            if arm.drafter == drafter:
                self.accept[arm], self.drafted[arm] = Rate(), Rate()

    def end_rollout(self, speedup: float | None = None) -> None:
        """A rollout ended (speedup: its SD-off estimate, for the ledger). The next has other drafts (this epoch's
        responses are history now) under other weights: acceptance measured counts half, and every bucket probes
        closely again (above SHADOW_MAX_BATCH no shadow measures a drafter: one that starts paying in the next
        epoch was found only by probes 64 steps apart)."""
        self.time.end_rollout()
        self.ledger.end_rollout(speedup)
        for rates in (self.accept, self.drafted, self.guard):
            for r in rates.values():
                r.total *= 0.5
                r.weight *= 0.5
        for p in self.probes.values():
            p.interval, p.since = PROBE_MIN, 0
