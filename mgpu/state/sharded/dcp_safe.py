"""Reading DCP's files without running their code: the `.metadata` pickle through an allow-list unpickler (DCP's
own record classes, torch.Size, dtypes and layouts), every other value with torch.load(weights_only=True); and the
saved module a DCP key belongs to."""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner

__all__ = ["SafeEmptyPlanner", "SafeLoadPlanner", "SafeReader", "module_of"]

_METADATA_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "StorageMeta", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "_MEM_FORMAT_ENCODING")
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
     ("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"),
     ("torch.distributed.checkpoint.filesystem", "_StoragePrefix"), ("torch.serialization", "_get_layout"),
     ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath")}  # a layout by name; StorageMeta's checkpoint_id
_DTYPES = {str(getattr(torch, name)).split(".")[-1] for name in dir(torch) if isinstance(getattr(torch, name), torch.dtype)}


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's `.metadata` is a pickle: only its own record classes, torch.Size and dtypes/layouts are let in."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_GLOBALS or (module == "torch" and (
                name in _DTYPES or name in ("strided", "sparse_coo", "contiguous_format", "channels_last",
                                            "preserve_format", "channels_last_3d"))):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a checkpoint's .metadata")


class SafeReader(FileSystemReader):
    """A FileSystemReader whose `.metadata` is read by an allow-list unpickler, not pickle.load."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        from torch.distributed.checkpoint.metadata import StorageMeta

        with open(Path(self.path) / ".metadata", "rb") as file:
            metadata = _MetadataUnpickler(file).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _load_bytes_safely(planner: Any, read_item: Any, value: io.BytesIO) -> None:
    from torch.distributed.checkpoint._traverse import set_element

    loaded = torch.load(value, weights_only=True)
    if planner.flatten_state_dict:
        set_element(planner.original_state_dict, planner.mappings[read_item.dest_index.fqn], loaded)
    else:
        planner.state_dict[read_item.dest_index.fqn] = loaded


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, except that non-tensor values load with torch.load(weights_only=True)."""

    load_bytes = _load_bytes_safely


class SafeEmptyPlanner(_EmptyStateDictLoadPlanner):
    """The planner that rebuilds a state from the metadata (one process), loading values safely: the whole
    state, or (`module`) one saved module's entries alone, no optimizer tensor read."""

    load_bytes = _load_bytes_safely

    def __init__(self, module: str | None = None) -> None:
        super().__init__()
        self.module = module

    def _should_include_key(self, key: str, metadata: Any) -> bool:
        if self.module is None:
            return True
        return module_of(key, metadata) == self.module


def module_of(key: str, metadata: Any) -> str | None:
    """The saved module a DCP key of `metadata` belongs to (None: an optimizer's entry)."""
    path: tuple[Any, ...] = tuple((metadata.planner_data or {}).get(key) or (key,))
    return str(path[1]).partition(".")[0] if len(path) > 1 and path[0] == "model" else None
