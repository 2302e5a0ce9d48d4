"""A rollout worker: one engine driven in rounds by the driver (`rollout.py`), as a Ray actor or in process.

Each round the worker runs engine steps for about `max_s` seconds and returns what finished and the tokens its
running sequences emitted since the last round (the driver forwards those to the workers that hold the same
groups' other samples, Seer's group drafting). Between rounds the driver may `export` sequences from it or
`import_` sequences into it (tail migration). The worker never decides placement; it only runs what it is given.

Invariant: a worker emits for a sequence exactly the tokens any other engine would (noise keyed by (seed,
position)); workers differ in speed only, which is why a dead worker's samples can simply be re-run elsewhere."""

from __future__ import annotations

import importlib
import os
import time
from dataclasses import dataclass, field
from typing import Protocol

import torch

from ..engine import Engine, EngineConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class IdleWork(Protocol):
    """Work for a worker with nothing left to decode (TLT: drafter training on buffered hidden states)."""

    def observe(self, completions: list) -> None: ...

    def train(self, max_s: float) -> float: ...  # seconds spent

    def state(self) -> dict: ...  # what the driver merges between steps

    def load(self, state: dict) -> None: ...  # the merged result, back from the driver


@dataclass
class WorkerParts:
    engine: object  # tailrl.engine.Engine, or anything with its step API
    idle: IdleWork | None = None


@dataclass
class WorkerSpec:
    """What each worker builds. The model is loaded by path, then every step's weights arrive by name."""

    model: str = ""
    engine: EngineConfig = field(default_factory=EngineConfig)
    dtype: str = "float32"
    device: str | None = None  # None: cuda if the worker has a GPU, else cpu
    threads: int = 1
    factory: str = ""  # "module:function", function(spec, index) -> WorkerParts (the caller composes drafters)
    options: dict = field(default_factory=dict)  # free-form settings for the factory


def build(spec: WorkerSpec, index: int = 0) -> WorkerParts:
    if spec.factory:
        module, fn = spec.factory.split(":")
        return getattr(importlib.import_module(module), fn)(spec, index)
    from ..model import load_model

    model, tokenizer = load_model(spec.model, device=spec.device, dtype=DTYPES[spec.dtype])
    return WorkerParts(Engine(model, tokenizer, spec.engine))


@dataclass
class RoundOut:
    finished: list  # Completions that finished this round
    tokens: dict[int, list[int]]  # running sequence id -> tokens emitted since the last round
    running: int
    waiting: int
    busy_s: float  # seconds spent in engine steps this round
    steps: int
    idle_s: float = 0.0  # seconds spent on idle work (drafter training)


class RolloutWorker:
    def __init__(self, spec: WorkerSpec, index: int = 0):
        torch.set_num_threads(max(spec.threads, 1))
        self.index = index
        parts = build(spec, index)
        self.engine, self.idle = parts.engine, parts.idle
        self.reported: dict[int, int] = {}  # running sequence id -> tokens already reported
        self.records: list = []  # this rollout's StepRecords (summed by the driver)
        self.busy_s = 0.0
        self.held = None  # run_held's state between calls

    def ping(self) -> int:
        return self.index

    def load_weights(self, weights: dict, idle_state: dict | None = None) -> float:
        """New policy weights by parameter name (names the engine's model lacks are ignored), and the driver's
        merge of the idle work (the drafter head) when there is one."""
        t = time.perf_counter()
        params = dict(self.engine.model.state_dict())
        with torch.no_grad():
            for name, src in weights.items():
                dst = params.get(name)
                if dst is not None:
                    dst.copy_(src.to(dtype=dst.dtype, device=dst.device))
        if idle_state is not None and self.idle is not None:
            self.idle.load(idle_state)
        return time.perf_counter() - t

    def add(self, prompts: list, sampling: list, prompt_indices: list[int]) -> tuple[list[int], list[list[int]]]:
        """Queues the requests; returns their sequence ids and each prompt's token ids."""
        ids = self.engine.add_requests(prompts, sampling, prompt_indices)
        self.reported.update((i, 0) for i in ids)
        return ids, [self.engine.encode(p) for p in prompts]

    def run_round(self, max_s: float, remote: list = (), max_steps: int = 1_000_000) -> RoundOut:
        """Siblings' tokens from other workers first (`observe_remote`), then engine steps for about max_s."""
        if remote:
            self.observe_remote(remote)
        t0 = time.perf_counter()
        finished, steps, busy = [], 0, 0.0
        while self.engine.has_work() and steps < max_steps and time.perf_counter() - t0 < max_s:
            ts = time.perf_counter()
            out = self.engine.step()
            busy += time.perf_counter() - ts
            self.records.append(out.record)
            finished += out.finished
            steps += 1
        for c in finished:
            self.reported.pop(c.seq_id, None)
        tokens = {}
        for s in self.engine.scheduler.running:  # the engine's running sequences: id and output so far
            done = self.reported.get(s.seq_id, 0)
            if len(s.output_ids) > done:
                tokens[s.seq_id] = list(s.output_ids[done:])
                self.reported[s.seq_id] = len(s.output_ids)
        if self.idle is not None and finished:
            self.idle.observe(finished)
        self.busy_s += busy
        return RoundOut(finished, tokens, self.engine.num_running, self.engine.num_waiting, busy, steps)

    def idle_work(self, max_s: float) -> RoundOut:
        """Nothing to decode: spend about max_s on idle work (drafter training), if the worker has any."""
        spent = self.idle.train(max_s) if self.idle is not None else 0.0
        return RoundOut([], {}, self.engine.num_running, self.engine.num_waiting, 0.0, 0, spent)

    def run(self, fn, *args):
        """fn(engine, *args) on this worker's engine, fn a function the caller hands over (pickled by reference to
        its module, never named by string): work the layers above drive themselves (rollout/remote.py: the turn
        loop, tools and all, for the trajectories placed here)."""
        return fn(self.engine, *args)

    def run_held(self, fn, *args):
        """fn(engine, held, *args) -> (held, result), for work the driver spreads over several calls: `held` is what
        it keeps on this worker between them (rollout/remote_partial.py: a partial rollout's trajectories in flight,
        their turn loop and tool pool); a restarted worker holds nothing. Returns the result."""
        self.held, out = fn(self.engine, self.held, *args)
        return out

    def export(self, ids: list[int]) -> list:
        with torch.inference_mode():  # removing a running sequence moves KV rows of the engine's cache
            states = self.engine.export(ids)
        for i in ids:
            self.reported.pop(i, None)
        return states

    def import_(self, states: list) -> list[int]:
        with torch.inference_mode():
            ids = self.engine.import_(states)
        self.reported.update((i, len(st.output_ids)) for i, st in zip(ids, states))
        return ids

    def observe_remote(self, items: list[tuple[list[int], tuple[int, int], list[int]]]) -> None:
        """Siblings' tokens from other workers into this worker's history drafter (no-op without one)."""
        history = self._history()
        if history is not None:
            for prompt_ids, key, tokens in items:
                history.observe_remote(prompt_ids, key, tokens)

    def end_rollout(self) -> dict:
        """Ends this RL step's rollout: the history drafter commits its epoch. Returns the step's records."""
        self.engine.end_rollout()
        out = {"records": self.records, "busy_s": self.busy_s,
               "idle_state": self.idle.state() if self.idle is not None else None}
        self.records, self.busy_s, self.reported = [], 0.0, {}
        return out

    def history_state(self) -> dict | None:
        h = self._history()
        return h.state_dict() if h is not None else None

    def load_history(self, state: dict) -> None:
        h = self._history()
        if h is not None and state is not None:
            h.load_state_dict(state)

    def _history(self):
        spec = self.engine.speculator
        return spec.drafters.get("history") if spec is not None else None


def start_ray(address: str = "", num_cpus: int | None = None) -> None:
    """`address` "": a local Ray on this machine; "auto" or "host:port": join an existing cluster."""
    import ray

    if ray.is_initialized():
        return
    kwargs = {"include_dashboard": False, "log_to_driver": True, "configure_logging": False}
    if address:
        ray.init(address=address, **kwargs)
    else:
        # Ray starts workers at niceness 15 (background work); rollout workers are the step's critical path
        os.environ.setdefault("RAY_worker_niceness", "0")
        ray.init(num_cpus=num_cpus, **kwargs)


def spawn(spec: WorkerSpec, index: int, gpus: float = 0.0):
    """A RolloutWorker actor holding `spec.threads` CPUs, or one GPU where the cluster has GPUs."""
    import ray

    actor = ray.remote(RolloutWorker).options(num_cpus=spec.threads if not gpus else 0, num_gpus=gpus,
                                             max_concurrency=1, max_restarts=0)
    return actor.remote(spec, index)
