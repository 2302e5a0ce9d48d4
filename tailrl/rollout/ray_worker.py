"""A rollout worker with the learned drafter (the caller composes drafters, so this lives in rl, not cluster):
the worker's engine drafts with an EAGLE head, and once the worker has nothing left to decode it trains its copy
of the head on the hidden states of the sequences it finished (TLT's spot training on idle rollout capacity).

Between steps the driver averages the workers' trained heads, weighted by the optimizer steps each took
(`merge_heads`), and sends the result to every worker with the policy weights, so all workers draft with one
head. The drafts change speed only: verification keeps the rollout exactly the policy's."""

from __future__ import annotations

import time

import torch

from ..cluster.workers import DTYPES, WorkerParts, WorkerSpec
from ..drafter.compose import make_speculator
from ..drafter.config import DrafterConfig
from ..drafter.eagle import EagleDrafter, load_drafter
from ..drafter.propose import LearnedDrafter
from ..drafter.train import DrafterTrainer
from ..engine import Engine
from ..model import load_model


class DrafterIdle:
    """IdleWork for tailrl.cluster.workers: buffer finished sequences, train the head copy when idle."""

    def __init__(self, head: EagleDrafter, cfg: DrafterConfig, seed: int, train: bool = True):
        self.head, self.cfg, self.enabled = head, cfg, train
        self.trainer = DrafterTrainer(head, cfg, seed=seed)
        self.steps = 0  # optimizer steps since the last state()
        self.rollout = 0

    def observe(self, completions: list) -> None:
        self.trainer.buffer.add_completions(completions, self.rollout)

    def train(self, max_s: float) -> float:
        if not self.enabled:
            return 0.0
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < max_s:
            samples = self.trainer.buffer.sample(self.cfg.batch_tokens, self.trainer.rng, None)
            if not samples:
                break
            if self.trainer.train_step(samples, self.cfg.spot_micro_tokens) is not None:
                self.steps += 1
        return time.perf_counter() - t0 if self.steps else 0.0

    def state(self) -> dict:
        """The trained copy (what the driver merges) and how many steps it took; ends this rollout."""
        out = {**self.trainer.model.trained_state(), "steps": self.steps}
        self.steps = 0
        self.rollout += 1
        return out

    def load(self, state: dict) -> None:
        """The merged head, into the trainer's copy and the engine's head (between rollouts only)."""
        self.trainer.model.load_trained(state)
        self.trainer.publish(self.head)


def build(spec: WorkerSpec, index: int) -> WorkerParts:
    """WorkerSpec.factory: the policy by path, an EAGLE head (options["drafter"]: DrafterConfig fields; its
    weights come from the driver with the first weights) and, with drafter.spot, idle-time training of it."""
    model, tokenizer = load_model(spec.model, device=spec.device, dtype=DTYPES[spec.dtype])
    d = DrafterConfig(**spec.options["drafter"])
    head = load_drafter(d.path, model) if d.path else EagleDrafter(model.config).to(device=model.device, dtype=model.dtype)
    head.bind(model)
    engine = Engine(model, tokenizer, spec.engine, make_speculator(spec.engine.spec, LearnedDrafter(head, d)))
    return WorkerParts(engine, DrafterIdle(head, d, seed=spec.options.get("seed", 0) + index, train=d.spot))


def head_state(head: EagleDrafter) -> dict:
    """The head's trained weights as CPU copies, to send to the workers."""
    return {part: {k: v.detach().cpu().clone() for k, v in sd.items()} for part, sd in head.trained_state().items()}


@torch.no_grad()
def merge_heads(head: EagleDrafter, states: list[dict]) -> int:
    """Averages the workers' trained heads into `head`, weighted by their optimizer steps; returns the steps
    (0: no worker trained, the head is unchanged)."""
    states = [s for s in states if s and s["steps"] > 0]
    total = sum(s["steps"] for s in states)
    if not total:
        return 0
    head.load_trained({part: {k: sum(s[part][k].float() * (s["steps"] / total) for s in states).to(v.dtype)
                              for k, v in sd.items()} for part, sd in head.trained_state().items()})
    return total
