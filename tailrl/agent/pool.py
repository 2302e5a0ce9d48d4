"""The tool pool: a turn's tool calls run concurrently, off the decode loop, and always come back as text.

`ToolPool.submit(tools, calls)` returns at once with a Future of one `ToolResult` per call, in call order, so the
engine keeps decoding the other trajectories while a tool runs (the lock-step rollout that TRL's GRPOTrainer does,
all tools after all generation, is what this avoids; ROLL Flash arXiv:2510.11345, Heddle arXiv:2603.28101).
Invariant: a call never raises and never hangs the caller: an unknown tool, arguments that do not match the
schema, a malformed call, an exception and a timeout each come back as tool text with their status. A sync tool
that hangs past `timeout_s` is abandoned (Python cannot kill a thread): its slot is freed, it is counted in
`abandoned`, and it keeps running in a daemon thread that does not hold up the interpreter's exit.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

from .tool import Tool, ToolError, ToolTimeout

STATUSES = ("ok", "error", "timeout", "unknown_tool", "bad_arguments", "malformed")
TRUNCATE_SIDES = ("left", "right", "middle")
TRUNCATED = "...(truncated)"


@dataclass
class ToolCall:
    name: str
    arguments: dict | None  # None with `error` set: the call did not parse; None without: no arguments
    error: str | None = None  # the parser's message for a malformed call


@dataclass
class ToolResult:
    text: str
    status: str  # one of STATUSES
    seconds: float


def truncate(text: str, max_chars: int | None, side: str = "right") -> str:
    """`text` cut to at most `max_chars` characters, marker included, keeping the start ("right": cut the right
    end), the end ("left") or both ends ("middle"), as verl's `tool_response_truncate_side`."""
    if max_chars is None or len(text) <= max_chars:
        return text
    if max_chars <= len(TRUNCATED):
        return text[:max_chars] if side != "left" else text[len(text) - max_chars:]
    keep = max_chars - len(TRUNCATED)
    if side == "right":
        return text[:keep] + TRUNCATED
    if side == "left":
        return TRUNCATED + text[len(text) - keep:]
    head = (keep + 1) // 2
    return text[:head] + TRUNCATED + text[len(text) - (keep - head):]


_JSON_TYPES = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
               "array": (list, tuple), "object": (dict,), "null": (type(None),)}


def _type_ok(value, types) -> bool:
    for t in types if isinstance(types, list) else [types]:
        py = _JSON_TYPES.get(t)
        if py is None:
            return True  # a type we do not check
        if isinstance(value, bool) and t in ("integer", "number"):
            continue
        if isinstance(value, py):
            return True
    return False


def check_arguments(tool: Tool, arguments: dict) -> str | None:
    """None if `arguments` fit the tool's schema (required names present, no unknown names, top-level JSON types),
    else the message for the model."""
    params = tool.parameters
    props = params.get("properties", {})
    missing = [n for n in params.get("required", []) if n not in arguments]
    unknown = [n for n in arguments if n not in props]
    problems = []
    if missing:
        problems.append(f"missing required argument(s) {', '.join(missing)}")
    if unknown:
        problems.append(f"unknown argument(s) {', '.join(unknown)} (expected: {', '.join(props) or 'none'})")
    for n, v in arguments.items():
        t = props.get(n, {}).get("type")
        if n in props and t is not None and not _type_ok(v, t):
            problems.append(f"argument {n} should be {t if isinstance(t, str) else ' or '.join(t)}, "
                            f"got {type(v).__name__}")
    return f"error: {'; '.join(problems)} for tool {tool.name}" if problems else None


def to_text(value) -> str:
    """A tool's return value as observation text: str as is, None as "", anything else as JSON (or str)."""
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    try:
        return json.dumps(value, ensure_ascii=False, default=str)
    except (TypeError, ValueError):
        return str(value)


def error_text(exc: BaseException) -> str:
    if isinstance(exc, ToolError):
        return f"error: {exc}"
    return f"error: {type(exc).__name__}: {exc}"


class ToolPool:
    """Runs tool calls on at most `max_parallel_calls` threads at once; see the module docstring for the contract."""

    def __init__(self, max_parallel_calls: int = 8, timeout_s: float = 30.0, max_chars: int | None = None,
                 truncate_side: str = "right"):
        if max_parallel_calls < 1:
            raise ValueError(f"max_parallel_calls must be >= 1, got {max_parallel_calls}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if max_chars is not None and max_chars < 1:
            raise ValueError(f"max_chars must be >= 1 or None, got {max_chars}")
        if truncate_side not in TRUNCATE_SIDES:
            raise ValueError(f"truncate_side must be one of {', '.join(TRUNCATE_SIDES)}, got {truncate_side!r}")
        self.max_parallel_calls = max_parallel_calls
        self.timeout_s = timeout_s
        self.max_chars = max_chars
        self.truncate_side = truncate_side
        self._slots = threading.BoundedSemaphore(max_parallel_calls)
        self._lock = threading.Lock()
        self._closed = False
        self.abandoned = 0  # calls whose thread outlived its timeout (counted once each)
        self._hung: list[threading.Thread] = []

    @property
    def hung_threads(self) -> int:
        """Abandoned tool threads still running now."""
        with self._lock:
            self._hung = [t for t in self._hung if t.is_alive()]
            return len(self._hung)

    def submit(self, tools: dict[str, Tool], calls: list[ToolCall]) -> Future:
        """A Future of `list[ToolResult]` in call order; returns at once, the calls run on the pool's threads."""
        if self._closed:
            raise RuntimeError("ToolPool is closed")
        future: Future = Future()
        future.set_running_or_notify_cancel()
        results: list[ToolResult | None] = [None] * len(calls)
        if not calls:
            future.set_result([])
            return future
        left = [len(calls)]

        def done(i: int, result: ToolResult) -> None:
            result.text = truncate(result.text, self.max_chars, self.truncate_side)
            results[i] = result
            with self._lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                future.set_result(results)

        for i, call in enumerate(calls):
            threading.Thread(target=self._supervise, args=(tools, call, i, done), daemon=True,
                             name=f"tool-call-{i}").start()
        return future

    def _supervise(self, tools: dict[str, Tool], call: ToolCall, i: int, done) -> None:
        t0 = time.perf_counter()
        try:
            early = self._precheck(tools, call)
            if early is not None:
                done(i, ToolResult(early[0], early[1], time.perf_counter() - t0))
                return
            with self._slots:
                done(i, self._run(tools[call.name], call.arguments or {}))
        except BaseException as e:  # the pool's own bug must still answer the call
            done(i, ToolResult(error_text(e), "error", time.perf_counter() - t0))

    @staticmethod
    def _precheck(tools: dict[str, Tool], call: ToolCall) -> tuple[str, str] | None:
        if call.error is not None:
            return f"error: malformed tool call: {call.error}", "malformed"
        if not isinstance(call.name, str) or call.name not in tools:
            names = ", ".join(tools) or "none"
            return f"error: unknown tool {call.name!r}; available tools: {names}", "unknown_tool"
        if call.arguments is not None and not isinstance(call.arguments, dict):
            return (f"error: arguments of tool {call.name} must be an object, "
                    f"got {type(call.arguments).__name__}"), "bad_arguments"
        bad = check_arguments(tools[call.name], call.arguments or {})
        return (bad, "bad_arguments") if bad else None

    def _run(self, tool: Tool, arguments: dict) -> ToolResult:
        box: dict = {}
        t0 = time.perf_counter()

        def work() -> None:
            try:
                if tool.is_async:
                    box["value"] = asyncio.run(asyncio.wait_for(tool.fn(**arguments), self.timeout_s))
                else:
                    box["value"] = tool.fn(**arguments)
            except ToolTimeout as e:
                box["own_timeout"] = e
            except (asyncio.TimeoutError, TimeoutError) as e:
                box["timeout"] = e
            except BaseException as e:
                box["error"] = e

        worker = threading.Thread(target=work, daemon=True, name=f"tool-{tool.name}")
        worker.start()
        # async tools are cancelled by wait_for; the margin lets that cancellation land before we give up
        worker.join(self.timeout_s + (1.0 if tool.is_async else 0.0))
        seconds = time.perf_counter() - t0
        if worker.is_alive():
            with self._lock:
                self.abandoned += 1
                self._hung.append(worker)
            return ToolResult(f"error: tool {tool.name} timed out after {self.timeout_s:g} s", "timeout", seconds)
        if "timeout" in box:
            return ToolResult(f"error: tool {tool.name} timed out after {self.timeout_s:g} s", "timeout", seconds)
        if "own_timeout" in box:
            return ToolResult(str(box["own_timeout"]), "timeout", seconds)
        if "error" in box:
            return ToolResult(error_text(box["error"]), "error", seconds)
        return ToolResult(to_text(box.get("value")), "ok", seconds)

    def close(self) -> None:
        """No new submissions; calls in flight finish (or time out) on their own daemon threads."""
        self._closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
