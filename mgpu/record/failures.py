"""Each rank's own failure, as a file of its own: `<run>/failures/<job>-<restart>-rank<N>-<pid>.json`. No torch.

When a step fails, every rank with an error of its own records it. Appended to the ledger, those are
concurrent `O_APPEND` writes from many nodes at the same moment, which NFS does not make atomic (each client
computes the end of the file itself: lines overwrite each other). Here each rank writes its own small file,
atomically (a temporary file renamed over it): no two writers ever share a file, whatever the filesystem.
The ledger keeps one writer for failures per job, rank 0; the readers (`mgpu.record.runview.RunView.load`, for
`status` and `submit.py --wait`) merge these records in as `failed` events, in time order.
"""

from __future__ import annotations

import heapq
import json
import os
import re
from pathlib import Path
from typing import Any

from mgpu.fsutil import read_bounded, write_atomic

__all__ = ["failure_file", "merge", "read_failures", "record_failure"]

MAX_RECORD_BYTES = 64 * 1024
MAX_RECORDS = 4096
"""Read at most this many (a 10,000-rank crash still reads in a second; the newest attempt's come first)."""
_SAFE = re.compile(r"[^A-Za-z0-9_.+-]")


def failures_dir(run_path: Path) -> Path:
    return run_path / "failures"


def failure_file(run_path: Path, job_id: str, restart: int, rank: int, pid: int) -> Path:
    """One process's (a step restarted in the same allocation keeps the job's restart count: the pid tells it)."""
    return failures_dir(run_path) / f"{_SAFE.sub('_', job_id)}-{restart}-rank{rank}-{pid}.json"


def record_failure(run_path: Path, job_id: str, restart: int, rank: int, fields: dict[str, Any],
                   now: float) -> None:
    """This rank's failure, as the ledger's `failed` event would hold it, in a file of its own (OSError: the
    caller's; a full disk must not hide the failure that brought us here)."""
    record = {"time": round(now, 3), "event": "failed", "job_id": job_id, "restart": restart, "rank": rank, **fields}
    path = failure_file(run_path, job_id, restart, rank, os.getpid())
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, (json.dumps(record, default=str) + "\n").encode())


def read_failures(run_path: Path) -> list[dict[str, Any]]:
    """Every rank's failure record under the run (well-formed ones: a numeric time, event `failed`)."""
    folder = failures_dir(run_path)
    try:
        paths = sorted(folder.glob("*-rank*-*.json"), key=lambda p: p.stat().st_mtime, reverse=True)[:MAX_RECORDS]
    except OSError:
        return []
    found = []
    for path in paths:
        try:
            data, _ = read_bounded(path, MAX_RECORD_BYTES)
            record = json.loads(data)
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and record.get("event") == "failed" and isinstance(record.get("time"), (int, float)) \
                and not isinstance(record.get("time"), bool):
            found.append(record)
    return found


def merge(events: list[dict[str, Any]], records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ledger's events with the ranks' failure records among them by time; the ledger's own order is kept
    as it is (its writers' clocks may differ a little)."""
    if not records:
        return events
    # Records of the same millisecond in rank order (the files are listed newest first, which is no order), and
    # before a ledger event of that millisecond: a rank's own error comes before what rank 0 saw of it.
    ordered = sorted(records, key=lambda e: (e["time"], e.get("rank") if isinstance(e.get("rank"), int) else -1))
    return list(heapq.merge(ordered, events, key=lambda e: e["time"]))
