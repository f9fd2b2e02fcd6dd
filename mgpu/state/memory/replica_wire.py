"""How the two sides of a replica speak over their socket (mgpu.state.memory.replica, its client and sender;
mgpu.state.memory.replica_server, its holder): a request or an answer is a JSON header with its length in front
(`send_msg`, `recv_msg`; at most `MAX_HEADER` bytes), a snapshot's bytes follow a header that announces their size
and CRC-32 (`crc_text`). Every socket operation is bounded by the connection's timeout. No torch.
"""

from __future__ import annotations

import json
import socket
from typing import Any

from mgpu.state.files.digest import crc32

__all__ = ["CHUNK", "MAX_HEADER", "TIMEOUT_S", "Refused", "crc_text", "recv_exact", "recv_msg", "send_msg"]

TIMEOUT_S = 60.0
"""Each socket operation's bound (a connect, a send or receive of one chunk), and a partner's address lookup's."""
CHUNK = 1 << 20
MAX_HEADER = 1 << 16


class Refused(Exception):
    """The partner refused a request (a stale identity, a bad token, no such step, closing), or its answer was torn."""


def recv_exact(conn: socket.socket, size: int) -> bytes:
    """Exactly `size` bytes from `conn` (ConnectionError where it closes first)."""
    parts, left = [], size
    while left:
        chunk = conn.recv(min(left, CHUNK))
        if not chunk:
            raise ConnectionError(f"the connection closed {left} of {size} bytes short")
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


def send_msg(conn: socket.socket, message: dict[str, Any]) -> None:
    """`message` as a JSON header with its length in front."""
    data = json.dumps(message).encode()
    conn.sendall(len(data).to_bytes(4, "big") + data)


def recv_msg(conn: socket.socket) -> dict[str, Any]:
    """One header (Refused: longer than MAX_HEADER, or not a JSON object)."""
    size = int.from_bytes(recv_exact(conn, 4), "big")
    if size > MAX_HEADER:
        raise Refused(f"a header of {size} bytes")
    message = json.loads(recv_exact(conn, size))
    if not isinstance(message, dict):
        raise Refused("a header that is not an object")
    return message


def crc_text(data: bytes) -> str:
    """`data`'s CRC-32 as a header carries it: 8 hex digits."""
    return f"{crc32(data):08x}"
