"""The run folder: one run at a time, and never replaced without being asked.

Invariants:
- `run.lock` ({pid, host, started}) is created exclusively (O_EXCL) and held for the run's life; a second
  run in the folder stops at start with a message naming the holder. A lock left by a dead process on this
  host is taken over with a warning; one from another host is never (it may still be running there).
- A folder holding a run (metrics.jsonl or a checkpoint) is reused only with trainer.resume=true (continue)
  or trainer.overwrite=true (its metrics, checkpoints and TensorBoard logs are deleted first)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import time
from pathlib import Path

log = logging.getLogger(__name__)


class RunDirError(RuntimeError):
    pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


class RunLock:
    def __init__(self, folder: Path):
        self.path = Path(folder) / "run.lock"
        self.held = False

    def acquire(self) -> None:
        me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                self._take_over_if_stale()
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
            self.held = True
            return
        raise RunDirError(f"could not take the lock {self.path}")

    def _take_over_if_stale(self) -> None:
        try:
            holder = json.loads(self.path.read_text())
            pid, host, started = int(holder["pid"]), str(holder["host"]), holder.get("started", "?")
        except (OSError, ValueError, KeyError, TypeError):
            log.warning("%s is unreadable (a run killed while writing it?): taking it over", self.path)
            self.path.unlink(missing_ok=True)
            return
        if host == socket.gethostname() and not _alive(pid):
            log.warning("%s was left by process %d (started %s), which is gone: taking it over", self.path, pid, started)
            self.path.unlink(missing_ok=True)
            return
        raise RunDirError(f"{self.path.parent} is in use by another run: pid {pid} on {host}, started {started}. "
                          f"Wait for it, stop it, or choose another trainer.out_dir (if that process is gone and "
                          f"ran on another host, delete {self.path}).")

    def release(self) -> None:
        if self.held:
            self.path.unlink(missing_ok=True)
            self.held = False


def holds_run(folder: Path) -> bool:
    ckpts = folder / "checkpoints"
    return (folder / "metrics.jsonl").is_file() or (ckpts.is_dir() and any(ckpts.glob("step_*")))


def claim(folder: Path, resume: bool, overwrite: bool) -> RunLock:
    """Locks the folder and checks that this run may use it (see the module invariants)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    lock = RunLock(folder)
    lock.acquire()
    try:
        if holds_run(folder) and not resume:
            if not overwrite:
                raise RunDirError(f"{folder} holds a run already (metrics.jsonl or checkpoints). Continue it with "
                                  f"trainer.resume=true, replace it with trainer.overwrite=true, or choose another "
                                  f"trainer.out_dir.")
            log.warning("trainer.overwrite=true: deleting the previous run's metrics and checkpoints in %s", folder)
            for name in ("checkpoints", "tensorboard"):
                shutil.rmtree(folder / name, ignore_errors=True)
            for name in ("metrics.jsonl", "samples.jsonl", "report.md", "report.png"):
                (folder / name).unlink(missing_ok=True)
    except BaseException:
        lock.release()
        raise
    return lock
