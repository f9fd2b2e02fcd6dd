"""A replica of each rank's snapshots in memory on a partner rank of another node (checkpoint.memory_every_steps),
so the loss of one node's memory loses no snapshot while the allocation keeps going.

Pairing (`partners`): rank r sends its snapshots to the rank with its local rank on the next node,
(r + ranks per node) % world, and holds the replica of (r - ranks per node) % world; none on one node. The holder
keeps it in its node's shared memory, `<job dir>/replica-of-rank<r>-on-<node>/`, with the snapshots' own two slots
and commit records (mgpu.state.memory.store.SnapshotStore, the sender's identity): a transfer cut short, or
whose CRC-32 is not the sender's, is never committed, and the previous replica stays whole (the holder's side:
mgpu.state.memory.replica_server). Here: the pairing, the client that asks the partner, the sender, and `Replication`,
one rank's side of both.

Transport: a plain TCP socket per pair (mgpu.state.memory.replica_wire). Each rank serves the replica it holds on a
port of its own, published with a random token in a directory (the rendezvous TCPStore the job already has,
`StoreDirectory`); a daemon thread sends the newest snapshot (one in flight, one waiting that a newer one replaces:
the loop never waits), and a restore asks the partner for the steps it holds and fetches one back over the same kind
of connection. Not a gloo group on a thread: that would still be a collective, which a dead or slow partner turns
into a hang of both; a socket fails alone, within its timeout. No torch here except in `StoreDirectory`.
"""

from __future__ import annotations

import io
import json
import logging
import os
import secrets
import shutil
import socket
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

from mgpu.state.memory.replica_server import Budget, ReplicaServer
from mgpu.state.memory.replica_wire import TIMEOUT_S, Refused, crc_text, recv_exact, recv_msg, send_msg
from mgpu.state.memory.store import Identity, Snapshot, SnapshotStore, job_dir, safe_name

__all__ = ["Directory", "Refused", "ReplicaServer", "Replication", "StoreDirectory", "partners", "replica_dir"]

log = logging.getLogger("mgpu.train")


class Directory(Protocol):
    """Where the ranks publish their replica servers' addresses (the rendezvous store; a dict in tests)."""

    def publish(self, key: str, value: str) -> None: ...

    def lookup(self, key: str, timeout: float) -> str: ...


def partners(rank: int, world_size: int, ranks_per_node: int, num_nodes: int) -> tuple[int, int] | None:
    """(the rank this one sends its snapshots to, the rank whose replica it holds), or None: one node, or nodes
    with unequal numbers of ranks (then the pairing is not the same on every rank)."""
    if num_nodes < 2 or ranks_per_node < 1 or ranks_per_node * num_nodes != world_size:
        return None
    return (rank + ranks_per_node) % world_size, (rank - ranks_per_node) % world_size


def replica_dir(job: str, run: str, rank: int, node: str, base: Path | None = None) -> Path:
    """Where `node` holds the replica of `rank`'s snapshots: the node's name keeps the nodes' files apart where
    two share one /dev/shm (the test cluster)."""
    return job_dir(job, run, base) / f"replica-of-rank{rank}-on-{safe_name(node)}"


class Partner:
    """The client side: the partner's server (its address and token looked up once in the directory), asked for
    one rank's replica (`identity`)."""

    def __init__(self, rank: int, identity: Identity, directory: Directory, namespace: str, node: str,
                 timeout: float = TIMEOUT_S) -> None:
        self.rank, self.identity, self.directory, self.namespace = rank, identity, directory, namespace
        self.node, self.timeout = node, timeout
        self._entry: dict[str, str] | None = None

    def entry(self) -> dict[str, str]:
        """The partner's published entry (address, token, node); refused when it is on this rank's node."""
        if self._entry is None:
            entry = json.loads(self.directory.lookup(f"{self.namespace}{self.rank}", self.timeout))
            if entry.get("node") == self.node:
                raise Refused(f"rank {self.rank} is on this rank's node ({self.node}): a replica there protects nothing")
            self._entry = entry
        return self._entry

    def _request(self, message: dict[str, Any]) -> tuple[socket.socket, dict[str, Any]]:
        entry = self.entry()
        host, port = entry["address"].rsplit(":", 1)
        conn = socket.create_connection((host, int(port)), timeout=self.timeout)
        try:
            send_msg(conn, {**message, "token": entry["token"], "identity": asdict(self.identity)})
            answer = recv_msg(conn)
            if not answer.get("ok"):
                raise Refused(str(answer.get("why")))
        except BaseException:
            conn.close()
            raise
        return conn, answer

    def steps(self) -> list[int]:
        conn, answer = self._request({"op": "list"})
        conn.close()
        return [int(step) for step in answer["steps"]]

    def own_steps(self, rank0: bool) -> list[int]:
        """The steps of the partner's own snapshots this rank may resume from (`rank0`: with rank 0's buffers)."""
        conn, answer = self._request({"op": "own-list", "rank0": rank0})
        conn.close()
        return [int(step) for step in answer["steps"]]

    def fetch(self, step: int, own: bool = False, rank0: bool = False) -> bytes:
        """The replica of `step` (`own`: the partner's own snapshot of it, one this rank may resume from), checked
        against the CRC-32 its holder read it with."""
        conn, answer = self._request({"op": "own-get" if own else "get", "step": step, "rank0": rank0})
        with conn:
            content = recv_exact(conn, int(answer["bytes"]))
            recv_msg(conn)  # the server's end of the request
        if crc_text(content) != answer["crc32"]:
            raise Refused(f"torn: the replica of step {step} received is not its CRC-32")
        return content

    def put(self, snapshot: Snapshot) -> None:
        """Send `snapshot` from its file to the socket (os.sendfile: no copy through this process, and no CRC-32
        here: the holder computes it as it receives and commits only what matches the commit record's). Its slot
        is written over two snapshots later, maybe while this is sent: then it is Superseded, whatever arrived."""
        def superseded() -> Superseded:
            return Superseded(f"step {snapshot.step}'s slot was written over before it was sent")

        try:
            file = open(snapshot.path, "rb")
        except FileNotFoundError:
            raise superseded() from None
        with file:
            size = os.fstat(file.fileno()).st_size
            if not snapshot.still_committed():
                raise superseded()
            conn, _ = self._request({"op": "put", "step": snapshot.step, "bytes": size, "crc32": snapshot.digest})
            with conn:
                try:
                    if conn.sendfile(file, 0, size) != size:  # the file was cut short under it: the holder sees a close
                        raise superseded()
                    answer = recv_msg(conn)  # a holder that found the bytes torn closes without one
                except OSError:
                    if not snapshot.still_committed():
                        raise superseded() from None
                    raise
        if not answer.get("ok"):
            raise superseded() if not snapshot.still_committed() else Refused(str(answer.get("why")))


class Superseded(Exception):
    """A snapshot written over before it could be sent: the newer one goes instead."""


class ReplicaSender:
    """Sends this rank's newest snapshot to its partner on a daemon thread: one in flight, one waiting (a newer
    snapshot replaces it there). A failure is said once, when the next snapshot is offered (a partner that ended
    with the run is no failure); the run goes on either way."""

    def __init__(self, partner: Partner) -> None:
        self.partner = partner
        self.sent = 0
        self.failure: str | None = None
        self._said = False
        self._pending: Snapshot | None = None
        self._closing = False
        self._busy = False
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def offer(self, snapshot: Snapshot) -> None:
        with self._cond:
            if self.failure is not None and not self._said:
                self._said = True
                log.warning("checkpoint.memory_every_steps: rank %d: a replica to rank %d failed: %s (said once; "
                            "the snapshots stay on this node)", self.partner.identity.rank, self.partner.rank,
                            self.failure)
            self._pending = snapshot
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="mgpu-replica-sender", daemon=True)
                self._thread.start()
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._pending is None and not self._closing:
                    self._cond.wait()
                if self._closing:
                    return
                snapshot, self._pending, self._busy = self._pending, None, True
            try:
                assert snapshot is not None
                self.partner.put(snapshot)
                self.sent += 1
                if self.sent == 1:
                    log.info("rank %d: its snapshots are replicated on rank %d (node %s)", self.partner.identity.rank,
                             self.partner.rank, self.partner.entry().get("node"))
            except Superseded:
                pass
            except Exception as error:  # noqa: BLE001  # a replica never ends the run
                self.failure = self.failure or f"{type(error).__name__}: {error}"
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def wait_idle(self, timeout: float) -> bool:
        """Whether nothing is waiting or being sent within `timeout` s (tests)."""
        with self._cond:
            return self._cond.wait_for(lambda: self._pending is None and not self._busy, timeout)

    def close(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify_all()


@dataclass
class Replication:
    """One rank's side of the replicas: the server holding its partner's, the sender of its own, the client that
    lists and fetches its own back."""

    held: SnapshotStore
    server: ReplicaServer
    sender: ReplicaSender

    @classmethod
    def start(cls, identity: Identity, *, node: str, ranks_per_node: int, num_nodes: int, host: str,
              directory: Callable[[], Directory], base: Path | None = None,
              timeout: float = TIMEOUT_S, budget: Budget = None, own: SnapshotStore | None = None
              ) -> "Replication | None":
        """Serve the replica this rank holds and publish where in `directory()` (called only where there are
        partners); None (and rank 0 says so) on one node. `budget`: what the replica held may take; `own`: this
        rank's snapshots, the shareable ones served to the rank whose replica it holds."""
        pair = partners(identity.rank, identity.world_size, ranks_per_node, num_nodes)
        if pair is None:
            if identity.rank == 0:
                log.info("checkpoint.memory_every_steps: %s: the snapshots have no replica on another node (a lost "
                         "node costs the durable checkpoint)", "one node" if num_nodes < 2 else
                         "nodes with unequal numbers of ranks")
            return None
        to, held_rank = pair
        held = SnapshotStore(replica_dir(identity.job, identity.run, held_rank, node, base),
                             Identity(**{**asdict(identity), "rank": held_rank}))
        token = secrets.token_hex(16)
        server = ReplicaServer(held, host, token, timeout, budget, own)
        namespace = f"mgpu-replica/{identity.job}/{identity.restart}/{identity.run}/"
        try:
            published = directory()
            published.publish(f"{namespace}{identity.rank}", json.dumps({"address": server.address, "token": token,
                                                                         "node": node}))
        except BaseException:
            server.close()
            raise
        return cls(held, server, ReplicaSender(Partner(to, identity, published, namespace, node, timeout)))

    @property
    def partner(self) -> Partner:
        return self.sender.partner

    def offer(self, snapshot: Snapshot) -> None:
        self.sender.offer(snapshot)

    def steps(self) -> list[int]:
        """The steps of this rank's replica its partner can give back ([]: none, or it cannot be asked: said)."""
        try:
            return self.partner.steps()
        except Exception as error:  # noqa: BLE001  # no replica: the own snapshots or the durable checkpoint
            log.warning("checkpoint.memory_every_steps: rank %d cannot ask rank %d for its replica: %s: %s",
                        self.partner.identity.rank, self.partner.rank, type(error).__name__, error)
            return []

    def fetch(self, step: int, own: bool = False, rank0: bool = False) -> io.BytesIO:
        return io.BytesIO(self.partner.fetch(step, own, rank0))

    def partners_own(self, rank0: bool) -> list[int]:
        """The steps of the partner's own snapshots this rank may resume from ([]: none, or it cannot be asked)."""
        try:
            return self.partner.own_steps(rank0)
        except Exception as error:  # noqa: BLE001  # nothing to share: the other sources decide
            log.info("checkpoint.memory_every_steps: rank %d cannot ask rank %d for its shared snapshots: %s: %s",
                     self.partner.identity.rank, self.partner.rank, type(error).__name__, error)
            return []

    def discard_after(self, step: int) -> None:
        self.held.discard_after(step)

    def clear(self) -> None:
        """The replica this rank holds, removed (a fresh start); it goes on serving."""
        shutil.rmtree(self.held.directory, ignore_errors=True)

    def close(self) -> None:
        """Stop sending and serving, then remove the replica held (nothing writes it after)."""
        self.sender.close()
        self.server.close()
        self.clear()


class StoreDirectory:
    """The rendezvous TCPStore as the directory, through a connection of its own (every operation bounded)."""

    def __init__(self, store: Any) -> None:
        self.store = store

    @classmethod
    def rendezvous(cls, timeout: float = TIMEOUT_S) -> "StoreDirectory":
        """A connection to the default process group's store (raises where it has none reachable)."""
        from datetime import timedelta

        import torch.distributed as dist
        from torch.distributed.distributed_c10d import _get_default_store

        store = _get_default_store()
        while hasattr(store, "underlying_store"):
            store = store.underlying_store
        if not (hasattr(store, "host") and hasattr(store, "port")):
            raise RuntimeError(f"the rendezvous store is a {type(store).__name__}, not a TCPStore")
        return cls(dist.TCPStore(store.host, store.port, is_master=False, wait_for_workers=False,
                                 timeout=timedelta(seconds=timeout)))

    def publish(self, key: str, value: str) -> None:
        self.store.set(key, value)

    def lookup(self, key: str, timeout: float) -> str:
        from datetime import timedelta

        self.store.wait([key], timedelta(seconds=timeout))
        return bytes(self.store.get(key)).decode()


def local_address(peer: str, port: int) -> str:
    """This host's address on the route to `peer` (the rendezvous host): where a partner can reach it."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((peer, port))  # no packet: the kernel picks the route and its source address
            return str(probe.getsockname()[0])
    except OSError:
        return socket.gethostbyname(socket.gethostname())
