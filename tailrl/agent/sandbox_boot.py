"""The sandbox's first process (run as `python -I -S -u -c SOURCE cfg tag`; stdlib only, no tailrl imports).

Three processes: this bootstrap B (the runner's child, in a session of its own) drops root if it has it, enters
new user + network + PID namespaces where the kernel allows it, sets the rlimits, prints one JSON header line
and forks I, which is PID 1 of the new PID namespace; I forks U, which runs the code and is the only process
that executes it. U's parent is I (or B), never the runner, and when I ends the kernel kills every process left
in the namespace. Exit status of B: U's exit code, or 128 + the signal that ended U.
"""

SOURCE = r'''
import json, os, resource, sys
cfg = json.loads(sys.argv[1])
code = sys.stdin.buffer.read().decode("utf-8", "replace")
_fd = os.open(os.devnull, os.O_RDONLY); os.dup2(_fd, 0); os.close(_fd)
iso = {"user": "caller", "user_ns": False, "net_ns": False, "pid_ns": False}
import ast, builtins, linecache, traceback
try:
    import ctypes
except ImportError:  # an interpreter built without _ctypes: no namespaces, the rlimits still hold
    ctypes = None
uid, gid = os.getuid(), os.getgid()
if uid == 0:
    # nobody may not read the interpreter's stdlib (say, under /root): keep it open and import through the fds
    moved = {}
    for d in sys.path:
        if os.path.isdir(d):
            moved[d] = "/proc/self/fd/%d" % os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    sys.path[:] = list(moved.values())
    sys.path_importer_cache.clear()

    def _moved(p):
        for d, fd in moved.items():
            if p == d or p.startswith(d + os.sep):
                return fd + p[len(d):]
        return p
    for m in list(sys.modules.values()):  # packages already imported (encodings, ctypes) find submodules there too
        if isinstance(getattr(m, "__path__", None), list):
            m.__path__[:] = [_moved(p) for p in m.__path__]
    os.setgroups([]); os.setresgid(cfg["nobody"], cfg["nobody"], cfg["nobody"])
    os.setresuid(cfg["nobody"], cfg["nobody"], cfg["nobody"])
    uid = gid = cfg["nobody"]; iso["user"] = "nobody"
try:
    if not cfg["namespaces"]:
        raise OSError("namespaces turned off (SandboxLimits.namespaces=False)")
    if ctypes is None:
        raise OSError("no ctypes in this interpreter, so no unshare(2)")
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(0x10000000 | 0x40000000 | 0x20000000) != 0:  # CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWPID
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    iso["user_ns"] = iso["net_ns"] = iso["pid_ns"] = True
    libc.prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE: setuid cleared it, and /proc/self/*_map are root's without it
    for name, text in (("setgroups", "deny"), ("uid_map", "%d %d 1" % (uid, uid)), ("gid_map", "%d %d 1" % (gid, gid))):
        with open("/proc/self/" + name, "w") as f:
            f.write(text)
except Exception as e:
    iso["unshare_error"] = "%s: %s" % (type(e).__name__, e)
nproc = cfg["max_processes"] + 3  # B, I and U are counted too
if not iso["user_ns"]:  # RLIMIT_NPROC then counts every process of this uid on the machine (B among them)
    tasks = 2
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                if os.stat("/proc/" + p).st_uid == uid:
                    tasks += len(os.listdir("/proc/%s/task" % p))
            except OSError:
                pass
    nproc = cfg["max_processes"] + tasks
mb = 1024 * 1024
cpu = max(1, int(cfg["cpu_s"] + 0.999))
for lim, soft, hard in ((resource.RLIMIT_CPU, cpu, cpu + 1),
                        (resource.RLIMIT_AS, cfg["memory_mb"] * mb, cfg["memory_mb"] * mb),
                        (resource.RLIMIT_FSIZE, cfg["file_size_mb"] * mb, cfg["file_size_mb"] * mb),
                        (resource.RLIMIT_NPROC, nproc, nproc),
                        (resource.RLIMIT_NOFILE, cfg["max_open_files"], cfg["max_open_files"]),
                        (resource.RLIMIT_CORE, 0, 0)):
    resource.setrlimit(lim, (soft, hard))
iso["nproc"] = nproc
os.write(1, (json.dumps(iso) + "\n").encode())

def status_code(st):
    return os.WEXITSTATUS(st) if os.WIFEXITED(st) else 128 + os.WTERMSIG(st)

def run_code():
    builtins.exit = builtins.quit = sys.exit
    linecache.cache["<code>"] = (len(code), None, code.splitlines(True), "<code>")
    g = {"__name__": "__main__", "__builtins__": builtins}
    status = 0
    try:
        tree = ast.parse(code, "<code>", "exec")
        last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        exec(compile(tree, "<code>", "exec"), g)
        if last is not None:  # like a notebook cell: the value of a final expression is printed
            value = eval(compile(ast.Expression(last.value), "<code>", "eval"), g)
            if value is not None:
                print(repr(value))
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            status = e.code or 0
        else:
            print(e.code, file=sys.stderr); status = 1
    except BaseException as e:
        tb = e.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename != "<code>":
            tb = tb.tb_next
        traceback.print_exception(type(e), e, tb)
        status = 1
    try:
        sys.stdout.flush(); sys.stderr.flush()
    except Exception:
        pass
    os._exit(status & 255)

try:
    init = os.fork()
except OSError as e:
    os.write(2, ("sandbox: cannot start: %s\n" % e).encode()); os._exit(125)
if init == 0:
    try:
        user = os.fork()
    except OSError as e:
        os.write(2, ("sandbox: cannot start: %s\n" % e).encode()); os._exit(125)
    if user == 0:
        run_code()
    while True:  # as PID 1, reap every orphan until the code's own process ends
        try:
            pid, st = os.waitpid(-1, 0)
        except ChildProcessError:
            os._exit(125)
        if pid == user:
            os._exit(status_code(st))
while True:
    try:
        pid, st = os.waitpid(init, 0)
        os._exit(status_code(st))
    except InterruptedError:
        pass
'''
