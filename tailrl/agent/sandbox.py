"""The built-in `python` tool: runs code in a separate, limited process and returns what it printed.

What holds (each a test in tests/agent/test_sandbox.py): the code runs in a fresh `python -I -S` (no site-packages, no
user site, PYTHON* variables ignored) in a new session, with a cleared environment and an empty temporary working
directory that is removed afterwards; rlimits on CPU time, address space, processes (RLIMIT_NPROC, set before the
code runs), file size and open files; a wall-clock timeout that SIGKILLs the whole process group; stdout + stderr
captured, of which the first and last `output_bytes / 2` bytes are kept. Where the kernel allows unprivileged user
namespaces (checked at every run and reported in `SandboxResult.isolation`), the code also runs in new user,
network and PID namespaces: no network interface but a loopback that is down, no process outside it to signal,
and every process it started dies with it. Run as root, the code runs as `nobody`. What does NOT hold: reads
(and writes) of files the code's user may access anywhere on the machine — rlimits do not stop them; without
namespaces, the network and `kill(-1)` to every process of the same user. See docs/agents.md "Tools".
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field

from .sandbox_boot import SOURCE
from .tool import ToolTimeout

NOBODY = 65534


@dataclass
class SandboxLimits:
    wall_s: float = 10.0  # wall clock, then SIGKILL to the process group (and the PID namespace)
    cpu_s: int = 5  # RLIMIT_CPU: SIGXCPU at this many CPU seconds, SIGKILL a second later
    memory_mb: int = 512  # RLIMIT_AS, per process
    max_processes: int = 8  # processes (threads count) the code may start: RLIMIT_NPROC
    file_size_mb: int = 16  # RLIMIT_FSIZE: the largest file the code may write
    max_open_files: int = 64  # RLIMIT_NOFILE
    output_bytes: int = 16_384  # of stdout+stderr kept: the first and the last half
    max_code_chars: int = 100_000
    namespaces: bool = True  # try new user/network/PID namespaces (False: the rlimits-only fallback, for tests)
    python: str = field(default_factory=lambda: sys.executable)

    def __post_init__(self):
        for name in ("wall_s", "cpu_s", "memory_mb", "max_processes", "file_size_mb", "max_open_files",
                     "output_bytes", "max_code_chars"):
            if not getattr(self, name) > 0:
                raise ValueError(f"SandboxLimits.{name} must be > 0, got {getattr(self, name)}")


@dataclass
class SandboxResult:
    output: str  # stdout + stderr as written, truncated in the middle past `output_bytes`
    exit_code: int | None  # the code's exit status; None when it ended by a signal or was killed
    signal: int | None  # the signal that ended the code (or the sandbox), if any
    timed_out: bool  # killed at the wall-clock limit
    output_bytes: int  # all bytes printed, kept or not
    seconds: float
    isolation: dict  # what the bootstrap achieved: user, user_ns, net_ns, pid_ns, nproc
    tag: str  # in the sandbox's argv; no process carries it once run_sandboxed returns (tests check)

    @property
    def truncated(self) -> bool:
        return self.output_bytes > len(self.output.encode("utf-8", "replace"))


class _Reader(threading.Thread):
    """Drains a pipe to EOF, keeping the head and a rolling tail, so a flood of output never blocks the code."""

    def __init__(self, pipe, keep: int):
        super().__init__(daemon=True, name="sandbox-output")
        self.pipe, self.half = pipe, max(1, keep // 2)
        self.head, self.tail, self.total = bytearray(), bytearray(), 0

    def run(self):
        fd = self.pipe.fileno()
        while True:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                return
            if not chunk:
                return
            self.total += len(chunk)
            room = self.half - len(self.head)
            if room > 0:
                self.head += chunk[:room]
                chunk = chunk[room:]
            if chunk:
                self.tail += chunk
                if len(self.tail) > 2 * self.half:
                    del self.tail[:-self.half]


def _wait_exit(pid: int, deadline: float) -> bool:
    """True once `pid` has exited (left unreaped, so its process-group id stays ours), False at the deadline."""
    try:
        pidfd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        pidfd = None
    try:
        while True:
            if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if pidfd is not None:
                select.select([pidfd], [], [], left)
            else:
                time.sleep(min(left, 0.01))
    finally:
        if pidfd is not None:
            os.close(pidfd)


def _killpg(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_sandboxed(code: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """Run `code` in the sandbox and wait for it (at most `limits.wall_s` plus a moment); never raises for
    anything the code does."""
    limits = limits or SandboxLimits()
    if len(code) > limits.max_code_chars:
        raise ValueError(f"code too long ({len(code)} characters, at most {limits.max_code_chars})")
    tag = f"tailrl-sandbox-{uuid.uuid4().hex[:12]}"
    cfg = {k: v for k, v in asdict(limits).items() if k != "python"} | {"nobody": NOBODY}
    workdir = tempfile.mkdtemp(prefix="tailrl-sandbox-")
    t0 = time.monotonic()
    try:
        if os.geteuid() == 0:
            os.chown(workdir, NOBODY, NOBODY)
        env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8"}
        proc = subprocess.Popen([limits.python, "-I", "-S", "-u", "-c", SOURCE, json.dumps(cfg), tag],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                cwd=workdir, env=env, start_new_session=True, close_fds=True)
        reader = _Reader(proc.stdout, limits.output_bytes)
        reader.start()
        exited = False
        try:
            try:
                proc.stdin.write(code.encode("utf-8", "replace"))
                proc.stdin.close()
            except OSError:  # the bootstrap died before reading: its output says why
                pass
            exited = _wait_exit(proc.pid, t0 + limits.wall_s)
        finally:  # also when this thread is interrupted: nothing of the sandbox outlives the call
            _killpg(proc.pid)  # the code's leftovers (and, on timeout, the code): the pgid is ours while unreaped
            rc = proc.wait()
        reader.join(2.0)  # EOF once every holder of the pipe is gone; a process that escaped the group may not be
        if not reader.is_alive():
            proc.stdout.close()
        head, tail, total = bytes(reader.head), bytes(reader.tail[-reader.half:]), reader.total
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    isolation, head = _split_header(head)
    total -= len(bytes(reader.head)) - len(head)
    if total > len(head) + len(tail):
        kept = head.decode("utf-8", "replace") + f"\n...[output truncated: {total} bytes]...\n" + \
            tail.decode("utf-8", "replace")
    else:
        kept = (head + tail).decode("utf-8", "replace")
    sig = -rc if rc < 0 else (rc - 128 if rc > 128 else None)
    return SandboxResult(output=kept, exit_code=rc if 0 <= rc <= 128 else None, signal=sig,
                         timed_out=not exited, output_bytes=total, seconds=time.monotonic() - t0,
                         isolation=isolation, tag=tag)


def _split_header(head: bytes) -> tuple[dict, bytes]:
    line, sep, rest = head.partition(b"\n")
    if sep and line.startswith(b"{"):
        try:
            return json.loads(line), rest
        except ValueError:
            pass
    return {}, head


_SIGNAL_NOTES = {signal.SIGXCPU: "CPU time limit", signal.SIGKILL: "SIGKILL (CPU time limit, or killed)",
                 signal.SIGXFSZ: "file size limit", signal.SIGSEGV: "segmentation fault"}


def describe(result: SandboxResult, limits: SandboxLimits) -> str:
    """The observation text for the model: the output, then one bracketed line saying how the run ended."""
    text = result.output if result.output.strip() else "(no output)"
    if result.timed_out:
        note = f"[killed: wall-clock limit of {limits.wall_s:g} s]"
    elif result.signal is not None:
        note = f"[killed: {_SIGNAL_NOTES.get(result.signal, signal.Signals(result.signal).name)}]"
    elif result.exit_code:
        note = f"[exit code {result.exit_code}]"
    else:
        return text
    return text.rstrip("\n") + "\n" + note


def python(code: str) -> str:
    """Run Python code in a sandbox and return what it printed; the value of a final expression is printed too.

    Args:
        code: Python source code (standard library only), e.g. "print(sum(range(10)))".
    """
    return _python(code, DEFAULT_LIMITS)


def make_python_tool(limits: SandboxLimits):
    """The `python` tool with other limits (same name, schema and docstring)."""
    from .tool import make_tool

    def python(code: str) -> str:
        return _python(code, limits)
    python.__doc__ = globals()["python"].__doc__
    return make_tool(python, name="python")


def _python(code: str, limits: SandboxLimits) -> str:
    result = run_sandboxed(code, limits)
    text = describe(result, limits)
    if result.timed_out or result.signal == signal.SIGXCPU:
        raise ToolTimeout(text)  # the pool counts it as a timeout; the model still reads the output and the note
    return text


DEFAULT_LIMITS = SandboxLimits()
