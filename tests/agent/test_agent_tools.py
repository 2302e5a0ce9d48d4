"""Tools layer of agent: schemas from hints, loading by name, the tool pool, environments (the calculator:
test_calculator.py)."""

import asyncio
import sys
import textwrap
import threading
import time

import pytest

from tailrl.agent.calculator import calculator
from tailrl.agent.environment import env_reset, env_reward, env_tools, load_environment
from tailrl.agent.pool import ToolCall, ToolPool, truncate
from tailrl.agent.tool import Tool, ToolError, make_tool
from tailrl.agent.toolbox import load_tools


def lookup(key: str, limit: int = 3, tags: list[str] | None = None) -> str:
    """Look a key up.

    Args:
        key: The key to look up.
        limit: How many hits to return.
        tags: Optional tags to filter by.
    """
    return f"{key}:{limit}"


async def alookup(key: str) -> str:
    """Look a key up asynchronously.

    Args:
        key: The key.
    """
    await asyncio.sleep(0.01)
    return key.upper()


def no_hints(key, limit: int):
    """Has a docstring.

    Args:
        key: The key.
        limit: A limit.
    """


def no_doc(key: str):
    return key


def _module(tmp_path, monkeypatch, name, source):
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)


# --- schemas and loading -----------------------------------------------------------------------------------------

def test_schema_from_hints_and_docstring():
    tool = make_tool(lookup)
    fn = tool.schema["function"]
    assert tool.name == fn["name"] == "lookup" and not tool.is_async
    assert fn["description"] == "Look a key up."
    props = fn["parameters"]["properties"]
    assert props["key"] == {"type": "string", "description": "The key to look up."}
    assert props["limit"]["type"] == "integer" and props["tags"]["type"] == "array"
    assert fn["parameters"]["required"] == ["key"]
    assert make_tool(alookup).is_async and make_tool(lookup, name="find").schema["function"]["name"] == "find"


def test_function_without_hints_or_docstring_is_a_clear_error():
    with pytest.raises(ValueError, match=r"no_hints.*no type hints.*key"):
        make_tool(no_hints)
    with pytest.raises(ValueError, match=r"no_doc.*no docstring"):
        make_tool(no_doc)

    def undocumented_arg(key: str, n: int) -> str:
        """Only one argument documented.

        Args:
            key: The key.
        """
    with pytest.raises(ValueError, match=r"undocumented_arg.*'n'"):
        make_tool(undocumented_arg)


def test_load_tools_builtins_and_user_module(tmp_path, monkeypatch):
    _module(tmp_path, monkeypatch, "agt_user_tools", '''
        def shout(text: str) -> str:
            """Upper-case text.

            Args:
                text: The text.
            """
            return text.upper()
        NOT_CALLABLE = 3
        def bare(x):
            return x
    ''')
    tools = load_tools(["calculator", "python", "agt_user_tools:shout"])
    assert list(tools) == ["calculator", "python", "shout"]
    assert all(isinstance(t, Tool) for t in tools.values())
    assert tools["shout"].fn("hi") == "HI" and tools["calculator"].fn("2+3") == "5"
    file_spec = f"{tmp_path / 'agt_user_tools.py'}:shout"
    assert load_tools([file_spec])["shout"].fn("a") == "A"
    for spec, pattern in [("agt_no_such_module:f", r"agt_no_such_module:f.*does not import"),
                          ("agt_user_tools:missing", r"agt_user_tools:missing.*no attribute"),
                          ("agt_user_tools:NOT_CALLABLE", r"NOT_CALLABLE.*not a function"),
                          ("agt_user_tools:bare", r"bare.*no docstring"),
                          ("search", r"unknown tool 'search'"),
                          ("agt_user_tools:", r"module:name")]:
        with pytest.raises(ValueError, match=pattern):
            load_tools([spec])
    with pytest.raises(ValueError, match=r"calculator.*already loaded"):
        load_tools(["calculator", "calculator"])


def test_user_module_found_in_the_current_directory(tmp_path, monkeypatch):
    (tmp_path / "agt_cwd_tools.py").write_text('def ping(n: int) -> int:\n    """Ping.\n\n    Args:\n'
                                               '        n: A number.\n    """\n    return n + 1\n')
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "agt_cwd_tools", raising=False)
    assert load_tools(["agt_cwd_tools:ping"])["ping"].fn(1) == 2


# --- the pool ------------------------------------------------------------------------------------------------------

def _record_tool(log, lock):
    def nap(seconds: float, label: str = "") -> str:
        """Sleep.

        Args:
            seconds: How long.
            label: A label.
        """
        t0 = time.monotonic()
        time.sleep(seconds)
        with lock:
            log.append((t0, time.monotonic()))
        return label
    return make_tool(nap)


def _max_overlap(spans):
    events = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans])
    best = cur = 0
    for _, d in events:
        cur += d
        best = max(best, cur)
    return best


def test_pool_runs_calls_concurrently_and_keeps_call_order():
    log, lock = [], threading.Lock()
    tools = {"nap": _record_tool(log, lock)}
    with ToolPool(max_parallel_calls=8, timeout_s=10) as pool:
        calls = [ToolCall("nap", {"seconds": s, "label": str(i)}) for i, s in enumerate([0.6, 0.5, 0.4, 0.3])]
        future = pool.submit(tools, calls)
        assert not future.done()  # submit does not wait for the tools
        results = future.result(timeout=10)
    assert [r.text for r in results] == ["0", "1", "2", "3"] and {r.status for r in results} == {"ok"}
    assert max(s for s, _ in log) < min(e for _, e in log)  # every call started before any ended: they overlapped


def test_pool_bounds_parallel_calls():
    log, lock = [], threading.Lock()
    with ToolPool(max_parallel_calls=2, timeout_s=10) as pool:
        pool.submit({"nap": _record_tool(log, lock)}, [ToolCall("nap", {"seconds": 0.1})] * 5).result(timeout=10)
    assert len(log) == 5 and _max_overlap(log) <= 2


def test_pool_faults_come_back_as_tool_text():
    def boom(x: int) -> str:
        """Fail.

        Args:
            x: Anything.
        """
        raise RuntimeError(f"bad {x}")

    def polite(x: int) -> str:
        """Fail politely.

        Args:
            x: Anything.
        """
        raise ToolError(f"no {x}")

    tools = {"boom": make_tool(boom), "polite": make_tool(polite), "lookup": make_tool(lookup),
             "calculator": make_tool(calculator)}
    calls = [ToolCall("boom", {"x": 1}), ToolCall("polite", {"x": 2}), ToolCall("nope", {}),
             ToolCall("lookup", {}), ToolCall("lookup", {"key": "k", "colour": "red"}),
             ToolCall("lookup", {"key": 3}), ToolCall("lookup", {"key": "k", "limit": True}),
             ToolCall("lookup", None, error="invalid JSON at char 3"), ToolCall("lookup", ["k"]),
             ToolCall("calculator", {"expression": "1/0"}), ToolCall("lookup", {"key": "k", "limit": 2})]
    with ToolPool() as pool:
        r = pool.submit(tools, calls).result(timeout=10)
    assert [x.status for x in r] == ["error", "error", "unknown_tool", "bad_arguments", "bad_arguments",
                                     "bad_arguments", "bad_arguments", "malformed", "bad_arguments", "error", "ok"]
    assert r[0].text == "error: RuntimeError: bad 1" and r[1].text == "error: no 2"
    assert "unknown tool 'nope'" in r[2].text and "lookup" in r[2].text
    assert "missing required argument(s) key" in r[3].text and "unknown argument(s) colour" in r[4].text
    assert "key should be string" in r[5].text and "limit should be integer" in r[6].text
    assert "invalid JSON at char 3" in r[7].text and r[9].text == "error: division by zero"
    assert r[10].text == "k:2"


def test_pool_timeouts_sync_hang_is_abandoned_and_async_is_cancelled():
    release = threading.Event()

    def hang(x: int) -> str:
        """Hang until released.

        Args:
            x: Anything.
        """
        release.wait(30)
        return "late"

    cancelled = []

    async def slow(x: int) -> str:
        """Sleep long.

        Args:
            x: Anything.
        """
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.append(x)
            raise
        return "late"

    tools = {"hang": make_tool(hang), "slow": make_tool(slow), "alookup": make_tool(alookup)}
    try:
        with ToolPool(max_parallel_calls=1, timeout_s=0.5) as pool:
            r = pool.submit(tools, [ToolCall("hang", {"x": 1}), ToolCall("slow", {"x": 2}),
                                    ToolCall("alookup", {"key": "ok"})]).result(timeout=20)
            assert [x.status for x in r] == ["timeout", "timeout", "ok"] and r[2].text == "OK"
            assert "timed out after 0.5 s" in r[0].text and cancelled == [2]
            assert pool.abandoned == 1 and pool.hung_threads == 1
            # the hung thread gave its slot back: with max_parallel_calls=1 a new call still runs
            assert pool.submit(tools, [ToolCall("alookup", {"key": "b"})]).result(timeout=10)[0].text == "B"
    finally:
        release.set()


def test_pool_truncates_and_serializes():
    def big(n: int) -> str:
        """Many characters.

        Args:
            n: How many.
        """
        return "".join(chr(97 + i % 26) for i in range(n))

    def structured(n: int) -> dict:
        """A dict.

        Args:
            n: A number.
        """
        return {"n": n, "list": [1, 2]}

    tools = {"big": make_tool(big), "structured": make_tool(structured)}
    with ToolPool(max_chars=40, truncate_side="left") as pool:
        r = pool.submit(tools, [ToolCall("big", {"n": 1000}), ToolCall("structured", {"n": 3})]).result(timeout=10)
    assert len(r[0].text) == 40 and r[0].text.endswith(big(1000)[-26:]) and r[0].text.startswith("...(truncated)")
    assert r[1].text == '{"n": 3, "list": [1, 2]}'
    text = big(500)
    for side in ("left", "right", "middle"):
        for n in (1, 10, 14, 15, 40, 499, 500, 600):
            out = truncate(text, n, side)
            assert len(out) <= n and (out == text) == (n >= len(text))
    assert truncate(text, 100, "middle").startswith(text[:43]) and truncate(text, 100, "middle").endswith(text[-43:])
    with pytest.raises(ValueError, match="truncate_side"):
        ToolPool(truncate_side="top")


# --- environments --------------------------------------------------------------------------------------------------

ENV_SOURCE = '''
    class Counter:
        """Counts toward a target."""

        def __init__(self):
            self.total = 0
            self.target = None

        def reset(self, row: dict):
            self.target = row["target"]
            return f"Reach {self.target}."

        def add(self, n: int) -> str:
            """Add to the running total.

            Args:
                n: The amount to add.
            """
            self.total += n
            return str(self.total)

        def total_so_far(self) -> int:
            """The running total."""
            return self.total

        def _helper(self):
            return None

        def reward(self) -> float:
            return 1.0 if self.total == self.target else 0.0

    class NeedsArgs:
        def __init__(self, x):
            pass

    not_a_class = 3
'''


def test_environment_keeps_state_across_calls_one_instance_per_trajectory(tmp_path, monkeypatch):
    _module(tmp_path, monkeypatch, "agt_envs", ENV_SOURCE)
    cls = load_environment("agt_envs:Counter")
    a, b = cls(), cls()
    assert env_reset(a, {"target": 5}) == "Reach 5." and env_reset(b, {"target": 1}) == "Reach 1."
    tools_a, tools_b = env_tools(a), env_tools(b)
    assert list(tools_a) == ["add", "total_so_far"]  # no reset, reward or _private
    assert "self" not in tools_a["add"].parameters["properties"]
    with ToolPool() as pool:
        assert pool.submit(tools_a, [ToolCall("add", {"n": 2})]).result(timeout=10)[0].text == "2"
        assert pool.submit(tools_a, [ToolCall("add", {"n": 3})]).result(timeout=10)[0].text == "5"
        assert pool.submit(tools_b, [ToolCall("add", {"n": 1})]).result(timeout=10)[0].text == "1"
        assert pool.submit(tools_a, [ToolCall("total_so_far", {})]).result(timeout=10)[0].text == "5"
    assert env_reward(a) == 1.0 and env_reward(b) == 1.0 and env_reward(object()) is None
    for spec, pattern in [("agt_envs:NeedsArgs", "must take no arguments"), ("agt_envs:not_a_class", "not a class"),
                          ("agt_envs:Missing", "no attribute"), ("agt_no_env_module:X", "does not import")]:
        with pytest.raises(ValueError, match=pattern):
            load_environment(spec)
