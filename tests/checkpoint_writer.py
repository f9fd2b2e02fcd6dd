"""Helper for the kill-during-save test: a server that forks one writer process per trial.

Commands, one a line on stdin:
  `trial DIR`  fork a child that saves step 1 normally, then step 2 slowly; the child prints
               `writing PID` as step 2's state.pt starts and `done PID` once step 2 is saved.
  `reap`       wait for that child (killed by the test, or finished) and print `reaped STATUS`.
The child is not reaped before `reap`, so the pid the test kills cannot have been reused. Importing
torch once and forking keeps 20 trials quick on a small machine; each child is a real process
SIGKILLed mid-save.
"""

from __future__ import annotations

import io
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from mgpu.state.single.store import CheckpointStore

NUMEL = 64 * 1024  # float32: 256 KiB of state.pt
CHUNK = 4096
CHUNK_PAUSE = 0.002
FSYNC_PAUSE = 0.015  # widens the windows after each fsync, so kills also land in the later phases

_real_fsync = os.fsync


def _slow_fsync(fd: int) -> None:
    _real_fsync(fd)
    time.sleep(FSYNC_PAUSE)


def _say(line: str) -> None:
    os.write(1, f"{line}\n".encode())


def _slow_writer(state: dict[str, Any], path: Path) -> None:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    data = buffer.getvalue()
    _say(f"writing {os.getpid()}")
    with open(path, "wb") as file:
        for start in range(0, len(data), CHUNK):
            file.write(data[start:start + CHUNK])
            file.flush()
            if start // CHUNK % 16 == 15:
                _real_fsync(file.fileno())
            time.sleep(CHUNK_PAUSE)


def _child(directory: Path) -> None:
    CheckpointStore(directory).save({"w": torch.full((NUMEL,), 1.0), "step": 1}, 1)
    os.fsync = _slow_fsync
    store = CheckpointStore(directory, writer=_slow_writer)
    store.save({"w": torch.full((NUMEL,), 2.0), "step": 2}, 2, is_best=True, extra={"phase": "second"})
    _say(f"done {os.getpid()}")


def main() -> None:
    child = 0
    for line in sys.stdin:
        command, _, argument = line.strip().partition(" ")
        if command == "trial":
            child = os.fork()
            if child == 0:
                code = 0
                try:
                    _child(Path(argument))
                except BaseException:
                    traceback.print_exc()
                    code = 1
                finally:
                    sys.stderr.flush()
                    os._exit(code)
        elif command == "reap":
            _, status = os.waitpid(child, 0)
            print(f"reaped {status}", flush=True)


if __name__ == "__main__":
    main()
