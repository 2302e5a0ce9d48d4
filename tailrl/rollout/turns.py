"""The one turn loop: it drives a `StepEngine` (base.py: our engine, or vLLM's through vllm/turns.py) over a
rollout's requests, single-turn (no tools: a request is one turn) or multi-turn (tool_turns.py: a trajectory that
stops at a tool call leaves the batch while its tool runs in the pool, and comes back as a new request of its ids
so far + the observation while everything else keeps decoding).

No lock-step (ROLL Flash arXiv:2510.11345, Heddle arXiv:2603.28101; TRL's GRPOTrainer waits for every row's
tools, then generates all again): the loop steps the engine whenever it has work and re-submits each trajectory the
moment its tool answers; it blocks on the pool only when nothing is left to decode.

Turn 0 is `add_requests(prompts, params)` for every caller, single-turn or not (verl's single-turn agent loop is
its multi-turn loop with no tools), so moving a path onto this loop leaves its tokens as they were. The hooks are
the callers': on_step(out) is told of each engine step (the spot lender), done(finished) ends a partial rollout
early, its unfinished sequences exported as states (rollout/partial.py); with tools its unfinished trajectories
are carried mid-turn or after a call's observation (rollout/tool_partial.py)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import NamedTuple

from ..config.agent import AgentConfig
from ..engine import Completions
from .base import Request, StepEngine
from .tool_turns import ToolTurns


class TurnsOut(NamedTuple):
    completions: Completions  # single-turn: one per sample in (prompt, sample) order (with done: as they finished);
    #                           with tools: one per trajectory, in (prompt, sample) order; .stats: the run's stats
    records: list  # the engine's step records (the tail's metrics, engine/tail.py)
    metrics: dict  # agent/* with tools, else {}
    left: list  # the states exported when done said stop (partial rollouts), else []


@dataclass
class TurnRun:
    """One run of the loop between its calls (`start`, `advance`, `finish`): a Ray worker drives its share of a
    partial rollout in rounds through these (rollout/remote_partial.py), `run` in one go."""

    engine: StepEngine
    col: object  # the engine's Collector of the run's stats
    t0: float
    kept0: int  # the engine's kept_tokens when the run began
    records: list = field(default_factory=list)
    left: list = field(default_factory=list)  # single-turn: the states exported at the stop
    stopped: bool = False


class TurnLoop:
    def __init__(self, cfg: AgentConfig | None = None, tokenizer=None, tools: dict | None = None):
        """cfg: agent.*; with no tools (or None) every request is one turn. tools: loaded tools by name (None: load
        cfg.tools)."""
        self.turns = ToolTurns(cfg, tokenizer, tools) if cfg is not None and cfg.enabled else None

    @property
    def last(self) -> list:
        """The last run's trajectories (tools only)."""
        return self.turns.last if self.turns is not None else []

    def encode_prompt(self, messages: list[dict]) -> list[int]:
        """A prompt's ids as the format shows tools (hermes: the schemas through the chat template)."""
        return self.turns.encode_prompt(messages)

    def close(self) -> None:
        if self.turns is not None:
            self.turns.close()

    def run(self, engine: StepEngine, requests: list[Request], on_step=None, done=None, states: list | None = None,
            lock_step: bool = False, messages: list | None = None, limit=None) -> TurnsOut:
        """Runs every request's params.n samples to their end (or until done(finished) returns True; then the rest
        are exported). states: exported sequences to continue first (a partial rollout's carried responses).
        lock_step: the baseline of benchmarks/agent.py (TRL's loop): no trajectory resumes before every turn in
        flight has ended and every tool has answered. With tools, done is told of trajectories as they end, states
        are carried trajectories (rollout/tool_partial.py) whose prompts' chat messages are `messages`, and once
        done says stop each trajectory keeps limit((label, sample)) drawn tokens (None: all; Horizon.limit)."""
        run = self.start(engine, requests, states, messages)
        self.advance(run, on_step, done, lock_step)
        return self.finish(run, done is not None, limit)

    def start(self, engine: StepEngine, requests: list[Request], states: list | None = None,
              messages: list | None = None) -> TurnRun:
        """A run begins: `states` continue (re-enter) first, then the requests' turn 0 goes in."""
        run = TurnRun(engine, None, time.perf_counter(), engine.kept_tokens)
        if self.turns is not None:
            self.turns.reset()
        run.col = engine.collector(self.add(run, requests, states, messages))
        return run

    def add(self, run: TurnRun, requests: list[Request], states: list | None = None,
            messages: list | None = None) -> list[int]:
        """More work for a run under way (a failed Ray worker's trajectories, re-run here): as `start` takes them.
        Returns their sequence ids."""
        engine, tt = run.engine, self.turns
        params = [q.params for q in requests]
        if tt is not None:
            params = tt.first_params(params)
            ids = tt.carry_in(engine, list(states or []), list(messages or []))
        else:
            ids = engine.import_(list(states)) if states is not None else []
        labels = None if all(q.label is None for q in requests) else \
            [i if q.label is None else q.label for i, q in enumerate(requests)]
        new = engine.add_requests([q.ids for q in requests], params, labels)
        if tt is not None:
            tt.begin(requests, params, new, run.t0)
        return ids + new

    def has_work(self, run: TurnRun) -> bool:
        return not run.stopped and (run.engine.has_work() or (self.turns is not None and bool(self.turns.pending)))

    def advance(self, run: TurnRun, on_step=None, done=None, lock_step: bool = False, steps: int | None = None,
                seconds: float | None = None) -> list:
        """Steps the loop until done(finished) says stop, no work is left, or (a worker's round) `steps` engine
        steps or `seconds` have passed. Returns the trajectories (Completions) that ended meanwhile (tools only)."""
        engine, tt = run.engine, self.turns
        ended_all, n, t = [], 0, time.perf_counter()
        while self.has_work(run):
            if (steps is not None and n >= steps) or (seconds is not None and time.perf_counter() - t >= seconds):
                break
            if tt is not None and tt.pending:
                ended = tt.resume_ready(engine, lock_step)
                ended_all += ended
                if ended and done is not None and done(ended):
                    run.stopped = True
                    break
            if not engine.has_work():
                if tt is not None:
                    tt.wait(lock_step, None if seconds is None else max(seconds - (time.perf_counter() - t), 0.0))
                continue
            out = engine.step()
            n += 1
            run.col.add(out)
            run.records.append(out.record)
            if on_step is not None:
                on_step(out)
            if tt is not None:
                ended = [t for t in (tt.end_turn(engine, c) for c in out.finished) if t is not None]
                ended_all += ended
                if done is not None and done(ended):
                    run.stopped = True
                    break
            elif done is not None and done(out.finished):
                run.left = engine.export(engine.unfinished_ids())
                run.stopped = True
                break
        return ended_all

    def finish(self, run: TurnRun, partial: bool = False, limit=None) -> TurnsOut:
        """The run's outcome. partial: a partial rollout's (with tools: the trajectories that ended within the
        horizon, the rest carried, each cut at limit((label, sample)) drawn tokens when the run stopped)."""
        engine, tt, col = run.engine, self.turns, run.col
        if tt is not None:
            if run.stopped:
                tt.stop(engine)
            col.stats.total_s = time.perf_counter() - run.t0
            kept = engine.kept_tokens - run.kept0
            if not partial:
                comps, metrics = tt.result(col.stats, run.t0, kept)
                return TurnsOut(comps, run.records, metrics, [])
            fin, left = tt.carry_out(limit if run.stopped else None)
            _, metrics = tt.result(col.stats, run.t0, kept, ended=[tr for tr, _ in fin])
            comps = Completions(c for _, c in fin)
            comps.stats = col.stats
            return TurnsOut(comps, run.records, metrics, left)
        if not partial:
            return TurnsOut(col.result(), run.records, {}, [])  # sets the wall time, which tokens_per_s divides by
        comps = Completions(col.done.values())  # the finished ones, in the order they finished
        comps.stats = col.stats
        col.stats.total_s = time.perf_counter() - col.t0
        return TurnsOut(comps, run.records, {}, run.left)


def seq_lens(engine) -> dict[int, int]:
    """Tokens so far of our engine's running and waiting sequences, by id (a trajectory's current turn)."""
    sched = engine.scheduler
    return {s.seq_id: len(s.output_ids) for s in [*sched.running, *(s for g in sched.waiting for s in g)]}
