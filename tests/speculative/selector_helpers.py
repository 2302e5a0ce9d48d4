"""The selector's fake clock: worlds whose step seconds and acceptance are known (tests/speculative/test_selector.py says what
they prove), and the loop that runs a selector in one."""

from __future__ import annotations

import random
from dataclasses import dataclass

from tailrl.speculative.config import SpecConfig
from tailrl.speculative.selector import OFF, Selector
from tailrl.speculative.step_cost import Geometry

CALL, TILE, ITEM = 32, 16, 16
BUDGETS = (1, 2, 4, 8, 15)


@dataclass
class World:
    stream_s: float = 0.008  # one pass over the weights
    fixed_s: float = 0.006  # a step's host work
    row_s: float = 0.0002  # a row's arithmetic and sampling
    seq_s: float = 0.0001
    key_s: float = 2e-7  # a (row, key) pair of attention
    accept: float = 0.7
    noise: float = 0.03

    def seconds(self, contexts: list[int], depth: int, rng: random.Random | None = None) -> float:
        B = len(contexts)
        rows = B * (1 + depth)
        padded = -(-rows // TILE) * TILE
        t = (self.fixed_s + self.seq_s * B + self.stream_s * -(-padded // CALL) + self.row_s * rows
             + self.key_s * sum(c * (1 + depth) for c in contexts))
        return t * (1 + rng.gauss(0, self.noise)) if rng else t

    def accepted(self, depth: int) -> float:
        return sum(self.accept**k for k in range(1, depth + 1))

    def best(self, contexts: list[int]) -> tuple[int, dict[int, float]]:
        """The right depth (0 = plain decoding) and every depth's tokens / s, exactly."""
        B = len(contexts)
        rates = {d: B * (1 + self.accepted(d)) / self.seconds(contexts, d) for d in (0, *BUDGETS)}
        return max(rates, key=rates.get), rates


def make_selector() -> Selector:
    sel = Selector(SpecConfig(mode="auto", budgets=BUDGETS, epsilon=0.0), ["history"])
    sel.geometry = Geometry(ITEM, [(CALL, 1.0)], TILE)
    return sel


def run(sel: Selector, world: World, B: int, steps: int, seed: int = 0, ctx: int = 200) -> list[tuple[int, float, float]]:
    """Steps of B sequences at contexts that grow as they decode; per step (depth run, seconds, tokens emitted).
    Shadow drafts measure the drafter on plain steps as the speculator's do (at most 32 sequences, 8 a step)."""
    rng = random.Random(seed)
    contexts = [ctx + 7 * i for i in range(B)]
    out = []
    for _ in range(steps):
        arm = sel.choose(B, contexts)
        d = arm.budget if arm != OFF else 0
        t = world.seconds(contexts, d, rng)
        chains = [next((k for k in range(d) if rng.random() >= world.accept), d) for _ in range(B)]
        emitted = B + sum(chains)
        sel.record(arm, sel.geometry.shape(contexts, [d] * B), t, emitted, B * d, 0.0)
        if arm == OFF and B <= 32:
            for _ in range(min(B, 8)):
                sel.record_shadow("history", next((k for k in range(15) if rng.random() >= world.accept), 15), 15)
        contexts = [c + 1 + k for c, k in zip(contexts, chains)]
        out.append((d, t, emitted))
    return out


def rate(steps) -> float:
    return sum(e for _, _, e in steps) / sum(t for _, t, _ in steps)


def off_rate(world: World, B: int, steps: int, seed: int = 0, ctx: int = 200) -> float:
    """Plain decoding's tokens / s over as many tokens (the same growth of contexts, one token a step)."""
    rng = random.Random(seed)
    contexts = [ctx + 7 * i for i in range(B)]
    total = 0.0
    for _ in range(steps):
        total += world.seconds(contexts, 0, rng)
        contexts = [c + 1 for c in contexts]
    return B * steps / total


def right_share(sel: Selector, world: World, B: int, steps, ctx: int = 200, tol: float = 0.03) -> float:
    """Share of steps that ran a depth within `tol` of the best depth's tokens / s, at the contexts they ran at
    (approximated by the start's: the test worlds' best depth does not change over a run)."""
    _, rates = world.best([ctx + 7 * i for i in range(B)])
    top = max(rates.values())
    return sum(rates[d] >= (1 - tol) * top for d, _, _ in steps) / len(steps)


EXPENSIVE = World(row_s=0.02, stream_s=0.02, accept=0.3)  # a draft row costs as much as a sequence's step
TAIL_ONLY = World(accept=0.5, row_s=0.0008)  # drafts pay where a pass's rows fit in its weight streams


def trained(world: World, sizes=(16, 12, 9, 14, 16), steps: int = 60) -> Selector:
    """A selector that has measured this world at these batch sizes in turn (as a rollout's batch shrinks): its
    steps, plain and speculative, and acceptance."""
    sel = make_selector()
    for i, B in enumerate(sizes):
        run(sel, world, B, steps, seed=i)
    return sel
