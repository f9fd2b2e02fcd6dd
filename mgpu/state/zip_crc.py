"""torch.save without its zip CRC32s, in one thread, for bytes that mgpu's own checksum covers (mgpu.state.digest).

torch reads whether to compute the CRC32 of every zip record from a process-wide setting
(`torch.serialization.get_crc32_options()`), once per torch.save, when it opens its zip writer. Changing that
setting would change every thread's torch.save, a user's own included. So the function torch reads is wrapped
once, and the wrapper answers False only in a thread inside `without_zip_crc32()`: every other thread, and this
one outside the block, gets torch's setting as before. torch.load does not check these CRCs (they are 0 in the
files written so); mgpu's checksum in the manifest or meta.json is what catches a torn or altered file.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Callable, Iterator

import torch.serialization

__all__ = ["available", "without_zip_crc32"]

_local = threading.local()
_lock = threading.Lock()


def _skipping() -> bool:
    return getattr(_local, "depth", 0) > 0


def _install() -> bool:
    """Wrap torch's getter (once per process); False where this torch has no such getter."""
    with _lock:
        current = getattr(torch.serialization, "get_crc32_options", None)
        if current is None:
            return False
        if getattr(current, "_mgpu_thread_scoped", False):
            return True
        original: Callable[[], bool] = current

        def get_crc32_options() -> bool:
            return False if _skipping() else original()

        get_crc32_options.__doc__ = original.__doc__
        get_crc32_options._mgpu_thread_scoped = True  # type: ignore[attr-defined]  # a marker on the function: wrapped once
        get_crc32_options.__wrapped__ = original  # type: ignore[attr-defined]  # functools.wraps's attribute, set by hand
        setattr(torch.serialization, "get_crc32_options", get_crc32_options)
        return True


def available() -> bool:
    """Whether `without_zip_crc32()` takes effect with this torch (else torch.save keeps its CRCs)."""
    return _install()


@contextmanager
def without_zip_crc32(enabled: bool = True) -> Iterator[None]:
    """torch.save called by this thread inside the block writes no zip CRC32s (`enabled=False`: a no-op)."""
    if not (enabled and _install()):
        yield
        return
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1
