"""Ctrl-C and SIGTERM during a run: stop cleanly, never in the middle of a write.

Invariant: inside `critical()` (a checkpoint save, a metrics line) a signal is held and raised as
`Interrupted` when the section ends; elsewhere it is raised at once. Every write of a run is atomic or
append-only, so stopping anywhere else loses at most the step in progress."""

from __future__ import annotations

import contextlib
import signal
import threading

EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}


class Interrupted(BaseException):
    """A BaseException, as KeyboardInterrupt is: the failure isolation of drafters, rewards and requests
    (`except Exception`) must never swallow a stop request."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.step: int | None = None  # the last finished step, filled in by the run
        self.latest = None  # the latest checkpoint folder, or None

    @property
    def exit_code(self) -> int:
        return EXIT_CODES.get(self.signum, 128 + self.signum)


class StopOnSignal:
    def __init__(self, signals=(signal.SIGINT, signal.SIGTERM)):
        self.signals = signals
        self.previous: dict = {}
        self.pending: int | None = None
        self.depth = 0

    def _handle(self, signum, frame) -> None:
        if self.depth:
            self.pending = signum
            return
        raise Interrupted(signum)

    @contextlib.contextmanager
    def critical(self):
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
        if not self.depth and self.pending is not None:
            signum, self.pending = self.pending, None
            raise Interrupted(signum)

    def __enter__(self) -> "StopOnSignal":
        if threading.current_thread() is threading.main_thread():  # handlers can only be set there
            for s in self.signals:
                self.previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self.previous.items():
            signal.signal(s, h)
        self.previous.clear()
