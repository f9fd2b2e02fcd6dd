"""Read back what wandb wrote offline: a run's `.wandb` file is wandb's transaction log (LevelDB's log
framing: 32 KiB blocks of checksummed chunks) of `wandb.proto` Record messages, decoded here with wandb's
own protobuf schema (wandb 0.31 ships no Python reader of its own: its core is a Go binary)."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any, Iterator

HEADER = 7  # ":W&B", a 2-byte magic, a version byte
BLOCK = 32768
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> Iterator[bytes]:
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a wandb transaction log"
    pos, pending = HEADER, b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == FULL:
            yield chunk
        elif kind == FIRST:
            pending = chunk
        elif kind == MIDDLE:
            pending += chunk
        elif kind == LAST:
            yield pending + chunk


def wandb_history(wandb_dir: Path) -> list[tuple[str, list[dict[str, Any]]]]:
    """Every offline run under `wandb_dir`, oldest first: (run id, its logged rows with `_step`)."""
    from wandb.proto import wandb_internal_pb2 as pb

    runs = []
    for path in sorted(wandb_dir.glob("offline-run-*/run-*.wandb")):
        run_id, rows = "", []
        for raw in records(path):
            record = pb.Record()
            record.ParseFromString(raw)
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run_id = record.run.run_id
            elif kind == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
        runs.append((run_id, rows))
    return runs
