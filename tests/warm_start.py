"""Warm starts for the tests' rank processes: a server that has imported torch forks each rank.

Every real-process test starts Python processes that import torch (1.2 s of CPU) and build an optimizer, which
imports torch._dynamo (another 1.2 s): on CI's 2 cores that startup was most of the suite's time. A rank started
here is forked from a server process (one per pytest process, started on first use) that has already imported
them, then becomes `python ARGV...` in the same interpreter: its own pid, process group, environment, working
directory, argv, sys.path[0] and `__main__`, its output on a pipe, and the interpreter's own exit (atexit
handlers, non-daemon threads joined, an unhandled exception's traceback and exit 1, SystemExit's code, death by
a signal). What differs from a fresh `python`: the imports above are already done (and their import-time state
was set up under the server's environment and working directory, so a request whose environment differs in a
variable read at startup or import, or that runs elsewhere, is started fresh instead), and the rank is the
server's child, not the test's (tests.conftest's leak guard looks there too).

Fresh interpreters stay wherever the start itself is under test: the real launchers (srun, torchrun,
mgpu.run.spawn, submit.py --cluster local) start their ranks as users' do, and only tests.conftest's
start_ranks/run_processes come here. MGPU_TEST_COLD_START=1 starts every rank fresh (tests/test_warm_start.py
checks that a warm rank behaves as a fresh one does).
"""

from __future__ import annotations

import array
import json
import os
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

# What the server imports before it forks: what every rank imports (torch, and torch._dynamo, which any
# optimizer's add_param_group imports) and nothing of mgpu, whose import-time state must be the rank's own.
PRELOAD = ("torch", "torch._dynamo", "torch.distributed", "torch.distributed.checkpoint", "torch.utils.data", "numpy")
# Variables read at interpreter start or at the preloaded imports: a request must match the server in them.
STARTUP_PREFIXES = ("PYTHON", "OMP_", "MKL_", "KMP_", "OPENBLAS_", "TORCH", "LD_", "MALLOC", "CUDA", "NCCL", "GLOO")
# Not compared: applied by the rank itself after the fork, or read only when used (torch's first optimizer step
# sets TORCHINDUCTOR_CACHE_DIR in the test process too).
PER_RANK = {"PYTHONFAULTHANDLER", "TORCHINDUCTOR_CACHE_DIR"}
COLD = "MGPU_TEST_COLD_START"


def _startup_vars(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(STARTUP_PREFIXES) and k not in PER_RANK}


# ----------------------------------------------------------------------------------------------- client side
class WarmProcess:
    """The subset of subprocess.Popen the tests use, for a rank forked by the server (output: stdout and stderr
    together, as text)."""

    def __init__(self, args: list[str], conn: socket.socket, out_fd: int) -> None:
        self.args = args
        self._conn = conn
        self._chunks: list[bytes] = []
        self._exited = threading.Event()
        self.returncode: int | None = None
        self._replies = conn.makefile("rb")  # the child's pid, then its wait status: a line each
        reply = self._replies.readline().decode().strip()
        if not reply.isdigit():
            os.close(out_fd)
            raise OSError(f"the warm-start server did not start {args}: {reply!r}")
        self.pid = int(reply)
        self._reader = threading.Thread(target=self._drain, args=(out_fd,), daemon=True)
        self._reader.start()
        threading.Thread(target=self._await_exit, daemon=True).start()

    def _drain(self, fd: int) -> None:
        with os.fdopen(fd, "rb", buffering=0) as out:
            while chunk := out.read(65536):
                self._chunks.append(chunk)

    def _await_exit(self) -> None:
        status = self._replies.readline().decode().strip()
        self._replies.close()
        self._conn.close()
        self.returncode = os.waitstatus_to_exitcode(int(status)) if status.lstrip("-").isdigit() else -1
        self._exited.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._exited.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        assert self.returncode is not None
        return self.returncode

    def communicate(self, input: None = None, timeout: float | None = None) -> tuple[str, None]:
        deadline = None if timeout is None else time.monotonic() + timeout
        self.wait(timeout)
        self._reader.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if self._reader.is_alive():  # the rank's own children still hold its output open
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        text = b"".join(self._chunks).decode("utf-8", "replace")
        return text.replace("\r\n", "\n").replace("\r", "\n"), None

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Server:
    """This process's warm-start server: started on first use, ended when this process exits (its stdin closes)."""

    def __init__(self, python: str, env: dict[str, str], cwd: Path) -> None:
        self.env, self.cwd = env, cwd
        self._dir = tempfile.mkdtemp(prefix="mgpu-warm-")
        self.path = os.path.join(self._dir, "sock")
        self.log = os.path.join(self._dir, "server.log")
        root = str(Path(__file__).resolve().parent.parent)  # this checkout, whatever the caller's PYTHONPATH
        code = (f"import sys; sys.path.insert(0, {root!r}); import tests.warm_start; del sys.path[0]; "
                f"tests.warm_start.serve({self.path!r})")
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen([python, "-c", code], env=env, cwd=cwd, stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=log)
        assert self.proc.stdout is not None
        ready = self.proc.stdout.readline()
        if ready.strip() != b"ready":
            raise OSError(f"the warm-start server did not start (rc {self.proc.poll()}): {ready!r}")

    def accepts(self, env: dict[str, str], cwd: Path) -> bool:
        """Whether a rank with this environment and working directory can be forked from here: the preloaded
        imports read both (multiprocessing keeps the directory it was imported in, to find a spawned child's
        __main__ from)."""
        if self.proc.poll() is not None:
            with open(self.log, errors="replace") as log:
                raise AssertionError(f"the warm-start server exited (rc {self.proc.returncode}): {log.read()[-3000:]}")
        return _startup_vars(env) == _startup_vars(self.env) and Path(cwd).resolve() == Path(self.cwd).resolve()

    def start(self, argv: list[str], env: dict[str, str], cwd: Path, process_group: int | None) -> WarmProcess:
        request = json.dumps({"argv": argv, "env": env, "cwd": str(cwd), "pgid": process_group}).encode()
        read_fd, write_fd = os.pipe()
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(self.path)
            header = struct.pack("!I", len(request))
            conn.sendmsg([header], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [write_fd]))])
            conn.sendall(request)
        except BaseException:
            conn.close()
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)
        return WarmProcess(argv, conn, read_fd)


_server: Server | None = None


def server(python: str, env: dict[str, str], cwd: Path) -> Server:
    global _server
    if _server is None:
        _server = Server(python, env, cwd)
    return _server


def current() -> Server | None:
    return _server


def popen(python: str, argv: list[str], env: dict[str, str], cwd: Path, process_group: int | None,
          server_env: dict[str, str], server_cwd: Path) -> WarmProcess | subprocess.Popen[str]:
    """`python argv...` in `cwd` with exactly `env`, output (stdout and stderr together) as text: forked by the warm
    server (started in `server_cwd` with `server_env` on first use) where it can be, else a fresh interpreter."""
    if os.environ.get(COLD) != "1":
        warm = server(python, server_env, server_cwd)
        if warm.accepts(env, cwd):
            return warm.start(argv, env, cwd, process_group)
    return subprocess.Popen([python, *argv], env=env, cwd=cwd, process_group=process_group,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


# ----------------------------------------------------------------------------------------------- server side
def serve(path: str) -> None:
    """The server's main: import PRELOAD, then fork one child per request. Returns only in a child, which then
    becomes the requested `python argv...` (run below, in this interpreter's own `__main__`)."""
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    assert threading.active_count() == 1 and len(os.listdir("/proc/self/task")) == 1, "fork needs one thread"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so that a child's exit writes to wake_w
    waiting: dict[int, socket.socket] = {}
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    while True:
        ready, _, _ = select.select([listener, wake_r, sys.stdin], [], [], 1.0)
        if wake_r in ready:
            os.read(wake_r, 4096)
        _reap(waiting)
        if sys.stdin in ready and not os.read(sys.stdin.fileno(), 4096):
            shutil.rmtree(os.path.dirname(path), ignore_errors=True)  # its socket and log
            os._exit(0)  # the test process has exited
        if listener in ready:
            conn, _ = listener.accept()
            request, out_fd = _receive(conn)
            pid = os.fork()
            if pid == 0:  # detached, not closed: a socket object's own close at exit would hit a reused fd
                for fd in (listener.detach(), conn.detach(), wake_r, wake_w, *(c.detach() for c in waiting.values())):
                    os.close(fd)
                _become(request, out_fd)
                _run(request["argv"])
                return
            os.close(out_fd)
            if request["pgid"] is not None:
                try:  # also here, as a shell does: the next rank may join this group before the child sets it
                    os.setpgid(pid, request["pgid"] or pid)
                except OSError:
                    pass
            conn.sendall(f"{pid}\n".encode())
            waiting[pid] = conn


def _reap(waiting: dict[int, socket.socket]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = waiting.pop(pid, None)
        if conn is not None:
            try:
                conn.sendall(f"{status}\n".encode())
            except OSError:
                pass
            conn.close()


def _receive(conn: socket.socket) -> tuple[dict[str, Any], int]:
    fds = array.array("i")
    header, ancillary, _, _ = conn.recvmsg(4, socket.CMSG_SPACE(fds.itemsize))
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
    (size,) = struct.unpack("!I", header)
    body = b""
    while len(body) < size:
        body += conn.recv(size - len(body))
    return json.loads(body), fds[0]


def _become(request: dict[str, Any], out_fd: int) -> None:
    """Set up this forked child as the requested process before it runs."""
    import faulthandler

    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    if request["pgid"] is not None:
        os.setpgid(0, request["pgid"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(out_fd, 1)
    os.dup2(out_fd, 2)
    os.close(out_fd)
    os.chdir(request["cwd"])
    import multiprocessing

    multiprocessing.current_process().authkey = os.urandom(32)  # as a fresh interpreter's: its own
    os.environ.clear()
    os.environ.update(request["env"])
    if request["env"].get("PYTHONFAULTHANDLER"):
        faulthandler.enable()
    else:
        faulthandler.disable()


def _run(argv: list[str]) -> None:
    """Run `python argv...` as a fresh interpreter runs it: in `__main__`, with its sys.argv and sys.path[0].
    Its exceptions and SystemExit reach this interpreter's own top level, which exits as `python` would."""
    import runpy

    main = sys.modules["__main__"]
    for name in [name for name in main.__dict__ if not name.startswith("__")]:
        del main.__dict__[name]  # what the server's own command line left there
    sys.orig_argv = [sys.executable, *argv]  # the command line a fresh `python argv...` would have had
    if argv[0] == "-c":
        sys.argv, sys.path[0] = ["-c", *argv[2:]], ""
        exec(compile(argv[1], "<string>", "exec"), main.__dict__)
    elif argv[0] == "-m":
        sys.argv, sys.path[0] = [argv[1], *argv[2:]], os.getcwd()
        runpy._run_module_as_main(argv[1])  # type: ignore[attr-defined]  # what `python -m` itself calls
    else:
        from importlib.machinery import SourceFileLoader

        path = os.path.abspath(argv[0])
        sys.argv, sys.path[0] = list(argv), os.path.dirname(os.path.realpath(path))
        main.__dict__.update(__file__=path, __cached__=None, __loader__=SourceFileLoader("__main__", path))
        with open(path, "rb") as source:
            code = compile(source.read(), path, "exec")
        exec(code, main.__dict__)
