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
        t0 = time.perf_counter()
        tt = self.turns
        kept0 = engine.kept_tokens
        params = [q.params for q in requests]
        if tt is not None:
            params = tt.first_params(params)
            tt.reset()
            ids = tt.carry_in(engine, list(states or []), list(messages or []))
        else:
            ids = engine.import_(list(states)) if states is not None else []
        labels = None if all(q.label is None for q in requests) else \
            [i if q.label is None else q.label for i, q in enumerate(requests)]
        new = engine.add_requests([q.ids for q in requests], params, labels)
        col = engine.collector(ids + new)
        if tt is not None:
            tt.begin(requests, params, new, t0)
        records, left, stopped = [], [], False
        while engine.has_work() or (tt is not None and tt.pending):
            if tt is not None and tt.pending:
                ended = tt.resume_ready(engine, lock_step)
                if ended and done is not None and done(ended):
                    stopped = True
                    break
            if not engine.has_work():
                if tt is not None:
                    tt.wait(lock_step)
                continue
            out = engine.step()
            col.add(out)
            records.append(out.record)
            if on_step is not None:
                on_step(out)
            if tt is not None:
                ended = [t for t in (tt.end_turn(engine, c) for c in out.finished) if t is not None]
                if done is not None and done(ended):
                    stopped = True
                    break
            elif done is not None and done(out.finished):
                left = engine.export(engine.unfinished_ids())
                break
        if tt is not None:
            if stopped:
                tt.stop(engine)
            col.stats.total_s = time.perf_counter() - t0
            comps, metrics = tt.result(col.stats, t0, engine.kept_tokens - kept0)
            if done is not None:  # a partial rollout: the trajectories that ended within the horizon, the rest carried
                fin, left = tt.carry_out(limit if stopped else None)
                comps = Completions(fin)
                comps.stats = col.stats
        elif done is None:
            comps, metrics = col.result(), {}  # sets the wall time, which tokens_per_s divides by
        else:  # the finished ones, in the order they finished
            comps, metrics = Completions(col.done.values()), {}
            comps.stats = col.stats
            col.stats.total_s = time.perf_counter() - col.t0
        return TurnsOut(comps, records, metrics, left)
