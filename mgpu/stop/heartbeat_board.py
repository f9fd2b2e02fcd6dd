"""Where the ranks' heartbeats meet (mgpu.stop.watchdog): one board per job, never the run's shared filesystem,
whose one stalled `open()` would blind every rank's watchdog at once.

- `StoreBoard`: the c10d rendezvous store (a TCPStore: memory, no cache), through a connection of the
  watchdog's own whose every operation times out after STORE_TIMEOUT_S (and is counted: mgpu.stop.store_calls);
  for a world of several ranks.
- `DirBoard`: files in a node-local tmpfs directory, for a world of one (or no store to be found).

Every rank of a job must use the same board: a rank on another one is invisible to the rest, and a hang's
blame counts an invisible rank as frozen. So a rank that cannot reach the store at its start (32 ranks
connecting at once on a loaded node) keeps trying at each use instead of falling back to its node's
directory (seen: three live ranks blamed, the culprit not, at 32 ranks on 2 cores).
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol

from mgpu.stop.store_calls import CountedStore, call, new_connections, socket_fds

__all__ = ["STACKS_REQUESTED", "STORE_TIMEOUT_S", "Board", "DirBoard", "StoreBoard", "default_board",
           "node_local_dir"]

log = logging.getLogger("mgpu.train")

STACKS_REQUESTED = ".stacks-requested"
"""On the board: the wall time at which a rank found a hang; a later one than a watchdog's start asks it for
its stacks."""
STORE_TIMEOUT_S = 5.0
"""The timeout of the watchdog's own connection to the rendezvous store: a connection, and an operation on a host
that is gone, end within this; one waiting for the answer of a host that is alive but stopped waits until the host
goes on (each runs on a thread of its own: mgpu.stop.watchdog's `_bounded`)."""
RECONNECT_EVERY_S = 2.0
"""A board not yet connected to the store tries again at most this often (the publisher's interval)."""


class Board(Protocol):
    """Every call may fail (OSError, RuntimeError) and is bounded."""

    def publish(self, rank: int, beat: str) -> None: ...
    def read(self, world: int) -> dict[int, str]: ...
    def request_stacks(self, at: float) -> None: ...
    def stacks_requested(self) -> float | None: ...
    def close(self, rank: int) -> None: ...


class DirBoard:
    """Heartbeat files in a node-local directory (tmpfs: /dev/shm, else $TMPDIR): for a world on one node. A
    create and a rename per rank every WRITE_EVERY_S, on memory, never on the shared filesystem. The last rank
    to close it removes it (and its parent, a per-user `mgpu-<uid>`, once empty): nothing is left behind."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._make()

    def _make(self) -> None:
        for _ in range(3):  # another run's board removing an empty parent meanwhile: make it again
            try:
                self.path.mkdir(parents=True, exist_ok=True)
                return
            except FileNotFoundError:
                continue
        self.path.mkdir(parents=True, exist_ok=True)

    def _put(self, name: str, text: str) -> None:
        tmp = self.path / f".{name}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            tmp.write_text(text)
        except FileNotFoundError:  # removed by a rank that closed it first (it saw no other heartbeat)
            self._make()
            tmp.write_text(text)
        os.replace(tmp, self.path / name)

    def publish(self, rank: int, beat: str) -> None:
        self._put(f"heartbeat-rank{rank}.json", beat)

    def read(self, world: int) -> dict[int, str]:
        found = {}
        for rank in range(world):
            try:
                found[rank] = (self.path / f"heartbeat-rank{rank}.json").read_text()
            except OSError:
                continue
        return found

    def request_stacks(self, at: float) -> None:
        self._put(STACKS_REQUESTED, repr(at))

    def stacks_requested(self) -> float | None:
        try:
            return float((self.path / STACKS_REQUESTED).read_text())
        except (OSError, ValueError):
            return None

    def close(self, rank: int) -> None:
        (self.path / f"heartbeat-rank{rank}.json").unlink(missing_ok=True)
        if not self.path.name.startswith(("watchdog-", "mgpu-")):
            return  # a directory mgpu did not name (node_local_dir): the caller's to keep
        try:
            if any(self.path.glob("heartbeat-rank*.json")):
                return  # another rank's board still
            (self.path / STACKS_REQUESTED).unlink(missing_ok=True)
            self.path.rmdir()
            if self.path.parent.name.startswith("mgpu-"):
                self.path.parent.rmdir()  # the per-user directory, once no other board is in it
        except OSError:
            pass  # not empty (another rank's or run's), or gone already


class StoreBoard:
    """Heartbeats in the c10d rendezvous store, through a connection of the watchdog's own whose every operation
    times out after `STORE_TIMEOUT_S`. One `set` per rank every WRITE_EVERY_S and no filesystem operation at
    all: the load is on the store's host, in memory. Built with `connect` (a function that opens the
    connection) instead of a store, it opens it at its first use, and again at most every RECONNECT_EVERY_S
    while that fails (the failure is raised: the watchdog's callers take any call's failure)."""

    def __init__(self, store: Any = None, connect: Callable[[], Any] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        # Every call into the store counted, so that the interpreter's exit waits for those in flight (store_calls).
        self._store = CountedStore(store) if store is not None else None
        self._connect, self._clock = connect, clock
        self._tried = -RECONNECT_EVERY_S
        self._lock = threading.Lock()

    @classmethod
    def connect(cls, host: str, port: int, namespace: str, timeout_s: float = 0.0) -> "StoreBoard":
        """A board on the store at host:port, connected now if it can be, else at a later use."""
        def open_store() -> Any:
            import torch.distributed as dist

            before = socket_fds()
            client = dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                                   timeout=timedelta(seconds=timeout_s or STORE_TIMEOUT_S))
            new_connections(before, port)  # the interpreter's exit may shut it down (mgpu.stop.store_calls)
            return dist.PrefixStore(namespace, client)

        board = cls(connect=open_store)
        try:
            board.store
        except (RuntimeError, OSError, ValueError) as error:
            log.warning("the watchdog cannot reach the rendezvous store yet (%s): it tries again at every heartbeat",
                        error)
        return board

    @property
    def store(self) -> Any:
        """The connection, opened if need be (RuntimeError while it cannot be, at most every RECONNECT_EVERY_S)."""
        with self._lock:
            if self._store is None:
                if self._connect is None:
                    raise RuntimeError("no store to connect to")
                now = self._clock()
                if now - self._tried < RECONNECT_EVERY_S:
                    raise RuntimeError("the rendezvous store is not reachable yet")
                self._tried = now
                self._store = CountedStore(call(self._connect))  # the connection's own wait, counted too
            return self._store

    def publish(self, rank: int, beat: str) -> None:
        self.store.set(f"hb/{rank}", beat)

    def read(self, world: int) -> dict[int, str]:
        store = self.store
        keys = [f"hb/{rank}" for rank in range(world)]
        if store.check(keys):  # one round trip when every rank has beaten (a missing key's get waits)
            return {rank: bytes(value).decode() for rank, value in enumerate(store.multi_get(keys))}
        return {rank: bytes(store.get(key)).decode() for rank, key in enumerate(keys) if store.check([key])}

    def request_stacks(self, at: float) -> None:
        self.store.set(STACKS_REQUESTED, repr(at))

    def stacks_requested(self) -> float | None:
        store = self.store
        if not store.check([STACKS_REQUESTED]):
            return None
        return float(bytes(store.get(STACKS_REQUESTED)).decode())

    def close(self, rank: int) -> None:
        pass  # the store ends with the step's rendezvous; its host may be gone already


def node_local_dir(key: str, environ: Mapping[str, str] | None = None) -> Path:
    """A directory on this node's memory (/dev/shm), else $TMPDIR, for this run's attempt `key`. In a Slurm job,
    `mgpu-<job>-watchdog-<digest>`: the job's cleanup on every node (`python -m mgpu.state.memory.store
    --remove-this-job`, mgpu.state.memory.store.remove_job) removes it with the job's snapshots when a rank
    was killed before it could; elsewhere `mgpu-<uid>/watchdog-<digest>`."""
    from mgpu.cluster.environment import SlurmEnvironment

    environ = os.environ if environ is None else environ
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(environ.get("TMPDIR") or tempfile.gettempdir())
    digest = hashlib.sha1(key.encode()).hexdigest()[:16]
    if environ.get("SLURM_JOB_ID"):
        return base / f"mgpu-{SlurmEnvironment.job_id(environ)}-watchdog-{digest}"
    return base / f"mgpu-{os.getuid()}" / f"watchdog-{digest}"


def default_board(world: int, key: str) -> Board:
    """The rendezvous store when the process group is formed across several ranks (kept even while it cannot
    be reached: see the module's docstring), else a node-local directory (a world of one, or no store)."""
    if world > 1:
        try:
            import torch.distributed as dist
            from torch.distributed.distributed_c10d import _get_default_store

            if dist.is_initialized():
                store = _get_default_store()
                while hasattr(store, "underlying_store"):
                    store = store.underlying_store
                if hasattr(store, "host") and hasattr(store, "port"):
                    namespace = "mgpu-watchdog/" + hashlib.sha1(key.encode()).hexdigest()[:16] + "/"
                    return StoreBoard.connect(store.host, store.port, namespace)
        except (ImportError, RuntimeError, ValueError) as error:
            log.warning("the watchdog finds no rendezvous store (%s): heartbeats stay on this node", error)
    return DirBoard(node_local_dir(key))
