"""The rollout role's interface: what the trainer's loop calls, whatever the backend. Backends: our engine in
process or on Ray workers (engine.py: `EngineRollout`); vLLM (its own module here, when it lands).

A backend owns its engine, its timers, its sleep/wake and the metrics of its last rollout (the long tail's
included: engine/tail.py), so the loop never reaches through it (slime's rollout manager, torchtitan's roles).
Invariant every backend keeps: rollout seeds depend only on (run seed, step, prompt) (`step_seed`), so a resumed
run, N rollout workers and N trainer ranks sample what the one-process run samples from the same weights."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Protocol

import torch

from ..config import RolloutCfg
from ..engine.sampling import SamplingParams
from ..tasks import chat_prompt


def step_seed(seed: int, step: int, prompt: int, gen_round: int = 0) -> int:
    """Rollout seeds depend only on (run seed, step, prompt, and the step's sampling round with dynamic sampling):
    a resumed run samples what the original would."""
    return (seed * 1_000_003 + step) * 1_000_033 + prompt * 997 + gen_round * 2_654_435_761


def step_params(r: RolloutCfg, seed: int, step: int, prompt: int, gen_round: int = 0, greedy: bool = False,
                n: int | None = None) -> SamplingParams:
    """One prompt's sampling in a step, the one place rollout.* becomes SamplingParams: rollout.n samples (n: another
    count) at the step's seed. greedy: temperature 0 with top-k and top-p off (the evaluation), one sample."""
    if greedy:
        return SamplingParams(n=n or 1, max_tokens=r.max_tokens, temperature=0.0, top_p=1.0, top_k=0,
                              seed=step_seed(seed, step, prompt, gen_round))
    return SamplingParams(n=r.n if n is None else n, max_tokens=r.max_tokens, temperature=r.temperature, top_p=r.top_p,
                          top_k=r.top_k, seed=step_seed(seed, step, prompt, gen_round))


@dataclass
class Request:
    """One prompt of a rollout as every backend and the turn loop take it: its token ids, its sampling (params.n
    samples), its conversation (what a tool run's trajectories start from) and its label (the engine's prompt index:
    a partial rollout's group id; None: its place in the batch)."""

    ids: list[int]
    params: SamplingParams
    messages: list[dict] | None = None
    label: int | None = None


def make_requests(examples: list, r: RolloutCfg, seed: int, step: int, gen_round: int = 0, greedy: bool = False,
                  system_prompt: str = "", n: int | None = None) -> list[Request]:
    """A step's requests, one per example (prompt i seeded by step_seed(seed, step, i, gen_round)): built here once
    for every path (single-turn and tools, in process, on workers and on vLLM)."""
    return [Request(list(ex.ids), step_params(r, seed, step, i, gen_round, greedy, n),
                    chat_prompt(ex.prompt, system_prompt)) for i, ex in enumerate(examples)]


def requests_of(prompts: list[list[int]], params: list[SamplingParams], messages: list | None = None,
                labels: list[int] | None = None) -> list[Request]:
    """Requests from parallel lists (callers that hold ids and params already: eval, generate, workers)."""
    return [Request(list(p), q, None if messages is None else messages[i], None if labels is None else labels[i])
            for i, (p, q) in enumerate(zip(prompts, params))]


class StepEngine(Protocol):
    """What the turn loop (turns.py) drives: our `Engine` (engine/engine.py) and vLLM's turns adapter
    (vllm/turns.py). Requests go in, `step()` runs one batch and returns its finished completions and its record;
    the loop never reaches further into an engine than this."""

    tokenizer: object

    def add_requests(self, prompts: list, sampling: SamplingParams | list[SamplingParams] | None = None,
                     prompt_indices: list[int] | None = None) -> list[int]:
        """Queues each prompt's n samples; returns their sequence ids in (prompt, sample) order."""

    def has_work(self) -> bool: ...

    def step(self):
        """One batch: an object with .finished (Completions) and .record (a StepRecord)."""

    def collector(self, ids: list[int]):
        """An engine.stats.Collector of these ids' completions and stats (what a progress line reads)."""

    def unfinished_ids(self) -> list[int]: ...

    def export(self, ids: list[int]) -> list:
        """Takes unfinished sequences out as states `import_` continues exactly (partial rollouts)."""

    def import_(self, states: list) -> list[int]: ...

    def drop_kept(self, ids: list[int]) -> None:
        """Frees K/V parked for these finished sequences (SamplingParams.keep_kv); a no-op where none is parked."""

    @property
    def kept_tokens(self) -> int:
        """Positions resumed requests did not prefill because their K/V was kept (0 where the engine keeps none)."""

    def end_rollout(self, stats=None) -> None: ...


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
