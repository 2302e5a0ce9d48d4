"""Rollouts with tools on Ray workers, in rounds the driver paces (partial rollouts: rollout/partial.py for the
step, tool_partial.py for a trajectory; rollout.partial off: every trajectory runs to its end). Each worker runs
the trajectories placed on it through its own turn loop (turns.py); after each round the driver learns which
trajectories ended, every unfinished one's drawn tokens (a partial rollout's Horizon reads them) and which are in
each engine, and a less loaded worker takes trajectories from a loaded one (tool_moves.py: the
cost rule of the single-turn path's reallocation). Once the horizon says stop every worker stops (the calls in
flight answer first) and hands back the trajectories that ended within it and the rest carried, cut at it
(mid-turn or after a call's observation).

Invariants:
- where the rollout stops does not depend on when the horizon is asked (its T is fixed once known: rollout/
  partial.py's Horizon), and on the batch-invariant engine a trajectory's tokens depend on its seeds only
  (tool_turns.py), so the rounds, the split over workers, the moves and a worker's failure change when tokens
  appear, never what the step trains on or carries: the very trajectories (tokens, logprobs, mask, calls) one
  engine in process gives;
- a group's trajectories start on one worker (siblings' history drafts, shared prefix, kept K/V); a trajectory
  moves only while its turn is in the engine (never with a call running), as the carried state a stop would give
  it, and the receiver re-prefills it (no K/V travels);
- a worker that fails during the rollout: its trajectories re-run on the live workers from where this rollout took
  them up or last moved them (a carried or moved trajectory re-imported from that state, a new one from its
  prompt, the same seeds), and the horizon counts each trajectory's end once (the re-run draws the very same one);
  until the re-run reports, it counts at the tokens it restarts from. A worker that fails handing its trajectories
  back keeps those the driver saw end within the horizon; the others are lost and restart (as on the single-turn
  path, cluster/partial.py)."""

from __future__ import annotations

import dataclasses
import logging
import time

from ..config.agent import AgentConfig
from ..engine import Completions
from ..engine.requests import SeqState
from .base import Request
from .partial import drawn
from .remote import merge_parts
from .tool_moves import plan
from .tool_worker import RUNS, worker_end, worker_give, worker_round, worker_start

log = logging.getLogger(__name__)


def start_states(requests: list[Request], states: list) -> dict[tuple[int, int], SeqState]:
    """(label, sample) -> the state each trajectory of this rollout starts from: a carried one's carried state, a
    new one's first turn not begun (what ToolTurns.carry_in re-enters as the request's sample j would: its seed,
    params, first-turn limits)."""
    out = {(st.prompt_index, st.sample_index): st for st in states}
    for q in requests:
        p = q.params
        for j in range(p.n):
            out[(q.label, j)] = SeqState(q.label, j, list(q.ids), [], [], dataclasses.replace(p, n=1), p.seed + j,
                                         p.max_tokens, list(p.stop_token_ids))
    return out


class ToolPartial:
    """The driver of one rollout with tools over a ClusterRollout's workers, in rounds: where each trajectory runs
    (`where`), where it would restart (`start`: the state this rollout took it up from, or the one it was moved
    with), the workers' reports, and the trajectories moved between them (tool_moves.py)."""

    def __init__(self, cluster, cfg: AgentConfig, requests: list[Request], states: list, messages: dict):
        self.cluster, self.cfg = cluster, cfg
        # a request without a seed gets one here, so that a re-run or a moved trajectory draws the same noise
        requests = [q if q.params.seed is not None else dataclasses.replace(
            q, params=dataclasses.replace(q.params, seed=cluster.rng.randrange(2**62))) for q in requests]
        self.messages = {**messages, **{q.label: q.messages for q in requests}}
        self.start = start_states(requests, states)
        self.rid = next(RUNS)
        self.where: dict[tuple[int, int], int] = {}  # key -> the worker whose run holds it (running or ended)
        self.running: dict[int, list] = {}  # worker -> its unfinished trajectories' clocks, as last reported
        self.movable: dict[int, list] = {}  # worker -> the trajectories in its engine (ToolTurns.movable)
        self.busy: dict[int, bool] = {}  # worker -> it has work left
        self.inflight: dict[int, object] = {}  # worker -> its round in flight
        self.sent: dict[int, float] = {}  # worker -> when its round in flight was sent
        self.fresh: list = []  # trajectories ended since the last `round` returned
        self.ended: dict[tuple[int, int], object] = {}  # key -> its Completion, as first reported
        self.counts = {"cluster/worker_failures": 0, "cluster/requeued": 0, "cluster/rounds": 0,
                       "cluster/migrated": 0, "cluster/reprefill_tokens": 0}
        self.initial = (requests, states)

    def place_all(self) -> None:
        """This rollout's groups to the workers (each whole: siblings share a worker's history drafts and prefix),
        each to the live worker holding the fewest trajectories; carried groups first, as the engine admits them."""
        requests, states = self.initial
        groups: dict[int, tuple[list, list]] = {}
        for st in states:
            groups.setdefault(st.prompt_index, ([], []))[1].append(st)
        for q in requests:
            groups.setdefault(q.label, ([], []))[0].append(q)
        by: dict[int, tuple[list, list]] = {}
        for label, (reqs, sts) in groups.items():
            w = min(self.cluster.live(), key=lambda v: (self._load(v) + self._count(by.get(v)), v))
            mine = by.setdefault(w, ([], []))
            mine[0].extend(reqs)
            mine[1].extend(sts)
        self._send(by)

    def _send(self, by: dict[int, tuple[list, list]]) -> None:
        """(requests, states) to each worker's run; a worker that fails taking them: they and all it held go to the
        others."""
        self._wait(list(by))  # (its report read first: the clocks added below are not overwritten by an older one)
        gone = [w for w in by if w not in self.cluster.live()]  # (its round failed just now)
        if gone:
            self._requeue([k for w in gone for k in self._keys(by.pop(w))])
        args = {w: (worker_start, self.rid, self.cfg, reqs, sts, [self.messages[st.prompt_index] for st in sts])
                for w, (reqs, sts) in by.items()}
        ok, failed = self.cluster.call_each("run_held", args)
        for w, why in failed.items():
            log.warning("rollout worker %d failed taking trajectories (%s): they go to the others", w, why)
        for w in ok:
            keys = self._keys(by[w])
            self.where.update((k, w) for k in keys)
            self.running.setdefault(w, []).extend((*k, drawn(self.start[k])) for k in keys)
            self.busy[w] = True
        self._requeue([k for w in failed for k in self._keys(by[w]) + self._drop(w)])

    def round(self, seconds: float, steps: int | None) -> tuple[list, bool]:
        """A round on every worker with work and none in flight; then, once any has answered, the answers so far and
        the moves they ask for: (the trajectories newly ended, whether any work is left). A worker's next round
        starts as soon as its last one is read, so no worker waits for another's (on Ray; in process every call
        has answered by then)."""
        for w in [w for w, more in self.busy.items() if more and w not in self.inflight]:
            self.inflight[w] = self.cluster.submit(w, "run_held", worker_round, self.rid, seconds, steps)
            self.sent[w] = time.perf_counter()
        if not self.inflight:
            return [], False
        self._read(self.cluster.first(self.inflight))
        late = [w for w in self.inflight if time.perf_counter() - self.sent[w] > self.cluster.cfg.step_timeout_s]
        if late:  # a worker that hangs while the others answer: failed as a round's timeout says (the pool kills it)
            ok, failed = self.cluster.gather({w: self.inflight[w] for w in late}, timeout=0.0)
            self._read((ok, {w: f"no answer within {self.cluster.cfg.step_timeout_s:.0f} s" for w in failed}))
        self.counts["cluster/rounds"] += 1
        if self.cluster.cfg.migrate:
            self.migrate()
        fresh, self.fresh = self.fresh, []
        return fresh, any(self.busy.values()) or bool(self.inflight)

    def _read(self, answers: tuple[dict, dict]) -> None:
        """Workers' round reports: their clocks, trajectories in the engine and ends (new ones into `fresh`, which
        the next `round` returns)."""
        ok, failed = answers
        for w in [*ok, *failed]:
            self.inflight.pop(w, None)
        for w, why in failed.items():
            log.warning("rollout worker %d failed (%s): re-running its trajectories on the others", w, why)
        for w, (ended, running, more, movable) in ok.items():
            self.running[w], self.busy[w], self.movable[w] = running, more, movable
            for c in ended:
                key = (c.prompt_index, c.sample_index)
                if key not in self.ended:  # a re-run after a failure ends as the first run did: told once
                    self.ended[key] = c
                    self.fresh.append(c)
        self._requeue([k for w in failed for k in self._drop(w)])

    def _wait(self, workers) -> None:
        """These workers' rounds in flight answer and are read (a call to a worker queues behind its round)."""
        calls = {w: self.inflight[w] for w in workers if w in self.inflight}
        if calls:
            self._read(self.cluster.gather(calls))

    def migrate(self) -> None:
        """Less loaded workers take trajectories from loaded ones (tool_moves.plan, on the last reports): the
        donor's round in flight answers first, then they are exported from its run with
        their tokens so far (any that left its engine meanwhile stays), carried into the receiver's (re-prefilled),
        and from now on restarted from that state."""
        c = self.cluster.cfg
        lens = [drawn(x) for x in self.ended.values()]
        moves = plan({w: v for w, v in self.movable.items() if w in self.busy},
                     {w: len(v) for w, v in self.running.items()}, self.cluster.live(),
                     sum(lens) / len(lens) if lens else 0.0, self.cluster.cost, c.migrate_min_running,
                     c.migrate_margin)
        for mv in moves:
            if mv.donor not in self.busy or mv.receiver not in self.cluster.live():
                continue  # (failed meanwhile)
            self._wait([mv.donor])
            if mv.donor not in self.busy:
                continue
            ok, failed = self.cluster.call_each("run_held", {mv.donor: (worker_give, self.rid, mv.keys)})
            if failed:
                log.warning("rollout worker %d failed handing trajectories over (%s): re-running its trajectories on "
                            "the others", mv.donor, failed[mv.donor])
                self._requeue(self._drop(mv.donor))
                continue
            states = ok[mv.donor]
            moved = {(st.prompt_index, st.sample_index) for st in states}
            self.start.update(((st.prompt_index, st.sample_index), st) for st in states)
            self.running[mv.donor] = [x for x in self.running[mv.donor] if (x[0], x[1]) not in moved]
            self.movable[mv.receiver] = self.movable.get(mv.receiver, []) + [
                x for x in self.movable[mv.donor] if (x[0], x[1]) in moved]
            self.movable[mv.donor] = [x for x in self.movable[mv.donor] if (x[0], x[1]) not in moved]
            self.counts["cluster/migrated"] += len(states)
            self.counts["cluster/reprefill_tokens"] += sum(len(st.prompt_ids) + len(st.output_ids) for st in states)
            if states:
                self._send({mv.receiver: ([], states)})

    def clocks(self) -> list[tuple[int, int, int]]:
        return [x for w in self.running for x in self.running[w]]

    def end(self, limit) -> tuple[list, list, list, list]:
        """Every worker's run ends (limit: the horizon's, None when it never said stop): (finished completions,
        carried states, lost keys, the workers' (completions, metrics, stats) to merge)."""
        self._wait(list(self.inflight))
        at: dict[int, list] = {}
        for k, w in self.where.items():
            at.setdefault(w, []).append(k)
        args = {w: (worker_end, self.rid, None if limit is None else {k: limit(k) for k in ks}) for w, ks in at.items()}
        ok, failed = self.cluster.call_each("run_held", args)
        fin, left, lost, parts = [], [], [], []
        for w, (comps, states, metrics, stats) in ok.items():
            fin += comps
            left += states
            parts.append((comps, metrics, stats))
        for w, why in failed.items():
            log.warning("rollout worker %d failed handing back its trajectories (%s): those the driver saw end are "
                        "kept, the rest restart", w, why)
            self.counts["cluster/worker_failures"] += 1
            for key in at[w]:
                c = self.ended.get(key)
                if c is not None and (limit is None or drawn(c) <= limit(key)):
                    fin.append(c)  # it ended within the horizon: final, whatever happens to its worker
                else:
                    lost.append(key)
        return fin, left, lost, parts

    def _drop(self, w: int) -> list[tuple[int, int]]:
        """A failed worker's trajectories (the pool holds it dead until the next rollout's revive)."""
        self.counts["cluster/worker_failures"] += 1
        for d in (self.running, self.busy, self.movable, self.inflight):
            d.pop(w, None)
        keys = [k for k, v in self.where.items() if v == w]
        for k in keys:
            del self.where[k]
        return keys

    def _requeue(self, keys: list[tuple[int, int]]) -> None:
        """Trajectories of a failed worker re-run on the live ones from where this rollout took them up (or was
        last moved with them), each group's together; a re-run draws the very same tokens."""
        if not keys:
            return
        self.counts["cluster/requeued"] += len(keys)
        by: dict[int, tuple[list, list]] = {}
        for label in sorted({k[0] for k in keys}):
            sts = [self.start[k] for k in sorted(keys) if k[0] == label]
            w = min(self.cluster.live(), key=lambda v: (self._load(v) + self._count(by.get(v)), v))
            by.setdefault(w, ([], []))[1].extend(sts)
        self._send(by)

    def _load(self, w: int) -> int:
        return sum(1 for v in self.where.values() if v == w)

    @staticmethod
    def _count(share: tuple[list, list] | None) -> int:
        return 0 if share is None else sum(q.params.n for q in share[0]) + len(share[1])

    @staticmethod
    def _keys(share: tuple[list, list]) -> list[tuple[int, int]]:
        reqs, sts = share
        return [(q.label, j) for q in reqs for j in range(q.params.n)] + [(st.prompt_index, st.sample_index) for st in sts]


def cluster_tool_partial(cluster, cfg: AgentConfig, requests: list[Request], states: list, messages: dict,
                         done) -> tuple[Completions, list, list, dict]:
    """A rollout with tools on the cluster's workers, in rounds: `states` (carried trajectories) continue, `requests`
    (labelled by group) start, and rounds run until done(finished, running) says stop (a Horizon: done.limit cuts;
    None: every trajectory runs to its end, rollout.partial off); messages[label]: each group's chat prompt. Returns
    (the trajectories that ended within the horizon, in (label, sample) order with merged stats; the rest carried,
    cut at the horizon; the keys lost with a worker that failed handing them back; agent and cluster metrics)."""
    tp = ToolPartial(cluster, cfg, requests, states, messages)
    tp.place_all()
    stopped = False
    while True:
        fresh, more = tp.round(cluster.cfg.round_s, cluster.cfg.round_steps or None)
        if done is not None and done(fresh, tp.clocks):
            stopped = True
            break
        if not more:
            break
    fin, left, lost, parts = tp.end(done.limit if stopped else None)
    out = Completions(sorted(fin, key=lambda c: (c.prompt_index, c.sample_index)))
    metrics, out.stats = merge_parts(parts)
    metrics.update(tp.counts)
    return out, sorted(left, key=lambda st: (st.prompt_index, st.sample_index)), lost, metrics


def cluster_tool_rollout(cluster, cfg: AgentConfig, requests: list[Request]) -> tuple[Completions, dict]:
    """Every request's trajectories to their end on the cluster's workers, in rounds (so idle workers take
    trajectories from loaded ones): (completions in (prompt, sample) order with merged stats, agent and cluster
    metrics). A trajectory lost with a worker that failed handing it back is a RuntimeError naming it."""
    labelled = [q if q.label is not None else dataclasses.replace(q, label=i) for i, q in enumerate(requests)]
    comps, left, lost, metrics = cluster_tool_partial(cluster, cfg, labelled, [], {}, None)
    if lost or left:
        raise RuntimeError(f"rollout workers failed handing back trajectories {sorted(lost)[:8]}: the step's "
                           "samples are incomplete")
    return comps, metrics
