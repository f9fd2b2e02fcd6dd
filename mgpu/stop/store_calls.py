"""The watchdog's calls into the c10d store, none of them still running when the interpreter finalizes. No torch.

The watchdog's threads are daemon threads (a hung training thread must never keep the process alive), and they call
into torch's C++ TCPStore with the GIL released: a call waits up to its timeout on a reconnection, and for ever for
the answer of a host that is alive but stopped. A daemon thread that comes back from such a call while the
interpreter finalizes is ended by CPython with pthread_exit, whose forced unwind through torch's C++ frames aborts the
process: "terminate called without an active exception", SIGABRT, after a run that had finished (seen in CI: rank
1's watchdog, rank 0's store gone; the step was then reported as failed and restarted).

So every call goes through `call()`, which counts it, and at the interpreter's exit (atexit: before finalization,
while a thread can still come back) `refuse_and_wait` refuses new calls, shuts down the connections of the calls in
flight (their threads' reads then fail at once), and waits for them, at most EXIT_WAIT_S: a reconnection's own
timeout (STORE_TIMEOUT_S) ends within it. An exit through os._exit (a stop, a hang) skips both: nothing finalizes.
"""

from __future__ import annotations

import atexit
import os
import socket
import threading
import time
from typing import Any, Callable, TypeVar

__all__ = ["EXIT_WAIT_S", "CountedStore", "StoreExiting", "call", "in_flight", "new_connections",
           "refuse_and_wait", "socket_fds"]

T = TypeVar("T")

EXIT_WAIT_S = 6.0
"""How long the interpreter's exit waits for the store calls in flight (a reconnection ends within 5 s)."""

_lock = threading.Condition()
_in_flight = 0
_refusing = False
_connections: dict[int, tuple[str, int]] = {}  # a store connection's socket: its fd -> its peer, as connected


class StoreExiting(RuntimeError):
    """A store call refused: the interpreter is exiting (the watchdog's callers take it as any call's failure)."""


def call(work: Callable[..., T], *args: Any) -> T:
    """`work(*args)`, counted while it runs; StoreExiting once the interpreter's exit has begun."""
    global _in_flight
    with _lock:
        if _refusing:
            raise StoreExiting("the process is exiting: no more calls into the store")
        _in_flight += 1
    try:
        return work(*args)
    finally:
        with _lock:
            _in_flight -= 1
            _lock.notify_all()


class CountedStore:
    """A store whose every method call goes through `call()`."""

    def __init__(self, store: Any) -> None:
        self._store = store

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._store, name)
        if not callable(attribute):
            return attribute
        return lambda *args: call(attribute, *args)


def socket_fds() -> set[int]:
    """This process's open sockets' descriptors (Linux: /proc/self/fd; elsewhere none)."""
    fds: set[int] = set()
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return fds
    for name in names:
        try:
            if os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                fds.add(int(name))
        except (OSError, ValueError):
            pass
    return fds


def _peer(fd: int) -> tuple[str, int] | None:
    try:
        probe = socket.socket(fileno=os.dup(fd))
    except OSError:
        return None
    try:
        peer = probe.getpeername()
        return (str(peer[0]), int(peer[1])) if isinstance(peer, tuple) else None
    except OSError:
        return None
    finally:
        probe.close()


def new_connections(before: set[int], port: int) -> None:
    """Record the sockets opened since `before` that are connected to `port`: a store client's connection, which
    `refuse_and_wait` may shut down."""
    for fd in socket_fds() - before:
        peer = _peer(fd)
        if peer is not None and peer[1] == port:
            with _lock:
                _connections[fd] = peer


def _shut_down_connections() -> None:
    """Shut down every recorded connection still connected to the same peer (a closed fd's number may be another
    socket's now: that one is left alone)."""
    with _lock:
        connections = dict(_connections)
    for fd, peer in connections.items():
        if _peer(fd) != peer:
            continue
        try:
            with socket.socket(fileno=os.dup(fd)) as connection:
                connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def in_flight() -> int:
    """The store calls running now."""
    with _lock:
        return _in_flight


def refuse_and_wait(timeout: float = EXIT_WAIT_S) -> bool:
    """Refuse new calls; with calls in flight, shut their connections down and wait up to `timeout` s for them to
    return: True if none is left."""
    global _refusing
    with _lock:
        _refusing = True
        if not _in_flight:
            return True
    _shut_down_connections()
    deadline = time.monotonic() + timeout
    with _lock:
        while _in_flight and (left := deadline - time.monotonic()) > 0:
            _lock.wait(left)
        return _in_flight == 0


atexit.register(refuse_and_wait)
