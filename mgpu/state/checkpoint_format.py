"""One checkpoint directory on disk: its names, its format, its errors, and how it is verified and loaded.

`step_XXXXXXXX/` holds `state.pt` and then `meta.json` (format FORMAT: step, size, checksum, extra; a newer format is
refused as `NewerFormat`, never passed over for an older checkpoint); `latest` and
`best` are one-line files naming one. A save is built under a claimed `.tmp-*` path and renamed into place
(`claimed`, `exchange_paths`). A run's directory of them is mgpu.state.step_dirs; what writes state.pt into it is
mgpu.state.single.store's CheckpointStore;
mgpu.state.sharded.checkpointer's format shares the names, the errors and the claims.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import os
import re
import secrets
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

import torch

from mgpu.errors import MgpuError
from mgpu.state.files.digest import mismatch
from mgpu.state.files.removal import remove_path

__all__ = ["BEST", "FORMAT", "LATEST", "META_FILE", "STATE_FILE", "STEP_DIR", "TMP_PREFIX", "CheckpointError",
           "CheckpointSuperseded", "CheckpointWriteError", "InvalidCheckpoint", "LoadedCheckpoint", "NewerFormat",
           "SavedCheckpoint", "active_claims", "checked_extra", "claim", "claimed", "describe_os_error", "exchange_paths",
           "newer_format", "one_line", "refuse_newer", "release", "remove_path",
           "sha256_file", "tmp_name", "verify_and_load"]

FORMAT = 1
STATE_FILE = "state.pt"
META_FILE = "meta.json"
LATEST = "latest"
BEST = "best"
STEP_DIR = re.compile(r"step_(\d{8,})")
TMP_PREFIX = ".tmp-"
_CHUNK = 1 << 20


# Temporary paths of this process's saves in flight: stale-file cleanup must leave them alone.
_ACTIVE: set[Path] = set()
_ACTIVE_LOCK = threading.Lock()


class CheckpointError(MgpuError):
    """No usable checkpoint, or a save that cannot be made."""


class CheckpointSuperseded(CheckpointError):
    """A background save dropped before its write began: a newer save came while it waited for the writer."""

    def __init__(self, step: int, by: int) -> None:
        super().__init__(f"checkpoint step {step} superseded by step {by} before its write began")
        self.step, self.by = step, by


class CheckpointWriteError(CheckpointError):
    """The filesystem refused a save (disk full, quota, I/O error): the message names the errno and the path."""

    def __init__(self, message: str, errno_code: int | None = None) -> None:
        super().__init__(message)
        self.errno = errno_code


def describe_os_error(error: OSError, fallback: Path) -> str:
    """What the filesystem refused, in words, with the errno's name and the path ("disk full (ENOSPC) at ...")."""
    name = errno.errorcode.get(error.errno or 0, "")
    what = {errno.ENOSPC: "disk full", errno.EDQUOT: "disk quota exceeded", errno.EIO: "I/O error",
            errno.EROFS: "read-only filesystem", errno.EACCES: "permission denied"}.get(error.errno or 0,
                                                                                        error.strerror or str(error))
    return f"{what} ({name or 'no errno'}) at {error.filename or fallback}"


@dataclass(frozen=True)
class SavedCheckpoint:
    path: Path
    step: int
    bytes: int
    seconds: float  # wall time of the whole write: snapshot, blocking and background parts (not the queue's wait)
    queued_s: float = 0.0  # how long its snapshot waited for the writer (a save queued behind another)


@dataclass(frozen=True)
class LoadedCheckpoint:
    path: Path
    step: int
    state: dict[str, Any]
    meta: dict[str, Any]
    skipped: tuple[tuple[Path, str], ...]  # checkpoints tried first and rejected: (path, reason)
    unverified: Mapping[str, Any] = field(default_factory=dict)
    """Sharded: the shard files whose checksums the load checks as it reads them (name -> manifest line;
    mgpu.state.sharded.verify), and `own`: those this rank answers for. Empty: every file verified already."""


class InvalidCheckpoint(Exception):
    """A checkpoint directory that fails verification; the message names the bad file."""


class NewerFormat(CheckpointError):
    """A checkpoint written by a newer mgpu: never read (what it holds may mean something else), never passed over
    for an older one (the run would go on from there and save over the newer step), never overwritten."""

    def __init__(self, path: Path, written: int, reads: int) -> None:
        super().__init__(f"checkpoint {path} was written by mgpu format {written}; this mgpu reads up to {reads}: "
                         f"resume this run with the newer mgpu (nothing was changed), or start a new run "
                         f"(run.name=...)")
        self.path, self.written, self.reads = path, written, reads


def newer_format(path: Path, meta: object, reads: int) -> NewerFormat | None:
    """The refusal of a checkpoint whose metadata `meta` names a format newer than `reads` (None: not newer)."""
    written = meta.get("format") if isinstance(meta, dict) else None
    return NewerFormat(path, written, reads) if type(written) is int and written > reads else None


def refuse_newer(paths: Iterable[Path], reads: int) -> None:
    """NewerFormat for the first of the step directories `paths` whose meta.json a format newer than `reads` wrote:
    a run holding one is not resumed from any of its checkpoints (whatever it went on from, its next saves could
    replace that one). A meta.json that cannot be read is the verification's to refuse, not this."""
    for path in paths:
        try:
            meta = json.loads((path / META_FILE).read_text())
        except (OSError, ValueError):
            continue
        if (newer := newer_format(path, meta, reads)) is not None:
            raise newer


def one_line(text: object, limit: int = 500) -> str:
    """`text` on one line (whitespace runs become one space), cut to `limit` characters."""
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[:limit] + "..."


def tmp_name(label: str) -> str:
    return f"{TMP_PREFIX}{label}-{os.getpid()}-{secrets.token_hex(4)}"


def sha256_file(path: Path) -> str:
    """The sha256 of a file's bytes, hex (checkpoints saved before the crc32 digest record it)."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def checksum_mismatch(path: Path, meta: dict[str, Any]) -> str | None:
    """Why `path` does not match the checksum `meta` records (None: it does): a checkpoint saved before
    mgpu.state.files.digest records the sha256 of the whole file."""
    if "checksum" in meta:
        return mismatch(path, meta["checksum"])
    sha = sha256_file(path)
    if sha != meta["sha256"]:
        return f"{path} has sha256 {sha[:16]}..., {META_FILE} says {meta['sha256'][:16]}... (corrupted)"
    return None


def active_claims() -> set[Path]:
    """The temporary paths this process's saves are writing now (a stale-file cleanup leaves them alone)."""
    with _ACTIVE_LOCK:
        return set(_ACTIVE)


def claim(path: Path) -> None:
    """Mark a temporary path as this process's until `release(path)`: a stale-file cleanup leaves it alone."""
    with _ACTIVE_LOCK:
        _ACTIVE.add(path)


def release(path: Path) -> None:
    with _ACTIVE_LOCK:
        _ACTIVE.discard(path)


@contextmanager
def claimed(path: Path) -> Iterator[Path]:
    """Mark a temporary path as this process's while the block runs, and remove whatever is left at it."""
    claim(path)
    try:
        yield path
    finally:
        try:
            remove_path(path)
        finally:
            release(path)


def exchange_paths(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError, TypeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd, renameexchange_paths = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), renameexchange_paths) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def verify_and_load(path: Path, skipped: tuple[tuple[Path, str], ...] = (), verify: bool = True) -> LoadedCheckpoint:
    """Check size and checksum (`verify`), then load memory-mapped: ranks on one node then share the page
    cache's one copy of the file instead of each reading its own."""
    match = STEP_DIR.fullmatch(path.name)
    if match is None:
        raise InvalidCheckpoint(f"{path} is not a step_XXXXXXXX checkpoint directory")
    step, meta_path, state_path = int(match[1]), path / META_FILE, path / STATE_FILE
    try:
        meta = json.loads(meta_path.read_text())
    except FileNotFoundError:
        raise InvalidCheckpoint(f"{meta_path} is missing (incomplete save)") from None
    except (OSError, ValueError) as e:
        raise InvalidCheckpoint(f"{meta_path} is unreadable: {e}") from None
    if (newer := newer_format(path, meta, FORMAT)) is not None:
        raise newer
    if not (isinstance(meta, dict) and meta.get("format") == FORMAT and meta.get("step") == step
            and (isinstance(meta.get("sha256"), str) or isinstance(meta.get("checksum"), dict))
            and isinstance(meta.get("bytes"), int)):
        raise InvalidCheckpoint(f"{meta_path} is not format-{FORMAT} metadata for step {step}")
    try:
        size = state_path.stat().st_size
        if size != meta["bytes"]:
            raise InvalidCheckpoint(f"{state_path} is {size} bytes, {META_FILE} says {meta['bytes']} (truncated?)")
        problem = checksum_mismatch(state_path, meta) if verify else None
    except OSError as e:
        raise InvalidCheckpoint(f"{state_path} is unreadable: {e.strerror}") from None
    if problem is not None:
        raise InvalidCheckpoint(problem)
    try:
        state = torch.load(state_path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:
        raise InvalidCheckpoint(f"{state_path} does not load with weights_only=True: {e}") from None
    if not isinstance(state, dict):
        raise InvalidCheckpoint(f"{state_path} holds a {type(state).__name__}, not a dict")
    return LoadedCheckpoint(path=path, step=step, state=state, meta=meta, skipped=skipped)


def checked_extra(state: object, step: object, extra: dict[str, Any] | None) -> dict[str, Any]:
    """Reject bad arguments before any work; returns a private copy of `extra`."""
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint state must be a dict, got {type(state).__name__}")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"checkpoint step must be an int >= 0, got {step!r}")
    try:
        return json.loads(json.dumps(extra or {}))
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"checkpoint extra metadata must be JSON-serialisable: {e}") from None


