"""A rollout with tools on one Ray worker, between the driver's calls (rollout/remote_partial.py drives them through
RolloutWorker.run_held: fn(engine, held, *args) -> (held, result)): this rollout's turn loop and run held on the
worker, its rounds, the trajectories it hands over to another worker, and its end (what ended within the horizon,
the rest carried, cut at it)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from ..config.agent import AgentConfig
from .base import Request
from .turns import TurnLoop, TurnRun, seq_lens

RUNS = itertools.count()  # a rollout's id: a worker's trajectories of another (abandoned) rollout are not its


@dataclass
class Held:
    """What a worker keeps between the driver's calls (RolloutWorker.run_held): this rollout's turn loop and run."""

    rid: int
    loop: TurnLoop
    run: TurnRun


def worker_start(engine, held: Held | None, rid: int, cfg: AgentConfig, requests: list[Request], states: list,
                 messages: list) -> tuple[Held, None]:
    """These groups' trajectories into this worker's run of rollout `rid` (begun here if it has none): carried states
    first, then the requests' first turns."""
    if held is not None and held.rid == rid:
        held.loop.add(held.run, requests, states, messages)
        return held, None
    if held is not None:  # an abandoned rollout's: its sequences leave the engine
        held.loop.close()
        engine.export(engine.unfinished_ids())
    loop = TurnLoop(cfg, engine.tokenizer)
    return Held(rid, loop, loop.start(engine, requests, states, messages)), None


def worker_round(engine, held: Held | None, rid: int, seconds: float, steps: int | None) -> tuple[Held, tuple]:
    """About `seconds` (or `steps` engine steps) of the run: (the trajectories that ended meanwhile, (label, sample,
    drawn tokens) of every unfinished one, whether work is left)."""
    _check(held, rid)
    ended = held.loop.advance(held.run, steps=steps, seconds=seconds)
    lens = seq_lens(engine)
    tt = held.loop.turns
    return held, (ended, tt.running(lens), held.loop.has_work(held.run), tt.movable(lens))


def worker_give(engine, held: Held | None, rid: int, keys: list) -> tuple[Held, list]:
    """These trajectories leave this worker's run for another's (ToolTurns.hand_over): their carried states."""
    _check(held, rid)
    with torch.inference_mode():  # taking a running sequence out moves KV rows of the engine's cache
        return held, held.loop.turns.hand_over(engine, keys)


def worker_end(engine, held: Held | None, rid: int, limits: dict | None) -> tuple[None, tuple]:
    """The run ends: (the trajectories that ended within the horizon, the rest as carried states cut at limits[(label,
    sample)] drawn tokens, agent metrics, stats). limits None: the horizon never said stop (every one ran out)."""
    _check(held, rid)
    loop, run = held.loop, held.run
    run.stopped = limits is not None
    try:
        out = loop.finish(run, partial=True, limit=limits.__getitem__ if limits is not None else None)
    finally:
        loop.close()
    engine.end_rollout(out.completions.stats)
    return None, (list(out.completions), out.left, out.metrics, out.completions.stats)


def _check(held: Held | None, rid: int) -> None:
    if held is None or held.rid != rid:
        raise RuntimeError(f"this worker holds no trajectories of rollout {rid} (restarted?)")
