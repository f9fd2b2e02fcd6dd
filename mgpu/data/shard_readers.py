"""How a ShardedStream (mgpu.data.stream) reads one kind of file: its number of samples, and sample `index` of it.

`TokenWindows` reads flat token files (.bin with a dtype, or .npy) as fixed windows; `JsonLines` reads .jsonl files
through an index of line offsets. Both count a file without keeping it open (a .bin from its size, a .npy from its
header, a .jsonl by one scan), and a reader keeps at most MAX_OPEN files mapped while it reads (the least recently
read closed first): a stream over more shards than the process may hold file descriptors (`ulimit -n`, often
1024) builds and reads as one over a few. A file that cannot be read as its kind is a StreamError in one line that
names it (a size that is not a whole number of tokens, a dtype that is not an integer one, not a .npy, a line that
is not JSON), not numpy's traceback.
"""

from __future__ import annotations

import json
import mmap
import os
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, Protocol

import numpy as np
import torch

from mgpu.errors import MgpuError

__all__ = ["MAX_OPEN", "JsonLines", "ShardReader", "StreamError", "TokenWindows", "unreadable"]

MAX_OPEN = 64
"""Files one reader keeps memory-mapped at a time (each mapping holds a file descriptor)."""


class StreamError(MgpuError):
    """A stream cannot be built or resumed as asked: the message is one line that says why."""


class ShardReader(Protocol):
    """How to read one kind of file: its number of samples, and sample `index` of it (random access)."""

    def count(self, path: str) -> int: ...

    def read(self, path: str, index: int) -> Any: ...


def unreadable(path: str, error: OSError) -> StreamError:
    """The one line for a shard the system refuses to open or read."""
    if isinstance(error, FileNotFoundError):
        return StreamError(f"shard {path} not found")
    if isinstance(error, IsADirectoryError):
        return StreamError(f"shard {path} is a directory, not a file")
    return StreamError(f"shard {path} cannot be read: {error.strerror or error}")


def _token_dtype(value: Any, where: str) -> np.dtype:
    """`value` as the integer numpy dtype of a token file; StreamError naming `where` if it is none."""
    try:
        dtype = np.dtype(value)
    except (TypeError, ValueError):
        raise StreamError(f"{where}: {value!r} is not a numpy dtype (e.g. 'uint16', 'int32')") from None
    if not np.issubdtype(dtype, np.integer):
        raise StreamError(f"{where}: token ids are integers, {dtype} is not an integer dtype (e.g. 'uint16')")
    return dtype


class TokenWindows:
    """A flat token file (.bin raw with `dtype`, or .npy) as windows of `block_size + 1` tokens: window i
    starts at token i * block_size, so consecutive windows share one token and every token but a file's
    first is a target once. `dtype` None: read from jobs/make_tokens.py's sidecar (FILE.json)."""

    def __init__(self, block_size: int, dtype: str | None = None) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, int):
            raise StreamError(f"block_size={block_size!r}: give a whole number of tokens")
        if block_size < 1:
            raise StreamError(f"block_size={block_size}: a window needs at least one token")
        if dtype is not None:
            _token_dtype(dtype, "TokenWindows dtype")
        self.block_size, self.dtype = block_size, dtype
        self._open: OrderedDict[str, np.ndarray] = OrderedDict()

    def _layout(self, path: str) -> tuple[np.dtype, int, int]:
        """(dtype, byte offset of the first token, tokens) of a shard, from its header or size: nothing kept open."""
        try:
            if path.endswith(".npy"):
                with open(path, "rb") as file:
                    try:
                        version = np.lib.format.read_magic(file)
                        shape, _, dtype = (np.lib.format.read_array_header_1_0(file) if version == (1, 0)
                                           else np.lib.format.read_array_header_2_0(file))
                    except ValueError as error:
                        raise StreamError(f"shard {path} is not a .npy file numpy can read "
                                          f"({str(error).split('.')[0]})") from None
                    offset = file.tell()
                if len(shape) != 1:
                    raise StreamError(f"{path}: a token shard is one flat array, this one has shape {shape}")
                return _token_dtype(dtype, f"shard {path}"), offset, int(shape[0])
            where = "TokenWindows dtype" if self.dtype else f"{path}'s sidecar {Path(path).with_suffix('.json').name}"
            dtype = _token_dtype(self.dtype or self._sidecar_dtype(path), where)
            size = os.stat(path).st_size
            if Path(path).is_dir():
                raise IsADirectoryError(21, "Is a directory", path)
        except OSError as error:
            raise unreadable(path, error) from None
        if size % dtype.itemsize:
            raise StreamError(f"shard {path} is {size} bytes, not a whole number of {dtype} tokens ({dtype.itemsize} "
                              f"bytes each): a file cut short, or another dtype")
        return dtype, 0, size // dtype.itemsize

    def _tokens(self, path: str) -> np.ndarray:
        tokens = self._open.get(path)
        if tokens is not None:
            self._open.move_to_end(path)
            return tokens
        dtype, offset, length = self._layout(path)
        if not length:
            tokens = np.zeros(0, dtype)
        else:
            try:
                tokens = np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=(length,))
            except OSError as error:
                raise unreadable(path, error) from None
        tokens = tokens.view(np.ndarray)  # the same mapped pages, without np.memmap's per-slice bookkeeping
        self._open[path] = tokens
        while len(self._open) > MAX_OPEN:
            self._open.popitem(last=False)  # its mapping (and descriptor) closes with its last reference
        return tokens

    @staticmethod
    def _sidecar_dtype(path: str) -> str:
        sidecar = Path(path).with_suffix(".json")
        try:
            return str(json.loads(sidecar.read_text())["dtype"])
        except (OSError, ValueError, KeyError, TypeError):
            raise StreamError(f"{path}: no dtype given and no readable sidecar {sidecar.name} with one "
                              "(TokenWindows(block_size, dtype='uint16'))") from None

    def count(self, path: str) -> int:
        return max(self._layout(path)[2] - 1, 0) // self.block_size

    def read(self, path: str, index: int) -> torch.Tensor:
        start = index * self.block_size
        return torch.from_numpy(self._tokens(path)[start:start + self.block_size + 1].astype(np.int64))

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_open": OrderedDict()}  # memory maps are reopened in each worker


class JsonLines:
    """A .jsonl file: one JSON value per non-empty line, found by a line-offset index (one scan per file
    when the stream opens, kept in memory), so sample i is read without reading lines 0..i-1."""

    def __init__(self, decode: Callable[[bytes], Any] = json.loads) -> None:
        self.decode = decode
        self._offsets: dict[str, np.ndarray] = {}

    def offsets(self, path: str) -> np.ndarray:
        """Start and end byte of every non-empty line: shape [lines, 2]."""
        found = self._offsets.get(path)
        if found is None:
            try:
                found = self._scan(path)
            except OSError as error:
                raise unreadable(path, error) from None
            self._offsets[path] = found
        return found

    @staticmethod
    def _scan(path: str) -> np.ndarray:
        with open(path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            data = np.frombuffer(mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ), np.uint8) if size \
                else np.zeros(0, np.uint8)
            ends = np.flatnonzero(data == ord("\n"))
            if size and (not len(ends) or ends[-1] != size - 1):
                ends = np.append(ends, size)  # a last line without its newline
            starts = np.concatenate([[0], ends[:-1] + 1]) if len(ends) else np.zeros(0, np.int64)
            keep = ends > starts
            del data  # the mapping, and its descriptor, closed here
        return np.stack([starts[keep], ends[keep]], axis=1).astype(np.int64)

    def count(self, path: str) -> int:
        return len(self.offsets(path))

    def read(self, path: str, index: int) -> Any:
        start, end = self.offsets(path)[index]
        try:
            with open(path, "rb") as handle:
                handle.seek(int(start))
                line = handle.read(int(end - start))
        except OSError as error:
            raise unreadable(path, error) from None
        try:
            return self.decode(line)
        except ValueError as error:  # json's JSONDecodeError, a decoder's own
            raise StreamError(f"shard {path}, record {index} (bytes {start}-{end}): not valid JSON: "
                              f"{' '.join(str(error).split())[:200]}") from None
