"""The rollout role's interface: what the trainer's loop calls, whatever the backend. Backends: our engine in
process or on Ray workers (engine.py: `EngineRollout`); vLLM (its own module here, when it lands).

A backend owns its engine, its timers, its sleep/wake and the metrics of its last rollout (the long tail's
included: engine/tail.py), so the loop never reaches through it (slime's rollout manager, torchtitan's roles).
Invariant every backend keeps: rollout seeds depend only on (run seed, step, prompt) (`step_seed`), so a resumed
run, N rollout workers and N trainer ranks sample what the one-process run samples from the same weights."""

from __future__ import annotations

from typing import Callable, Iterable, Protocol

import torch


def step_seed(seed: int, step: int, prompt: int, gen_round: int = 0) -> int:
    """Rollout seeds depend only on (run seed, step, prompt, and the step's sampling round with dynamic sampling):
    a resumed run samples what the original would."""
    return (seed * 1_000_003 + step) * 1_000_033 + prompt * 997 + gen_round * 2_654_435_761


class Rollout(Protocol):
    version: str  # what samples, for the run's header ("tailrl engine", "vLLM 0.32.0")
    spec_note: str  # what speculates, for the run's header ("auto + learned drafter, 2 Ray workers")
    # a sequence's tokens do not depend on the batch it ran in (engine/invariant.py): speculation changes none
    batch_invariant: bool
    # True: the backend holds its own copy of the weights and is sent them after every update (vLLM); False: at
    # world size 1 our engine runs the actor's module (the policy or its bf16 compute copy), updated in place
    streams_policy: bool
    head: object | None  # the learned drafter's head, checkpointed with the policy (None: no learned drafter)
    drafter_trainer: object | None  # its online trainer, whose state checkpoints keep (None: none)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the rollout's model holds (streamed weights are cast to it before they travel)."""

    def encode(self, prompt) -> list[int]:
        """A prompt (text or chat messages) as the token ids the rollout will be given."""

    def generate(self, examples: list, step: int, weights: Callable[[], dict], last_step_s: float,
                 gen_round: int = 0) -> list:
        """One step's samples, rollout.n per prompt, in (prompt, sample) order: Completions (token ids, text,
        per-token logprobs, finish reason). weights(): the policy's tensors by name, for a backend that must load
        them before it samples (Ray workers); last_step_s: the previous step's time (the spot trainer's share);
        gen_round: the step's sampling round (dynamic sampling draws more rounds), part of the seeds."""

    def greedy(self, examples: list) -> list:
        """Greedy completions of examples (the evaluation), rejected prompts left out."""

    def metrics(self) -> dict:
        """The last `generate`'s metrics under their metrics.jsonl names: rollout/* (the tail's included),
        spec/*, perf/gen_tokens_per_s and, with workers, cluster/* and timing_s/sync (their share of the sync)."""

    def progress(self) -> tuple[int, int]:
        """(tokens generated so far in the rollout running now, sequences running or waiting): the console's line."""

    def load_policy(self, policy: torch.nn.Module) -> int:
        """The policy's weights from a module in this process; returns the bytes copied."""

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Streamed weights, (name, tensor) pairs, each loaded as it arrives; returns the bytes received."""

    def drafter_sync(self) -> dict:
        """After the weights: the learned drafter follows the new policy; returns the drafter/* metrics."""

    def sleep(self) -> None:
        """Frees what the update needs on a shared device (KV cache, graphs); `wake` takes it back."""

    def wake(self) -> None: ...

    def state(self) -> dict:
        """What checkpoints keep of the rollout (the history index, the drafter trainer's state)."""

    def load_state(self, state: dict, drafter) -> None:
        """state: a checkpoint's trainer state; drafter: its saved head (or None)."""

    def close(self) -> None: ...
