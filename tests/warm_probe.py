"""What tests/test_warm_start.py compares between a fresh `python` and a warm-started one: this process's view of
itself, printed as one JSON line, then an exit chosen by argv[1] (exit code, exception, signal, os._exit)."""

import atexit
import json
import multiprocessing
import os
import signal
import sys
import threading
import time


def square(x: int) -> int:  # pickled by reference to __main__ for a spawned child, as a user's script's would be
    return x * x


def view() -> dict[str, object]:
    main = sys.modules["__main__"]
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        spawned = pool.apply(square, (7,))
    return {"name": __name__, "argv": sys.argv, "path0": sys.path[0], "file": getattr(main, "__file__", None),
            "cwd": os.getcwd(), "probe_var": os.environ.get("PROBE_VAR"), "pytest_var": "PYTEST_VERSION" in os.environ,
            "own_group": os.getpgid(0) == os.getpid(), "spawned": spawned, "stdin": sys.stdin.read(),
            "faulthandler": __import__("faulthandler").is_enabled(), "orig_argv": sys.orig_argv[1:],
            "main_names": sorted(name for name in vars(main) if not name.startswith("__"))}


def fds_intact(fds: list[int]) -> str:
    """Whether this process's own descriptors are still open at exit (nothing of the server's closes them)."""
    for fd in fds:
        try:
            os.fstat(fd)
        except OSError:
            return f"fd {fd} was closed under this process"
    return "atexit ran"


if __name__ == "__main__":
    print(json.dumps(view()), flush=True)
    own = [fd for _ in range(8) for fd in os.pipe()]  # the lowest free numbers, as a library's sockets would take
    atexit.register(lambda: print(fds_intact(own), flush=True))
    threading.Thread(target=lambda: (time.sleep(0.2), print("thread joined", flush=True))).start()
    how = sys.argv[1]
    if how == "exit":
        sys.exit(3)
    if how == "raise":
        raise RuntimeError("probe failed")
    if how == "signal":
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
    if how == "os_exit":
        os._exit(5)
