"""Partial rollouts with tools on Ray workers (rollout/partial.py for the step, tool_partial.py for a trajectory):
each worker runs the trajectories of the groups placed on it through its own turn loop (turns.py), in rounds the
driver paces; after each round the driver's Horizon is told of the trajectories that ended and of every unfinished
one's drawn tokens, and once it says stop every worker stops (the calls in flight answer first) and hands back the
trajectories that ended within the horizon and the rest carried, cut at it (mid-turn or after a call's
observation).

Invariants:
- where the rollout stops does not depend on when the horizon is asked (its T is fixed once known: rollout/
  partial.py's Horizon), and on the batch-invariant engine a trajectory's tokens depend on its seeds only
  (tool_turns.py), so the rounds, the split over workers and a worker's failure change when tokens appear, never what
  the step trains on or carries: the very trajectories (tokens, logprobs, mask, calls) one engine in process gives;
- a group's trajectories stay on one worker, across turns and rounds (siblings' history drafts, kept K/V);
- a worker that fails during the rollout: its groups re-run on the live workers from where this rollout took them
  up (a carried trajectory re-imported from its carried state, a new one from its prompt, the same seeds), and the
  horizon counts each trajectory's end once (the re-run draws the very same one); until the re-run reports, it
  counts at the tokens it restarts from. A worker that fails handing its trajectories back keeps those the driver
  saw end within the horizon; the others are lost and restart (as on the single-turn path, cluster/partial.py)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from ..config.agent import AgentConfig
from ..engine import Completions
from .base import Request
from .partial import drawn
from .remote import merge_parts
from .turns import TurnLoop, TurnRun, seq_lens

_RUNS = itertools.count()  # a rollout's id: a worker's trajectories of another (abandoned) rollout are not its


@dataclass
class Held:
    """What a worker keeps between the driver's calls (RolloutWorker.run_held): this rollout's turn loop and run."""

    rid: int
    loop: TurnLoop
    run: TurnRun


# ---- on a worker (RolloutWorker.run_held: fn(engine, held, *args) -> (held, result)) ------------------------------

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
    return held, (ended, held.loop.turns.running(seq_lens(engine)), held.loop.has_work(held.run))


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


# ---- on the driver -------------------------------------------------------------------------------------------------

@dataclass
class Share:
    """One group's work in this rollout as the rollout took it up: its new request (none for a carried group) and its
    carried states (with their prompt's chat messages)."""

    requests: list
    states: list
    messages: list

    def keys(self) -> list[tuple[int, int]]:
        return ([(q.label, j) for q in self.requests for j in range(q.params.n)]
                + [(st.prompt_index, st.sample_index) for st in self.states])

    def starts(self) -> list[tuple[int, int, int]]:
        """(label, sample, drawn tokens) where each of its trajectories starts (the Horizon's running clock)."""
        return ([(q.label, j, 0) for q in self.requests for j in range(q.params.n)]
                + [(st.prompt_index, st.sample_index, drawn(st)) for st in self.states])


def shares(requests: list[Request], states: list, messages: dict) -> dict[int, Share]:
    """Label (group) -> its share, carried groups first (the oldest, as the engine admits them)."""
    out: dict[int, Share] = {}
    for st in states:
        out.setdefault(st.prompt_index, Share([], [], [])).states.append(st)
        out[st.prompt_index].messages.append(messages[st.prompt_index])
    for q in requests:
        out.setdefault(q.label, Share([], [], [])).requests.append(q)
    return out


class ToolPartial:
    """The driver of one partial rollout with tools over a ClusterRollout's workers."""

    def __init__(self, cluster, cfg: AgentConfig, work: dict[int, Share]):
        self.cluster, self.cfg, self.work = cluster, cfg, work
        self.rid = next(_RUNS)
        self.at: dict[int, list[int]] = {}  # worker -> the labels it runs
        self.running: dict[int, list] = {}  # worker -> its unfinished trajectories' clocks, as last reported
        self.busy: dict[int, bool] = {}  # worker -> it has work left
        self.ended: dict[tuple[int, int], object] = {}  # key -> its Completion, as first reported
        self.counts = {"cluster/worker_failures": 0, "cluster/requeued": 0, "cluster/rounds": 0}

    def place(self, labels: list[int]) -> None:
        """These groups to the live workers running the fewest trajectories (a worker that fails taking them: they and
        all it held go to the others)."""
        by: dict[int, list[int]] = {}
        for label in labels:
            w = min(self.cluster.live(), key=lambda v: (self._load(v) + sum(self._size(x) for x in by.get(v, [])), v))
            by.setdefault(w, []).append(label)
        args = {}
        for w, ls in by.items():
            mine = [self.work[x] for x in ls]
            args[w] = (worker_start, self.rid, self.cfg, [q for s in mine for q in s.requests],
                       [st for s in mine for st in s.states], [m for s in mine for m in s.messages])
        ok, failed = self.cluster.call_each("run_held", args)
        for w in ok:
            self.at.setdefault(w, []).extend(by[w])
            self.running.setdefault(w, []).extend(x for label in by[w] for x in self.work[label].starts())
            self.busy[w] = True
        self._requeue([x for w in failed for x in by[w] + self._drop(w)])

    def round(self, seconds: float, steps: int | None) -> tuple[list, bool]:
        """One round on every worker with work: (the trajectories newly ended, whether any work is left)."""
        busy = [w for w in self.at if self.busy[w]]
        if not busy:
            return [], False
        ok, failed = self.cluster.call_each("run_held", {w: (worker_round, self.rid, seconds, steps) for w in busy})
        self.counts["cluster/rounds"] += 1
        fresh = []
        for w, (ended, running, more) in ok.items():
            self.running[w], self.busy[w] = running, more
            for c in ended:
                key = (c.prompt_index, c.sample_index)
                if key not in self.ended:  # a re-run after a failure ends as the first run did: told once
                    self.ended[key] = c
                    fresh.append(c)
        self._requeue([x for w in failed for x in self._drop(w)])
        return fresh, any(self.busy[w] for w in self.at)

    def clocks(self) -> list[tuple[int, int, int]]:
        return [x for w in self.at for x in self.running[w]]

    def end(self, limit) -> tuple[list, list, list, list]:
        """Every worker's run ends (limit: the horizon's, None when it never said stop): (finished completions,
        carried states, lost keys, the workers' (completions, metrics, stats) to merge)."""
        args = {w: (worker_end, self.rid, None if limit is None else
                    {k: limit(k) for x in ls for k in self.work[x].keys()}) for w, ls in self.at.items()}
        ok, failed = self.cluster.call_each("run_held", args)
        fin, left, lost, parts = [], [], [], []
        for w, (comps, states, metrics, stats) in ok.items():
            fin += comps
            left += states
            parts.append((comps, metrics, stats))
        for w in failed:
            self.counts["cluster/worker_failures"] += 1
            for key in (k for x in self.at[w] for k in self.work[x].keys()):
                c = self.ended.get(key)
                if c is not None and (limit is None or drawn(c) <= limit(key)):
                    fin.append(c)  # it ended within the horizon: final, whatever happens to its worker
                else:
                    lost.append(key)
        return fin, left, lost, parts

    def _drop(self, w: int) -> list[int]:
        """A failed worker's groups (the pool holds it dead until the next rollout's revive)."""
        self.counts["cluster/worker_failures"] += 1
        self.running.pop(w, None)
        self.busy.pop(w, None)
        return self.at.pop(w, [])

    def _requeue(self, labels: list[int]) -> None:
        if labels:
            self.counts["cluster/requeued"] += sum(self._size(x) for x in labels)
            self.place(labels)

    def _load(self, w: int) -> int:
        return sum(self._size(x) for x in self.at.get(w, []))

    def _size(self, label: int) -> int:
        return len(self.work[label].keys())


def cluster_tool_partial(cluster, cfg: AgentConfig, requests: list[Request], states: list, messages: dict,
                         done) -> tuple[Completions, list, list, dict]:
    """A partial rollout with tools on the cluster's workers: `states` (carried trajectories) continue, `requests`
    (labelled by group) start, and rounds run until done(finished, running) says stop (a Horizon: done.limit cuts);
    messages[label]: each group's chat prompt. Returns (the trajectories that ended within the horizon, in (label,
    sample) order with merged stats; the rest carried, cut at the horizon; the keys lost with a worker that failed
    handing them back; agent and cluster metrics)."""
    tp = ToolPartial(cluster, cfg, shares(requests, states, messages))
    tp.place(list(tp.work))
    stopped = False
    while True:
        fresh, more = tp.round(cluster.cfg.round_s, cluster.cfg.round_steps or None)
        if done(fresh, tp.clocks):
            stopped = True
            break
        if not more:
            break
    fin, left, lost, parts = tp.end(done.limit if stopped else None)
    out = Completions(sorted(fin, key=lambda c: (c.prompt_index, c.sample_index)))
    metrics, out.stats = merge_parts(parts)
    metrics.update(tp.counts)
    return out, sorted(left, key=lambda st: (st.prompt_index, st.sample_index)), lost, metrics
