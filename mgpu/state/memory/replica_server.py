"""The holder's side of a replica (mgpu.state.memory.replica): the replica of one rank's snapshots kept in this
node's shared memory with the snapshots' own two slots and commit records (mgpu.state.memory.store.SnapshotStore,
the sender's identity), served to that rank on a port of its own, one connection at a time on a daemon thread
(mgpu.state.memory.replica_wire). A transfer cut short, or whose CRC-32 is not the sender's, is never committed: the
previous replica stays whole. The holder also gives its own shareable snapshots (a survivor's save) to the rank
whose replica it holds. No torch.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import socket
import threading
from dataclasses import asdict
from typing import Any, Callable, Optional

from mgpu.state.files.digest import crc32
from mgpu.state.memory.replica_wire import CHUNK, TIMEOUT_S, Refused, crc_text, recv_msg, send_msg
from mgpu.state.memory.store import SnapshotStore

__all__ = ["Budget", "ReplicaServer"]

log = logging.getLogger("mgpu.train")

Budget = Optional[Callable[[int, int], Optional[str]]]
"""Why a replica of `size` bytes cannot go into a slot whose file is `reused` bytes now (None: it can); None: any."""


class ReplicaServer:
    """Holds the replica of one rank (`store`, with that rank's identity) and serves that rank, one connection at
    a time on a daemon thread: `put` (a snapshot, written into the older slot, committed only whole and with the
    sender's CRC-32; an announced size its `budget` refuses is refused before the slot is touched), `list` (the
    valid steps), `get` (one step's file)."""

    def __init__(self, store: SnapshotStore, host: str, token: str, timeout: float = TIMEOUT_S,
                 budget: Budget = None, own: SnapshotStore | None = None) -> None:
        self.store, self.token, self.timeout, self.budget = store, token, timeout, budget
        self.own = own
        """This rank's own snapshots: `own-list` and `own-get` give the ones any rank may resume from (a survivor's
        save, mgpu.state.memory.step_mark) to the rank whose replica this holds."""
        self.listener = socket.create_server((host, 0))
        self.listener.settimeout(0.2)  # the accept loop looks at `closing` this often
        self.address = f"{host}:{self.listener.getsockname()[1]}"
        self.closing = False
        self._active: socket.socket | None = None
        self._failed = False
        self._thread = threading.Thread(target=self._serve, name="mgpu-replica-server", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self.closing:
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed
            with conn:
                self._active = conn
                try:
                    conn.settimeout(self.timeout)
                    self._handle(conn)
                except Exception as error:  # noqa: BLE001  # a bad or torn request ends its connection, never the server
                    if not self.closing and not self._failed:  # a sender killed mid-transfer, mostly: no warning
                        self._failed = True
                        log.info("replica of rank %d: a request failed, the previous replica kept: %s: %s (said once)",
                                 self.store.identity.rank, type(error).__name__, error)
                finally:
                    self._active = None

    def _handle(self, conn: socket.socket) -> None:
        request = recv_msg(conn)
        send_msg(conn, self._answer(conn, request))

    def _answer(self, conn: socket.socket, request: dict[str, Any]) -> dict[str, Any]:
        """The answer to `request` (a `get`'s content sent already after its own header; a `put`'s received)."""
        if not hmac.compare_digest(str(request.get("token", "")), self.token):
            return {"ok": False, "why": "bad token"}
        asked = request.get("identity")
        if asked != asdict(self.store.identity):
            return {"ok": False, "why": f"stale: this holds {asdict(self.store.identity)}, asked for {asked}"}
        if self.closing:
            return {"ok": False, "why": "closing"}
        op = request.get("op")
        if op == "list":
            return {"ok": True, "steps": self.store.restorable(self._say)}
        if op == "own-list":
            return {"ok": True, "steps": self.own.shared_steps(bool(request.get("rank0"))) if self.own else []}
        if op in ("get", "own-get"):
            source = self.store if op == "get" else self.own
            try:
                if source is None or (op == "own-get" and int(request["step"]) not in
                                      source.shared_steps(bool(request.get("rank0")))):
                    raise FileNotFoundError(f"no snapshot of step {request.get('step')} to share")
                content = source.read(int(request["step"]), lambda file: file.read())
            except FileNotFoundError as error:
                return {"ok": False, "why": str(error)}
            send_msg(conn, {"ok": True, "bytes": len(content), "crc32": crc_text(content)})
            conn.sendall(content)
            return {"ok": True}
        if op == "put":
            size, crc, step = request.get("bytes"), request.get("crc32"), request.get("step")
            if not (type(size) is int and size >= 0 and type(step) is int and step >= 0 and isinstance(crc, str)):
                return {"ok": False, "why": f"a put of step {step!r} announcing {size!r} bytes"}
            reused = self.store.slot_bytes(self.store.next_slot())
            if self.budget is not None and (refusal := self.budget(size, reused)) is not None:  # before the slot is touched: the replica it holds stays whole
                log.warning("checkpoint.memory_every_steps: replica of rank %d: step %d refused: %s",
                            self.store.identity.rank, step, refusal)
                return {"ok": False, "why": f"refused by its holder: {refusal}"}
            send_msg(conn, {"ok": True})

            def receive(file: Any) -> None:
                left, mine = size, 0
                while left:
                    chunk = conn.recv(min(left, CHUNK))
                    if not chunk:
                        raise ConnectionError(f"the sender closed the connection {left} of {size} bytes short")
                    file.write(chunk)
                    mine, left = crc32(chunk, mine), left - len(chunk)
                if f"{mine:08x}" != crc:
                    raise Refused("torn: the bytes received are not the sender's CRC-32")

            self.store.write(step, receive)  # raises before its commit record on a torn transfer
            return {"ok": True}
        return {"ok": False, "why": f"unknown op {op!r}"}

    def _say(self, line: str) -> None:
        log.warning("checkpoint.memory_every_steps: replica of rank %d held here: %s", self.store.identity.rank, line)

    def close(self, timeout: float = 5.0) -> None:
        """Stop serving: a transfer under way is cut (never committed), the thread joined (bounded)."""
        self.closing = True
        with contextlib.suppress(OSError):
            self.listener.close()
        active = self._active
        if active is not None:
            with contextlib.suppress(OSError):
                active.shutdown(socket.SHUT_RDWR)
        self._thread.join(timeout)
