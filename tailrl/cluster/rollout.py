"""The multi-worker rollout driver: place groups by predicted length, run workers in rounds, migrate the tail
(reallocate.py), forward siblings' tokens, survive dead or hung workers, merge statistics.

Invariant (what the tests hold it to): the rollout equals the single-engine rollout for every (prompt, sample):
same tokens, same logprobs, same order. Every sample keeps its seed (seed + sample_index) wherever it runs, and
sampling noise is keyed by (seed, position), so placement, migration (RLHFSpec reallocation, re-prefill on the
importer) and re-running a dead worker's samples change when tokens appear, never which tokens."""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from dataclasses import dataclass, field

from ..engine import Completions, SamplingParams
from ..engine.stats import GenerateStats
from ..engine.tail import tail_size
from .config import ClusterConfig
from .cost import StepCost
from .placement import LengthPredictor, Unit, affine, length_metrics, place, prompt_key, static_split
from .pool import LocalPool, RayPool, WorkerFailed
from .reallocate import migrate_tail
from .workers import WorkerSpec

log = logging.getLogger(__name__)


@dataclass
class Sample:
    prompt_index: int
    sample_index: int
    worker: int = -1
    local_id: int = -1
    tokens: list[int] = field(default_factory=list)  # emitted so far (as reported by its worker)
    sent: dict[int, int] = field(default_factory=dict)  # worker -> tokens of this sample forwarded there


class ClusterRollout:
    def __init__(self, spec: WorkerSpec, workers: int, cfg: ClusterConfig | None = None, cost: StepCost | None = None,
                 local: bool = False, prior_length: float = 256.0, seed: int = 0):
        """local: in-process workers (no Ray); otherwise `workers` Ray actors."""
        self.cfg = cfg or ClusterConfig()
        self.spec, self.cost = spec, cost or StepCost()
        self.pool = (LocalPool(spec, workers) if local
                     else RayPool(spec, workers, self.cfg.address, start_timeout_s=max(self.cfg.step_timeout_s, 300.0)))
        self.predictor = LengthPredictor(prior_length)
        self.rng = random.Random(seed)
        self.weights = self.idle_state = None  # the last synced weights (object store refs): restarts load them
        self.last_worker: dict[int, int] = {}  # prompt key -> worker that ran most of it (history affinity)
        self.metrics: dict = {}
        self.idle_states: list = []  # the last rollout's idle-work results (trained drafter heads) to merge

    # ---- between steps ------------------------------------------------------------------------------------

    def sync_weights(self, state_dict: dict, idle_state: dict | None = None) -> float:
        """The policy's weights to every worker: one `put` into the object store, loaded by parameter name;
        idle_state (the merged drafter head) travels the same way."""
        t = time.perf_counter()
        self.weights = self.pool.put({k: v.detach().cpu() for k, v in state_dict.items()})
        self.idle_state = self.pool.put(idle_state) if idle_state is not None else None
        live = self._live()
        calls = {w: self.pool.submit(w, "load_weights", self.weights, self.idle_state) for w in live}
        _, failed = self.pool.gather(calls, self.cfg.step_timeout_s)
        for w, why in failed.items():
            log.warning("worker %d failed to load weights (%s); it restarts at the next step", w, why)
        return time.perf_counter() - t

    def run_each(self, fn, args: dict[int, tuple]) -> dict[int, object]:
        """fn(engine, *args[w]) on each worker w at once (RolloutWorker.run); a worker that fails or times out is a
        RuntimeError naming it: the caller's work is not silently lost."""
        live = set(self._live())
        missing = sorted(set(args) - live)
        if missing:
            raise RuntimeError(f"rollout workers {missing} are not running")
        calls = {w: self.pool.submit(w, "run", fn, *a) for w, a in args.items()}
        done, failed = self.pool.gather(calls, self.cfg.step_timeout_s)
        if failed:
            raise RuntimeError("rollout workers failed: " + "; ".join(f"{w}: {why}" for w, why in failed.items()))
        return done

    def call_each(self, method: str, args: dict[int, tuple]) -> tuple[dict[int, object], dict[int, str]]:
        """worker.method(*args[w]) on each worker w at once: (results, failures by worker); a failed worker is dead
        until `revive` (the next rollout's start), and the caller re-runs its work."""
        calls = {w: self.pool.submit(w, method, *a) for w, a in args.items()}
        return self.pool.gather(calls, self.cfg.step_timeout_s)

    def submit(self, w: int, method: str, *args):
        """worker.method(*args) on worker w, answered later (`first`, `gather`: a driver that keeps a call in flight
        on each worker while it reads the others' answers)."""
        return self.pool.submit(w, method, *args)

    def first(self, calls: dict[int, object]) -> tuple[dict[int, object], dict[int, str]]:
        """(results, failures) of the calls that have answered once one has; the rest stay in flight."""
        return self.pool.first(calls, self.cfg.step_timeout_s)

    def gather(self, calls: dict[int, object], timeout: float | None = None) -> tuple[dict[int, object], dict[int, str]]:
        """(results, failures) of these calls, each given `timeout` seconds more (None: cluster.step_timeout_s)."""
        return self.pool.gather(calls, self.cfg.step_timeout_s if timeout is None else timeout)

    def live(self) -> list[int]:
        """The workers running now (RuntimeError when none is)."""
        return self._live()

    @property
    def num_workers(self) -> int:
        return len(self._live())

    def history_state(self) -> dict | None:
        return self.pool.call(self._live()[0], "history_state")

    def load_history(self, state: dict | None) -> None:
        for w in self._live():
            self.pool.call(w, "load_history", state)

    def shutdown(self) -> None:
        self.pool.shutdown()

    # ---- one rollout --------------------------------------------------------------------------------------

    def generate(self, prompts: list, sampling: SamplingParams | list[SamplingParams] | None = None,
                 tasks: list[str | None] | None = None) -> Completions:
        """Like Engine.generate: one Completion per sample in (prompt, sample) order, `.stats` merged."""
        self.start(prompts, sampling, tasks)
        while self.step():
            pass
        return self.finish()

    def start(self, prompts: list, sampling=None, tasks=None, before_new=None) -> None:
        """A rollout of `prompts` (their n samples each, keys (prompt, sample)); before_new(): what goes to the
        workers ahead of them (partial rollouts' carried sequences, cluster/partial.py)."""
        self.revive()
        sampling = sampling or SamplingParams()
        params = list(sampling) if isinstance(sampling, list) else [sampling] * len(prompts)
        # a request without a seed gets one here, so that a re-run or a migrated sample draws the same noise
        self.params = [p if p.seed is not None else dataclasses.replace(p, seed=self.rng.randrange(2**62)) for p in params]
        self.prompts, self.tasks = list(prompts), list(tasks or [None] * len(prompts))
        self.samples = {(i, j): Sample(i, j) for i, p in enumerate(self.params) for j in range(p.n)}
        self.done: dict[tuple[int, int], object] = {}
        self.held: dict[int, dict[int, tuple[int, int]]] = {w: {} for w in range(len(self.pool))}
        self.outbox: dict[int, list] = {w: [] for w in range(len(self.pool))}
        self.busy = {w: 0.0 for w in range(len(self.pool))}
        self.counts = {"cluster/migrated": 0, "cluster/reprefill_tokens": 0, "cluster/worker_failures": 0,
                       "cluster/requeued": 0, "cluster/remote_tokens": 0, "cluster/rounds": 0, "cluster/idle_train_s": 0.0}
        self.prompt_ids: dict[int, list[int]] = {}
        self.carried: dict[tuple[int, int], object] = {}  # key -> the state it continued from (a re-run resumes it)
        self.t0 = time.perf_counter()
        live = self._live()
        self.predicted = [self.predictor.predict(self.prompts[i], self.tasks[i]) for i in range(len(prompts))]
        units = [Unit(i, 0, p.n, self.predicted[i]) for i, p in enumerate(self.params)]
        if before_new is not None:
            before_new()
        max_seqs = self.spec.engine.max_num_seqs
        plan = (place(units, len(live), cost=self.cost, max_seqs=max_seqs) if self.cfg.placement == "histopipe"
                else static_split(units, len(live)))
        for w, bin_units in zip(self._affine(plan, live), plan):
            self._add(w, bin_units)

    def _import(self, by_worker: dict[int, list]) -> None:
        for w, items in by_worker.items():
            try:
                ids = self.pool.call(w, "import_", [st for _, st in items], timeout=self.cfg.step_timeout_s)
            except WorkerFailed as e:
                self._fail(w, str(e))
                self._requeue([k for k, _ in items])
                continue
            for i, (key, _) in zip(ids, items):
                self._hold(w, i, key)

    def step(self) -> bool:
        """One round: every worker with work runs about round_s of engine steps; then finished samples are
        collected, siblings' tokens queued for forwarding, failures re-run, and idle workers take tail work."""
        if len(self.done) == len(self.samples):
            return False
        calls = {}
        for w in self._live():
            if self.held[w]:
                steps = self.cfg.round_steps or 1_000_000
                calls[w] = self.pool.submit(w, "run_round", self.cfg.round_s, self.outbox[w], steps)
                self.outbox[w] = []
            elif self.cfg.idle_train:
                calls[w] = self.pool.submit(w, "idle_work", self.cfg.round_s)
        ok, failed = self.pool.gather(calls, self.cfg.step_timeout_s)
        holders: dict[int, set[int]] = {}  # prompt -> workers holding its samples (as the round began)
        for v in self._live():
            for key in self.held[v].values():
                holders.setdefault(key[0], set()).add(v)
        for w, out in ok.items():
            self._collect(w, out, holders)
        for w, why in failed.items():
            self._fail(w, why)
        if self.cfg.migrate:
            migrate_tail(self)
        self.counts["cluster/rounds"] += 1
        return len(self.done) < len(self.samples)

    def finish(self, partial: bool = False) -> Completions:
        """Ends the rollout: every sample's completion in key order (partial: the finished ones only)."""
        wall = time.perf_counter() - self.t0
        live = self._live()
        ok, failed = self.pool.gather({w: self.pool.submit(w, "end_rollout") for w in live}, self.cfg.step_timeout_s)
        for w, why in failed.items():
            log.warning("worker %d failed at the end of the rollout (%s); it restarts at the next step", w, why)
        tail = tail_size(len(self.samples))
        stats = GenerateStats(tail_size=tail)
        for w, out in ok.items():
            part = GenerateStats(tail_size=tail)
            for r in out["records"]:
                part.add(r)
            stats.merge(part)
        stats.total_s = wall
        result = Completions(self.done[k] for k in self.samples if k in self.done or not partial)
        result.stats = stats
        self.metrics = self._metrics(result, wall, [out.get("idle_state") for out in ok.values()])
        for i, comps in self._groups().items():
            if all(c.finish_reason != "error" for c in comps):
                self.predictor.observe(self.prompts[i], self.tasks[i], [len(c.token_ids) for c in comps])
        return result

    # ---- internals ----------------------------------------------------------------------------------------

    def _groups(self) -> dict[int, list]:
        """Prompt slot -> its finished completions, for slots whose every sample finished."""
        out: dict[int, list] = {}
        for i, j in self.samples:
            out.setdefault(i, []).append(self.done.get((i, j)))
        return {i: cs for i, cs in out.items() if all(c is not None for c in cs)}

    def _live(self) -> list[int]:
        live = [w for w in range(len(self.pool)) if w not in self.pool.dead]
        if not live:
            raise RuntimeError("every rollout worker has failed")
        return live

    def revive(self) -> None:
        """Workers that died in the last step come back with the current weights (and no history)."""
        for w in sorted(self.pool.dead):
            self.pool.restart(w)
            if self.weights is not None:
                self.pool.call(w, "load_weights", self.weights, self.idle_state, timeout=self.cfg.step_timeout_s)

    def _affine(self, plan: list[list[Unit]], live: list[int]) -> list[int]:
        """Bins to workers, each to the one that ran most of its prompts last time (placement.affine)."""
        return affine(plan, live, lambda u: self.last_worker.get(prompt_key(self.prompts[u.prompt_index])))

    def _add(self, w: int, units: list[Unit]) -> None:
        if not units:
            return
        sampling = [dataclasses.replace(self.params[u.prompt_index], n=u.count,
                                        seed=self.params[u.prompt_index].seed + u.first) for u in units]
        try:
            ids, prompt_ids = self.pool.call(w, "add", [self.prompts[u.prompt_index] for u in units], sampling,
                                             [u.prompt_index for u in units], timeout=self.cfg.step_timeout_s)
        except WorkerFailed as e:
            self._fail(w, str(e))
            self._requeue([(u.prompt_index, u.first + j) for u in units for j in range(u.count)])
            return
        it = iter(ids)
        for u, toks in zip(units, prompt_ids):
            self.prompt_ids[u.prompt_index] = toks
            for j in range(u.count):
                self._hold(w, next(it), (u.prompt_index, u.first + j))

    def _hold(self, w: int, local_id: int, key: tuple[int, int]) -> None:
        s = self.samples[key]
        s.worker, s.local_id = w, local_id
        self.held[w][local_id] = key

    def _collect(self, w: int, out, holders: dict[int, set[int]]) -> None:
        self.busy[w] += out.busy_s
        self.counts["cluster/idle_train_s"] += out.idle_s
        grown = []
        for c in out.finished:
            key = self.held[w].pop(c.seq_id)
            self._check_label(w, key, c.prompt_index, c.prompt_token_ids)
            self.done[key] = dataclasses.replace(c, prompt_index=key[0], sample_index=key[1])
            self.samples[key].tokens = list(c.token_ids)
            self.last_worker[prompt_key(self.prompts[key[0]])] = w
            grown.append(key)
        for local_id, toks in out.tokens.items():
            key = self.held[w].get(local_id)
            if key is not None:
                self.samples[key].tokens += toks
                grown.append(key)
        if self.cfg.sibling_drafting and grown:
            self._forward(w, grown, holders)

    def _check_label(self, w: int, key: tuple[int, int], prompt_index: int, prompt_ids: list[int],
                     seed: int | None = None) -> None:
        """A worker's sequence must be the one the driver holds under that id (its prompt, and its seed where the
        state carries it): a sample scored against another prompt's answer, or two samples swapped, is corrupt
        training data, so a mismatch stops the rollout (a bug in the driver, not a worker fault)."""
        known = self.prompt_ids.get(key[0])
        if (prompt_index != key[0] or (prompt_ids and known is not None and list(prompt_ids) != known)
                or (seed is not None and seed != self.params[key[0]].seed + key[1])):
            raise RuntimeError(f"worker {w} returned a sequence of prompt {prompt_index}"
                               f"{'' if seed is None else f' (seed {seed})'} for sample {key}: the driver's bookkeeping "
                               "is wrong; stopping rather than mislabel samples")

    def _forward(self, w: int, keys: list[tuple[int, int]], holders: dict[int, set[int]]) -> None:
        """Seer's group drafting across workers: a sample's new tokens go to every other worker holding a
        sibling of its group, where they feed the history drafter's live sibling index."""
        for key in keys:
            s = self.samples[key]
            for v in holders.get(key[0], ()):
                sent = s.sent.get(v, 0)
                if v != w and len(s.tokens) > sent:
                    self.outbox[v].append((self.prompt_ids[key[0]], key, s.tokens[sent:]))
                    self.counts["cluster/remote_tokens"] += len(s.tokens) - sent
                    s.sent[v] = len(s.tokens)

    def _fail(self, w: int, why: str) -> None:
        self.counts["cluster/worker_failures"] += 1
        keys = list(self.held[w].values())
        log.warning("worker %d failed (%s): re-running its %d unfinished samples elsewhere", w, why, len(keys))
        self.held[w] = {}
        self.outbox[w] = []
        self._requeue(keys)

    def _requeue(self, keys: list[tuple[int, int]]) -> None:
        """Unfinished samples of a failed worker start over on the least loaded live workers (same seeds: the
        very same tokens come out)."""
        self.counts["cluster/requeued"] += len(keys)
        for key in keys:
            s = self.samples[key]
            s.sent = {}
            w = min(self._live(), key=lambda v: (len(self.held[v]), v))
            if key in self.carried:  # a partial rollout's carried sequence goes on from where it was carried
                s.tokens = list(self.carried[key].output_ids)
                self._import({w: [(key, self.carried[key])]})
            else:
                s.tokens = []
                self._add(w, [Unit(key[0], key[1], 1, self.predicted[key[0]])])

    def _metrics(self, comps, wall: float, idle_states: list) -> dict:
        m = dict(self.counts)
        groups = self._groups()
        actual = [sum(len(c.token_ids) for c in cs) / len(cs) for cs in groups.values()]
        m.update(length_metrics([self.predicted[i] for i in groups], actual))
        for w in range(len(self.pool)):
            m[f"cluster/busy_s/{w}"] = self.busy[w]
            m[f"cluster/idle_s/{w}"] = max(wall - self.busy[w], 0.0)
        m["cluster/idle_frac"] = 1 - sum(self.busy.values()) / (len(self.pool) * wall) if wall else 0.0
        idle_total = sum(max(wall - b, 0.0) for b in self.busy.values())
        m["cluster/idle_train_share"] = self.counts["cluster/idle_train_s"] / idle_total if idle_total else 0.0
        self.idle_states = [s for s in idle_states if s is not None]  # drafter updates to merge (trainer)
        return m
