"""A deterministic stand-in for the engine's step API, for testing the cluster driver without a model.

Token k of a sample is a hash of (prompt, seed, k, weight), its length a hash of (prompt, seed) below prompt[0]:
like the real engine (noise keyed by (seed, position)), a sample's tokens do not depend on where, in which batch
or after which migration it runs. `options` may make a worker hang at a step (fault tests)."""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field

import torch

from tailrl.cluster.cost import StepCost
from tailrl.cluster.workers import WorkerParts, WorkerSpec
from tailrl.engine import SamplingParams
from tailrl.engine.stats import StepRecord


def _h(*parts) -> int:
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little")


@dataclass
class FakeCompletion:
    seq_id: int
    prompt_index: int
    sample_index: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    logprobs: list[float]
    finish_reason: str
    error: str | None = None
    stats: dict = field(default_factory=dict)


@dataclass
class FakeState:
    prompt_index: int
    sample_index: int
    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    seed: int
    max_tokens: int
    params: object = None  # the request's SamplingParams (a partial rollout's driver continues from them)


@dataclass
class FakeSeq:
    seq_id: int
    state: FakeState

    @property
    def output_ids(self) -> list[int]:
        return self.state.output_ids


@dataclass
class StepOut:
    finished: list
    record: StepRecord


class FakeHistory:
    name = "history"

    def __init__(self):
        self.remote: dict[tuple[int, int], list[int]] = {}

    def observe_remote(self, prompt_ids, key, tokens) -> None:
        self.remote.setdefault(tuple(key), []).extend(tokens)

    def state_dict(self) -> dict:
        return {"remote": dict(self.remote)}

    def load_state_dict(self, state) -> None:
        self.remote = dict(state.get("remote", {}))


class FakeSpeculator:
    def __init__(self):
        self.drafters = {"history": FakeHistory()}


class FakeScheduler:
    def __init__(self):
        self.running: list[FakeSeq] = []
        self.waiting: list[FakeSeq] = []


class FakeEngine:
    def __init__(self, max_num_seqs: int = 4, hang_at: int = -1, scheduler_order: bool = False):
        self.scheduler_order = scheduler_order
        self.model = torch.nn.Linear(2, 2, bias=False)
        torch.nn.init.zeros_(self.model.weight)
        self.model.requires_grad_(False)
        self.speculator = FakeSpeculator()
        self.scheduler = FakeScheduler()
        self.max_num_seqs, self.hang_at, self.steps, self._next = max_num_seqs, hang_at, 0, 0
        self.imported_tokens = 0

    def encode(self, prompt) -> list[int]:
        return list(prompt)

    def add_requests(self, prompts, sampling, prompt_indices=None) -> list[int]:
        params = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
        indices = prompt_indices or list(range(len(prompts)))
        ids = []
        for prompt, p, index in zip(prompts, params, indices):
            for j in range(p.n):
                st = FakeState(index, j, list(prompt), [], [], p.seed + j, p.max_tokens, p)
                ids.append(self._queue(st))
        return ids

    def _queue(self, st: FakeState) -> int:
        self.scheduler.waiting.append(FakeSeq(self._next, st))
        self._next += 1
        return self._next - 1

    def has_work(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def step(self) -> StepOut:
        self.steps += 1
        if self.steps == self.hang_at:
            time.sleep(3600)
        sch = self.scheduler
        while sch.waiting and len(sch.running) < self.max_num_seqs:
            sch.running.append(sch.waiting.pop(0))
        w = int(self.model.weight.sum().item())
        finished = []
        for s in sch.running:
            st = s.state
            k = len(st.output_ids)
            st.output_ids.append(_h(tuple(st.prompt_ids), st.seed, k, w) % 50 + 3)
            st.logprobs.append(-(_h("lp", tuple(st.prompt_ids), st.seed, k) % 1000) / 1000)
            length = 1 + _h("len", tuple(st.prompt_ids), st.seed) % st.prompt_ids[0]
            if len(st.output_ids) >= min(length, st.max_tokens):
                reason = "stop" if length <= st.max_tokens else "length"
                finished.append(FakeCompletion(s.seq_id, st.prompt_index, st.sample_index, st.prompt_ids,
                                               list(st.output_ids), "", list(st.logprobs), reason))
        done = {c.seq_id for c in finished}
        for i in sorted((i for i, s in enumerate(sch.running) if s.seq_id in done), reverse=True):
            sch.running[i] = sch.running[-1]  # the real engine's slot compaction: the last sequence fills the hole
            sch.running.pop()
        batch = len(sch.running) + len(done)
        return StepOut(finished, StepRecord("decode", batch=batch, emitted=batch))

    def export(self, ids) -> list[FakeState]:
        """As Engine.export: the states in the order of ids (scheduler_order: in the order they run, the bug the
        driver's label check catches)."""
        seqs = self.scheduler.running + self.scheduler.waiting
        drop = set(ids)
        if self.scheduler_order:
            out = [s.state for s in seqs if s.seq_id in drop]
        else:
            by_id = {s.seq_id: s.state for s in seqs}
            out = [by_id[i] for i in ids]
        self.scheduler.running = [s for s in self.scheduler.running if s.seq_id not in drop]
        self.scheduler.waiting = [s for s in self.scheduler.waiting if s.seq_id not in drop]
        return out

    def import_(self, states) -> list[int]:
        self.imported_tokens += sum(len(st.output_ids) for st in states)
        return [self._queue(st) for st in states]

    def end_rollout(self) -> None:
        pass


def build_fake(spec, index: int) -> WorkerParts:
    """WorkerSpec.factory for the fake engine; options: max_num_seqs, hang (worker index), hang_at (step),
    scheduler_order (export's old, wrong order)."""
    o = spec.options
    hang_at = o.get("hang_at", -1) if o.get("hang") == index else -1
    return WorkerParts(FakeEngine(o.get("max_num_seqs", 4), hang_at, o.get("scheduler_order", False)))


def fake_rollout(prompts, params, max_num_seqs: int = 4) -> dict:
    """The single-engine reference: every sample's (tokens, logprobs, finish reason) by (prompt, sample)."""
    eng = FakeEngine(max_num_seqs)
    ids = eng.add_requests(prompts, params)
    out = {}
    while eng.has_work():
        for c in eng.step().finished:
            out[c.seq_id] = (c.token_ids, c.logprobs, c.finish_reason)
    return [out[i] for i in ids]


# prompt[0] bounds the response length: a few long groups among short ones
PROMPTS = [[40, 1, 2], [3, 5], [6, 7, 8], [60, 9], [4, 4, 4], [5, 1], [30, 2, 2], [2, 3]]
PARAMS = [SamplingParams(n=4, max_tokens=48, seed=100 * i) for i in range(len(PROMPTS))]
CPU = StepCost(base_s=0.03, per_token_s=0.0035)  # compute-bound decode: moving tail sequences pays


def spec(**options):
    return WorkerSpec(factory="tests.cluster_fakes:build_fake", options={"max_num_seqs": 4, **options})
