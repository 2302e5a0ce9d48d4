"""Scoring completions with the configured reward functions, where one bad function or sample fails alone.

Invariants:
- A user function (`module:function`) runs in one worker process, which imports the user modules before
  its first call (start-up is not charged to a call). A hanging function costs at most `timeout_s` per
  step: one deadline covers the batch call and the per-sample retries after it raised; at the deadline the
  worker is killed (SIGKILL) and the samples not scored get 0, counted in `reward/timeouts`.
- The worker dies with the run: it is killed on `close()`, and by the kernel when the thread that started it
  dies (Linux PR_SET_PDEATHSIG; call the runner from a thread that lives as long as the run, as the
  trainer's main thread does), or within a second when its parent process is gone (elsewhere).
- A value that is not a finite number (None, NaN, inf, a string) becomes 0, counted in `reward/invalid`
  with a warning naming the function. A wrong number of values is an error naming the function and both
  lengths. A function failing on every sample `max_failed_steps` steps in a row stops the run."""

from __future__ import annotations

import inspect
import logging
import math
import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from .builtin import BUILTIN, load_function, reward_weights

log = logging.getLogger(__name__)


class RewardError(RuntimeError):
    """A reward function is broken in a way the run must not go on with."""


@dataclass
class RewardStats:
    errors: int = 0  # samples whose function raised
    timeouts: int = 0  # samples not scored in time
    invalid: int = 0  # values that were not finite numbers
    per_fn: dict[str, float] = field(default_factory=dict)  # mean of each function this step


def _as_float(x) -> float | None:
    if x is None or isinstance(x, (str, bytes)):
        return None
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


AGENT_KEYS = ("conversation", "tool_calls")  # multi-turn only, and only for functions that take them


def takes(fn, key: str) -> bool:
    """Whether fn accepts keyword `key` (by name or through **kwargs): the agent's columns reach a reward function
    only then, so a function written for single-turn runs keeps working."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(p.kind is p.VAR_KEYWORD or (p.name == key and p.kind is not p.VAR_POSITIONAL) for p in params)


def _call_user(spec: str, prompts, completions, columns: dict):
    """('ok', [float | None]) or ('type', type name) when the function returned something that is not a list."""
    fn = load_function(spec)
    columns = {k: v for k, v in columns.items() if k not in AGENT_KEYS or takes(fn, k)}
    out = fn(prompts=prompts, completions=completions, **columns)
    if isinstance(out, (str, bytes, dict)) or not isinstance(out, Iterable):
        return "type", type(out).__name__
    return "ok", [_as_float(x) for x in out]


def _die_with_parent(parent: int) -> None:
    try:  # Linux: the kernel kills this process when the trainer dies, whatever the worker is doing
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass

    def watch():  # elsewhere (and for a parent that died before prctl): poll
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def _worker_main(conn, parent: int, specs: list[str]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle; it kills this worker
    _die_with_parent(parent)
    for spec in specs:  # imports happen here, outside any call's deadline
        try:
            load_function(spec)
        except ValueError:
            pass  # reported by the call that needs it
    conn.send(("ready", None))
    while True:
        msg = conn.recv()
        if msg is None:
            return
        spec, prompts, completions, columns, one_by_one = msg
        parts = [slice(i, i + 1) for i in range(len(completions))] if one_by_one else [slice(None)]
        for sl in parts:
            try:
                res = _call_user(spec, prompts[sl], completions[sl], {k: v[sl] for k, v in columns.items()})
            except BaseException as e:  # noqa: BLE001 - the user's code may raise anything; report it by name
                res = ("err", f"{type(e).__name__}: {e}")
            conn.send(res)


class RewardRunner:
    def __init__(self, names: list[str], weights: list[float] | None = None, timeout_s: float = 10.0,
                 max_failed_steps: int = 3):
        if not names:
            raise ValueError("at least one reward function is needed")
        self.names = list(names)
        self.weights = reward_weights(self.names, weights)
        for n, w in zip(self.names, self.weights):
            if not math.isfinite(w):
                raise ValueError(f"reward weight {w} for {n!r} is not a finite number")
            if n not in BUILTIN:
                load_function(n)  # fail at start-up on a name that does not resolve, not mid-run
        self.timeout_s = timeout_s
        self.startup_s = max(120.0, 4 * timeout_s)  # spawning Python and importing the user's modules
        self.max_failed_steps = max_failed_steps
        self.failed_steps = {n: 0 for n in self.names}  # consecutive steps where a function failed on every sample
        self._proc = self._conn = None
        self.total_errors = self.total_timeouts = self.total_invalid = 0

    # ---- the worker process -----------------------------------------------------------------------------

    def _start(self) -> None:
        """A fresh worker with every user function imported (its start-up is not charged to a call's deadline)."""
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        user = [n for n in self.names if n not in BUILTIN]
        self._proc = ctx.Process(target=_worker_main, args=(child, os.getpid(), user), daemon=True,
                                 name="tailrl-reward-worker")
        self._proc.start()
        child.close()
        if self._recv(time.monotonic() + self.startup_s)[0] != "ready":
            raise RewardError(f"the reward worker did not start within {self.startup_s:.0f}s (importing "
                              f"{', '.join(user)})")

    def _send(self, msg) -> None:
        if self._proc is None:
            self._start()
        self._conn.send(msg)

    def _recv(self, deadline: float):
        """The worker's next answer, or ('timeout', None) after killing it at the deadline."""
        if self._conn is None:  # it died earlier in this batch
            return "err", "the reward worker process died"
        try:
            if self._conn.poll(max(deadline - time.monotonic(), 0.0)):
                return self._conn.recv()
        except (EOFError, OSError) as e:  # the worker died (killed, out of memory, os._exit in user code)
            self.kill_worker()
            return "err", f"the reward worker process died ({type(e).__name__})"
        self.kill_worker()
        return "timeout", None

    def kill_worker(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.join(timeout=10)
            self._conn.close()
            self._proc = self._conn = None

    def close(self) -> None:
        self.kill_worker()

    @property
    def worker_pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    # ---- scoring ----------------------------------------------------------------------------------------

    def _values(self, spec: str, res, n: int) -> list[float | None]:
        kind, out = res
        if kind == "type":
            raise RewardError(f"reward {spec} returned a {out}, not a list of {n} numbers")
        if len(out) != n:
            raise RewardError(f"reward {spec} returned {len(out)} values for {n} completions")
        return out

    def _user(self, spec, prompts, completions, columns, stats: RewardStats) -> tuple[list[float | None], int]:
        """Values (None where unscored or invalid) and the number of samples that got no value."""
        n = len(completions)
        self._send((spec, prompts, completions, columns, False))  # may start a worker: not charged to the deadline
        deadline = time.monotonic() + self.timeout_s
        res = self._recv(deadline)
        if res[0] == "timeout":
            stats.timeouts += n
            log.warning("reward %s ran over reward.timeout_s=%.1fs on a batch of %d: they get 0 this step", spec,
                        self.timeout_s, n)
            return [None] * n, n
        if res[0] != "err":
            return self._values(spec, res, n), 0
        # the batch call raised: score the samples one by one, within what is left of the same deadline
        vals: list[float | None] = [None] * n
        errors = timeouts = 0
        if n > 1 and self._proc is not None:  # (a worker that died on the batch is not retried within the step)
            self._send((spec, prompts, completions, columns, True))
            try:
                for i in range(n):
                    r = self._recv(deadline)
                    if r[0] == "timeout":
                        timeouts = n - i
                        break
                    if r[0] == "err":
                        errors += 1
                        continue
                    vals[i] = self._values(spec, r, 1)[0]
            except RewardError:
                self.kill_worker()  # it may still be sending answers for the rest of the batch
                raise
        else:
            errors = n
        stats.errors += errors
        stats.timeouts += timeouts
        log.warning("reward %s raised on %d of %d samples (first: %s): they get 0", spec, errors, n, res[1])
        if timeouts:
            log.warning("reward %s ran over reward.timeout_s=%.1fs: %d samples get 0", spec, self.timeout_s, timeouts)
        return vals, errors + timeouts

    def _builtin(self, name, completions, columns, stats: RewardStats) -> tuple[list[float | None], int]:
        fn, vals, failed, first = BUILTIN[name], [], 0, None
        for i, c in enumerate(completions):
            try:
                vals.append(_as_float(fn(c, **{k: v[i] for k, v in columns.items()})))
            except Exception as e:
                failed += 1
                first = first or f"{type(e).__name__}: {e}"
                vals.append(None)
        if failed:  # one line a step, not one per sample
            stats.errors += failed
            log.warning("reward %s raised on %d of %d samples (first: %s): they get 0", name, failed, len(vals), first)
        return vals, failed

    def __call__(self, prompts: list, completions: list[str], columns: dict[str, list]) -> tuple[list[float], RewardStats]:
        """columns: 'answer' and any extra dataset columns, one value per completion."""
        stats = RewardStats()
        n = len(completions)
        total = [0.0] * n
        for name, w in zip(self.names, self.weights):
            if name in BUILTIN:
                vals, failed = self._builtin(name, completions, columns, stats)
            else:
                vals, failed = self._user(name, prompts, completions, columns, stats)
            invalid = sum(v is None for v in vals) - failed
            if invalid:
                stats.invalid += invalid
                log.warning("reward %s returned %d of %d values that are not finite numbers (None, NaN, inf, text): "
                            "they count 0 (reward/invalid)", name, invalid, n)
            self._track_failures(name, failed + invalid == n and n > 0)
            clean = [v if v is not None else 0.0 for v in vals]
            stats.per_fn[name] = sum(clean) / max(n, 1)
            total = [t + w * v for t, v in zip(total, clean)]
        self.total_errors += stats.errors
        self.total_timeouts += stats.timeouts
        self.total_invalid += stats.invalid
        return total, stats

    def _track_failures(self, name: str, all_failed: bool) -> None:
        self.failed_steps[name] = self.failed_steps[name] + 1 if all_failed else 0
        if self.failed_steps[name] >= self.max_failed_steps:
            raise RewardError(f"reward {name} gave no valid value for any sample in {self.failed_steps[name]} steps in "
                              f"a row (see the warnings above); fix it or remove it from reward.functions")
