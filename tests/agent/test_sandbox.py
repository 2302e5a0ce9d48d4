"""The python sandbox: every escape the issue names returns tool text, leaves no process behind, harms nothing.

What is guaranteed everywhere is asserted everywhere; what needs the kernel's namespaces (no network, no process
outside to signal) is asserted where `isolation` reports them, and skipped with the reason elsewhere.
"""

import os
import socket

import pytest

from tailrl.agent.pool import ToolCall, ToolPool
from tailrl.agent.sandbox import SandboxLimits, describe, make_python_tool, python, run_sandboxed
from tailrl.agent.toolbox import load_tools

FAST = SandboxLimits(wall_s=3.0, cpu_s=2, max_processes=8)
FALLBACK = SandboxLimits(wall_s=3.0, cpu_s=2, max_processes=8, namespaces=False)  # rlimits only, as without userns


def _alive_with_tag(tag: str) -> list[int]:
    """Pids of processes whose command line carries the sandbox run's tag."""
    pids = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                with open(f"/proc/{p}/cmdline", "rb") as f:
                    if tag.encode() in f.read():
                        pids.append(int(p))
            except OSError:
                pass
    return pids


def run(code, limits=FAST):
    result = run_sandboxed(code, limits)
    assert _alive_with_tag(result.tag) == [], "a sandbox process outlived its run"
    return result


def test_output_final_expression_and_traceback():
    r = run("print('hi')\n6 * 7")
    assert r.output == "hi\n42\n" and r.exit_code == 0 and not r.timed_out and r.signal is None
    r = run("x = 1\nraise ValueError('bad value')")
    assert r.exit_code == 1 and "ValueError: bad value" in r.output and 'File "<code>", line 2' in r.output
    assert describe(r, FAST).endswith("[exit code 1]")
    assert run("import sys; sys.exit(3)").exit_code == 3
    assert python("print(sum(range(10)))") == "45\n" and python("pass") == "(no output)"


def test_infinite_loop_is_stopped():
    limits = SandboxLimits(wall_s=3.0, cpu_s=1)
    r = run("while True:\n    pass", limits)
    assert r.timed_out or r.signal is not None  # the CPU limit (1 s) or the wall clock (3 s), whichever first
    assert "[killed:" in describe(r, limits)
    r = run("import time\ntime.sleep(60)", SandboxLimits(wall_s=1.0))  # no CPU used: only the wall clock stops it
    assert r.timed_out and describe(r, SandboxLimits(wall_s=1.0)).endswith("[killed: wall-clock limit of 1 s]")


def test_allocating_20_gb_fails_inside():
    r = run("x = bytearray(20 * 1024**3)\nprint('allocated')")
    assert "MemoryError" in r.output and "allocated" not in r.output and r.exit_code == 1


@pytest.mark.parametrize("limits", [FAST, FALLBACK], ids=["namespaces", "rlimits-only"])
def test_fork_bomb_is_bounded(limits):
    counted = run("import os, time\nn = 0\nwhile True:\n    try:\n        pid = os.fork()\n"
                  "    except OSError as e:\n        print('fork failed after', n, e.errno)\n        break\n"
                  "    if pid == 0:\n        time.sleep(60)\n        os._exit(0)\n    n += 1\n", limits)
    words = counted.output.split()
    assert words[:3] == ["fork", "failed", "after"] and 1 <= int(words[3]) <= limits.max_processes
    # the real thing: every process forks forever; the limit holds it and the wall clock ends it
    bomb = run("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
               SandboxLimits(wall_s=1.5, cpu_s=2, max_processes=8, namespaces=limits.namespaces))
    assert bomb.timed_out or bomb.signal is not None


def test_printing_10_mb_is_truncated():
    r = run("import sys\n_ = sys.stdout.write('x' * 10_000_000 + 'END')")
    assert r.output_bytes == 10_000_003 and r.truncated and r.exit_code == 0
    assert len(r.output) < FAST.output_bytes + 100 and r.output.endswith("END") and "output truncated" in r.output


def test_file_size_limit():
    r = run("open('big', 'wb').write(b'0' * (4 * 1024 * 1024))", SandboxLimits(file_size_mb=1))
    assert "File too large" in r.output


def test_cwd_is_empty_env_is_cleared_and_workdir_is_removed(tmp_path, monkeypatch):
    monkeypatch.setenv("TAILRL_TEST_SECRET", "s3cret")
    secret = tmp_path / "secret.txt"
    secret.write_text("the secret")
    r = run("import os, json\nprint(json.dumps([os.getcwd(), os.listdir('.'), dict(os.environ)]))\n"
            "open('scratch.txt', 'w').write('x')\n"
            f"try:\n    print(open({str(secret)!r}).read())\nexcept OSError as e:\n    print('denied', e.errno)\n")
    import json
    first, second = r.output.splitlines()[:2]
    cwd, listing, env = json.loads(first)
    assert listing == [] and "TAILRL_TEST_SECRET" not in env and set(env) <= {"PATH", "HOME", "TMPDIR", "LANG"}
    assert env["HOME"] == cwd and not os.path.exists(cwd)  # its scratch file went with it
    if r.isolation.get("user") == "nobody":  # run as root, the code runs as nobody: pytest's 0700 tmp is closed
        assert second.startswith("denied")
    else:  # the same user: rlimits do not stop reads, and the docs say so
        assert second in ("the secret", ) or second.startswith("denied")


@pytest.mark.parametrize("limits", [FAST, FALLBACK], ids=["namespaces", "rlimits-only"])
def test_killing_its_parent_or_group_does_not_touch_the_caller(limits):
    me = os.getpid()
    r = run("import os\nos.kill(os.getppid(), 9)\nprint('still here')", limits)
    assert os.getpid() == me
    if r.isolation.get("pid_ns"):  # its parent is the namespace's init, which ignores signals from inside
        assert r.output == "still here\n"
    for code in ("import os\nos.kill(0, 9)", "import os\nos.killpg(os.getpgid(0), 9)"):
        r = run(code, limits)
        assert r.signal == 9 and "[killed:" in describe(r, FAST)
    r = run("import os, signal\nos.kill(os.getppid(), signal.SIGTERM)\nos.kill(os.getppid(), signal.SIGSTOP)\n"
            "print('done')", limits)
    if r.isolation.get("pid_ns"):
        assert r.output == "done\n"
    else:  # its parent (the intermediate) ends or stops: the run ends, at the latest at the wall clock
        assert r.timed_out or r.signal is not None or r.output.endswith("done\n")


def test_kill_all_and_network_need_namespaces():
    iso = run("pass").isolation
    if not (iso.get("pid_ns") and iso.get("net_ns")):
        pytest.skip(f"no user/PID/network namespaces here ({iso.get('unshare_error')}): docs say what is not isolated")
    probe = run("import os\nprint(os.getpid())")
    assert probe.output == "2\n"  # PID 2 of its own namespace: kill(-1) below reaches no process outside it
    # kill(-1) signals every process the sender may: here the namespace's own, a sleeping child, and nothing else
    r = run("import os, time\npid = os.fork()\nif pid == 0:\n    time.sleep(30)\n    os._exit(0)\n"
            "os.kill(-1, 9)\n_, st = os.waitpid(pid, 0)\nprint('survived', os.WTERMSIG(st))")
    assert r.output == "survived 9\n"
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    try:
        port = server.getsockname()[1]
        r = run(f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
                "    print('connected')\nexcept OSError as e:\n    print('no network', e.errno)")
        assert r.output.startswith("no network")
    finally:
        server.close()


def test_python_tool_through_the_pool():
    tools = load_tools(["python"])
    with ToolPool(timeout_s=30) as pool:
        r = pool.submit(tools, [ToolCall("python", {"code": "print(2**100)"}),
                                ToolCall("python", {"code": "1/0"})]).result(timeout=60)
    assert r[0].status == "ok" and r[0].text == f"{2**100}\n"
    assert r[1].status == "ok" and "ZeroDivisionError" in r[1].text and r[1].text.endswith("[exit code 1]")


def test_sandbox_timeout_is_a_pool_timeout_with_the_output():
    tools = {"python": make_python_tool(SandboxLimits(wall_s=2.0))}
    assert tools["python"].schema == load_tools(["python"])["python"].schema
    with ToolPool(timeout_s=30) as pool:
        r = pool.submit(tools, [ToolCall("python", {"code": "print('started')\nimport time\ntime.sleep(30)"})])
        (result,) = r.result(timeout=60)
    assert result.status == "timeout" and result.text == "started\n[killed: wall-clock limit of 2 s]"
