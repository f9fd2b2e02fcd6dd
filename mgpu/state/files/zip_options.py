"""torch.save's zip writer set up for mgpu's checkpoint files, in one thread: no zip CRC32s, where mgpu's own
checksum (mgpu.state.files.digest) covers the same bytes, and storages at page-aligned file offsets, where an O_DIRECT
file (mgpu.state.files.direct_io) can then write a page-aligned tensor straight from its memory.

torch reads both from process-wide settings (`torch.serialization.get_crc32_options()` and
`_get_storage_alignment()`), once per torch.save, when it opens its zip writer. Changing a setting would change
every thread's torch.save, a user's own included. So each function torch reads is wrapped once, and the wrapper
answers mgpu's value only in a thread inside the block (`without_zip_crc32()`, `page_aligned_storages()`): every
other thread, and this one outside the block, gets torch's setting as before. torch.load checks neither the CRCs
(0 in the files written so) nor the alignment (the offsets are in the archive); mgpu's checksum in the manifest or
meta.json is what catches a torn or altered file.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
import torch.serialization

__all__ = ["PAGE", "align_next_saves", "available", "holds_storage_of", "next_saves_aligned", "page_aligned_storages",
           "without_zip_crc32"]

PAGE = 4096
"""The storage alignment inside `page_aligned_storages()`: O_DIRECT's (mgpu.state.files.direct_io.ALIGN)."""

_local = threading.local()
_SET = ":set"  # a thread's setting by align_next_saves, beside its blocks' count
_lock = threading.Lock()


def _install(name: str, override: Any) -> bool:
    """Wrap torch.serialization's getter `name` (once per process) so that it answers `override` in a thread inside
    a block for it; False where this torch has no such getter."""
    with _lock:
        current = getattr(torch.serialization, name, None)
        if current is None:
            return False
        if getattr(current, "_mgpu_thread_scoped", False):
            return True
        original: Callable[[], Any] = current

        def getter() -> Any:
            return override if getattr(_local, name, 0) > 0 or getattr(_local, name + _SET, False) else original()

        getter.__name__ = name
        getter.__doc__ = original.__doc__
        getter._mgpu_thread_scoped = True  # type: ignore[attr-defined]  # a marker on the function: wrapped once
        getter.__wrapped__ = original  # type: ignore[attr-defined]  # functools.wraps's attribute, set by hand
        setattr(torch.serialization, name, getter)
        return True


def available() -> bool:
    """Whether `without_zip_crc32()` takes effect with this torch (else torch.save keeps its CRCs)."""
    return _install("get_crc32_options", False)


@contextmanager
def _scoped(name: str, override: Any, enabled: bool) -> Iterator[None]:
    if not (enabled and _install(name, override)):
        yield
        return
    setattr(_local, name, getattr(_local, name, 0) + 1)
    try:
        yield
    finally:
        setattr(_local, name, getattr(_local, name) - 1)


@contextmanager
def without_zip_crc32(enabled: bool = True) -> Iterator[None]:
    """torch.save called by this thread inside the block writes no zip CRC32s (`enabled=False`: a no-op)."""
    with _scoped("get_crc32_options", False, enabled):
        yield


@contextmanager
def page_aligned_storages(enabled: bool = True) -> Iterator[None]:
    """torch.save called by this thread inside the block starts every storage's bytes at a multiple of PAGE from
    the file's start (torch's default: 64); a no-op with a torch that has no such setting, or `enabled=False`."""
    with _scoped("_get_storage_alignment", PAGE, enabled):
        yield


def align_next_saves(enabled: bool) -> None:
    """torch.save called by this thread from now on starts every storage at a multiple of PAGE (`enabled`), or at
    torch's alignment again (False): for a writer that decides per saved object, where no block can span both the
    decision and the save (DCP's planner resolves a tensor, its writer then saves it: mgpu.state.sharded.staging)."""
    if _install("_get_storage_alignment", PAGE):
        setattr(_local, "_get_storage_alignment" + _SET, enabled)


def next_saves_aligned() -> bool:
    """Whether this thread's torch.save calls start every storage at a multiple of PAGE (a block, or
    `align_next_saves`)."""
    name = "_get_storage_alignment"
    return getattr(_local, name, 0) > 0 or bool(getattr(_local, name + _SET, False))


def holds_storage_of(state: Any, nbytes: int | None = None) -> bool:
    """Whether `state` (nested dicts, lists and tuples) holds a tensor whose storage has at least `nbytes` bytes
    (None: what an O_DIRECT file writes in place, mgpu.state.files.direct_io.IN_PLACE_BYTES). Whether to page-align a
    state's storages: torch's writer has one alignment per archive and pads every record to it, so a state without
    such a tensor (a test task's: 17.7 kB) grew to 162 kB, with nothing written in place to gain from it."""
    if nbytes is None:
        from mgpu.state.files import direct_io

        nbytes = direct_io.IN_PLACE_BYTES
    stack = [state]
    while stack:
        value = stack.pop()
        if isinstance(value, torch.Tensor):
            if value.untyped_storage().nbytes() >= nbytes:
                return True
        elif isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, (list, tuple)):
            stack.extend(value)
    return False
