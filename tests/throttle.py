"""Reads slowed down by the kernel, for the tests of a resume from a slow filesystem (issue 46): a blkio cgroup
whose processes read the block device under a directory at a given rate. The block layer throttles every read
that reaches the device, read() and the page faults of a memory-mapped file alike, as a loaded network
filesystem or a throttled volume does; nothing in mgpu is changed or hooked. What is in the page cache is not
read from the device, so the files a test reads slowly are evicted from it first (`evict`).

Needs root and cgroup v1's blkio controller (or v2's io controller), and a directory on a block device:
`throttled_reads` skips the test without them, except in CI (CI=true), where they must be there.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path
from typing import Iterator

import pytest

V1 = Path("/sys/fs/cgroup/blkio")
V2 = Path("/sys/fs/cgroup")


def _unavailable(why: str) -> None:
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"reads cannot be throttled here ({why}): CI must run this test")
    pytest.skip(f"reads cannot be throttled here: {why}")


def _disk(directory: Path) -> str | None:
    """`major:minor` of the whole disk `directory` is on (a partition's disk), or None (tmpfs, overlay)."""
    device = os.stat(directory).st_dev
    node = Path(f"/sys/dev/block/{os.major(device)}:{os.minor(device)}")
    if not node.exists():
        return None
    if (node / "partition").exists():
        return (node.resolve().parent / "dev").read_text().strip()
    return f"{os.major(device)}:{os.minor(device)}"


@contextlib.contextmanager
def throttled_reads(directory: Path, bytes_per_s: int) -> Iterator[Path]:
    """A fresh cgroup whose processes read the disk under `directory` at `bytes_per_s` at most; yields its
    `cgroup.procs` (write a pid there to put that process in). Removed after, its processes moved out first."""
    if os.geteuid() != 0:
        _unavailable("not root")
    disk = _disk(directory)
    if disk is None:
        _unavailable(f"{directory} is not on a block device")
    name = f"mgpu-test-{os.getpid()}-{secrets.token_hex(3)}"
    if (V1 / "blkio.throttle.read_bps_device").exists():
        group, rule, root = V1 / name, ("blkio.throttle.read_bps_device", f"{disk} {bytes_per_s}"), V1
    elif "io" in (V2 / "cgroup.controllers").read_text(errors="replace").split() if (V2 / "cgroup.controllers").exists() \
            else False:
        group, rule, root = V2 / name, ("io.max", f"{disk} rbps={bytes_per_s}"), V2
    else:
        _unavailable("no blkio (v1) or io (v2) controller")
    try:
        group.mkdir()
        (group / rule[0]).write_text(rule[1] + "\n")
    except OSError as error:
        with contextlib.suppress(OSError):
            group.rmdir()
        _unavailable(f"{group}: {error}")
    try:
        yield group / "cgroup.procs"
    finally:
        for pid in (group / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):
                (root / "cgroup.procs").write_text(pid + "\n")
        with contextlib.suppress(OSError):
            group.rmdir()


def evict(*paths: Path) -> None:
    """Drop the files under `paths` from the page cache (their next reads come from the device). Clean pages
    only: each file is flushed first."""
    for top in paths:
        for path in [top] if top.is_file() else [p for p in top.rglob("*") if p.is_file()]:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
