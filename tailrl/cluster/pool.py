"""Calls to workers that may fail: Ray actors (`RayPool`) or in-process workers (`LocalPool`, for tests and
for tools that want the driver's logic without Ray). `gather` returns results and failures, never raises for
a worker: a worker that raised, died, or did not answer within the timeout is reported failed (and, on Ray,
killed), and the caller decides what to re-run."""

from __future__ import annotations

import logging

from .workers import RolloutWorker, WorkerSpec, spawn, start_ray

log = logging.getLogger(__name__)


class _Pool:
    """What both pools share: a blocking call on one worker through the subclass's submit/gather."""

    def call(self, i: int, method: str, *args, timeout: float = 600.0):
        ok, failed = self.gather({i: self.submit(i, method, *args)}, timeout)
        if i in failed:
            raise WorkerFailed(i, failed[i])
        return ok[i]


class LocalPool(_Pool):
    def __init__(self, spec: WorkerSpec, n: int):
        self.spec = spec
        self.workers = [RolloutWorker(spec, i) for i in range(n)]
        self.dead: set[int] = set()

    def __len__(self) -> int:
        return len(self.workers)

    def submit(self, i: int, method: str, *args):
        try:
            return ("ok", getattr(self.workers[i], method)(*args))
        except Exception as e:  # noqa: BLE001 - a worker's failure is data for the driver
            return ("err", e)

    def gather(self, calls: dict[int, object], timeout: float) -> tuple[dict[int, object], dict[int, str]]:
        ok, failed = {}, {}
        for i, (kind, value) in calls.items():
            if kind == "ok":
                ok[i] = value
            else:
                failed[i] = repr(value)
                self.dead.add(i)
        return ok, failed

    def first(self, calls: dict[int, object], timeout: float) -> tuple[dict[int, object], dict[int, str]]:
        """The calls that have answered (in process: all of them, each ran when submitted)."""
        return self.gather(calls, timeout)

    def put(self, value):
        return value

    def restart(self, i: int) -> None:
        self.workers[i] = RolloutWorker(self.spec, i)
        self.dead.discard(i)

    def shutdown(self) -> None:
        self.workers = []


class RayPool(_Pool):
    def __init__(self, spec: WorkerSpec, n: int, address: str = "", start_timeout_s: float = 600.0):
        import ray

        start_ray(address)
        self.ray, self.spec = ray, spec
        self.gpus = 1.0 if ray.cluster_resources().get("GPU", 0) >= 1 else 0.0
        self.handles = [spawn(spec, i, self.gpus) for i in range(n)]
        self.dead: set[int] = set()
        ready, _ = ray.wait([h.ping.remote() for h in self.handles], num_returns=n, timeout=start_timeout_s)
        if len(ready) < n:  # Ray holds actors until their resources are free: fail with the reason, not a hang
            self.shutdown()
            need = f"{self.gpus:g} GPU" if self.gpus else f"{spec.threads} CPU"
            raise RuntimeError(f"only {len(ready)} of {n} rollout workers started within {start_timeout_s:.0f} s; each "
                               f"needs {need} and Ray has {ray.available_resources()} free (lower rollout.workers or "
                               "rollout.worker_threads)")
        ray.get(ready)

    def __len__(self) -> int:
        return len(self.handles)

    def submit(self, i: int, method: str, *args):
        return getattr(self.handles[i], method).remote(*args)

    def gather(self, calls: dict[int, object], timeout: float) -> tuple[dict[int, object], dict[int, str]]:
        refs = list(calls.values())
        ready, _ = self.ray.wait(refs, num_returns=len(refs), timeout=timeout)
        ready = set(ready)
        ok, failed = {}, {}
        for i, ref in calls.items():
            if ref not in ready:
                failed[i] = f"no answer within {timeout:.0f} s"
                self.kill(i)
                continue
            try:
                ok[i] = self.ray.get(ref)
            except Exception as e:  # noqa: BLE001 - RayActorError, or the worker's own exception
                failed[i] = repr(e)
                self.kill(i)
        return ok, failed

    def first(self, calls: dict[int, object], timeout: float) -> tuple[dict[int, object], dict[int, str]]:
        """As gather, but for the calls that have answered once the first one has (the others stay in flight, the
        caller's to wait for again); none within the timeout: every one failed."""
        refs = list(calls.values())
        ready, _ = self.ray.wait(refs, num_returns=1, timeout=timeout)
        if not ready:
            return self.gather(calls, 0.0)
        ready, _ = self.ray.wait(refs, num_returns=len(refs), timeout=0)
        ready = set(ready)
        return self.gather({i: ref for i, ref in calls.items() if ref in ready}, timeout)

    def put(self, value):
        return self.ray.put(value)

    def kill(self, i: int) -> None:
        self.dead.add(i)
        try:
            self.ray.kill(self.handles[i], no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass

    def restart(self, i: int) -> None:
        self.handles[i] = spawn(self.spec, i, self.gpus)
        self.ray.get(self.handles[i].ping.remote())
        self.dead.discard(i)

    def shutdown(self) -> None:
        for i in range(len(self.handles)):
            self.kill(i)
        self.handles = []


class WorkerFailed(RuntimeError):
    def __init__(self, index: int, why: str):
        super().__init__(f"worker {index} failed: {why}")
        self.index = index
