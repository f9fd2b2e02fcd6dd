"""Whether a resume could read a state back: torch.load(weights_only=True) of its structure, tensors left out, and
the key to blame when it could not (checked at a process's first save, not days later at the resume)."""

from __future__ import annotations

import copy
import io
import re
from typing import Any

import torch

from mgpu.state.checkpoint_format import CheckpointError, one_line

__all__ = ["check_loadable"]


def _skeleton(value: Any) -> Any:
    """`value` with every tensor replaced by an empty one of its dtype: the pickled structure, no data."""
    if isinstance(value, torch.Tensor):
        return torch.empty(0, dtype=value.dtype)
    if isinstance(value, dict):
        out = copy.copy(value)
        for key, item in value.items():
            out[key] = _skeleton(item)
        return out
    if isinstance(value, list):
        return [_skeleton(item) for item in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_skeleton(item) for item in value)
    return value


def _load_problem(value: Any) -> str | None:
    """Why `torch.load(weights_only=True)` would not read `value` back (None: it would)."""
    buffer = io.BytesIO()
    try:
        torch.save(value, buffer)
        buffer.seek(0)
        torch.load(buffer, weights_only=True)
    except Exception as error:  # noqa: BLE001  (any refusal is the answer)
        lines = [re.sub(r"\x1b\[[0-9;]*m", "", line).strip() for line in str(error).splitlines() if line.strip()]
        telling = [line for line in lines if "Unsupported" in line or "GLOBAL" in line]
        return one_line((telling or lines or [type(error).__name__])[0], 200)
    return None


def _offender(value: Any, path: str) -> tuple[str, Any]:
    """The innermost key of `value` (a skeleton) whose content alone cannot be loaded back."""
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, (list, tuple)) \
        and not hasattr(value, "_fields") else ()
    for key, item in items:
        if _load_problem({"x": item}) is not None:
            return _offender(item, f"{path}.{key}" if isinstance(value, dict) else f"{path}[{key}]")
    return path, value


def check_loadable(state: dict[str, Any]) -> None:
    """CheckpointError naming the key whose value a resume could not load (torch.load(weights_only=True)).

    A custom object in a state_dict saves fine and fails only at the first resume, days later; this
    finds it at the first save. Tensors are replaced by empty ones, so it costs no copy of the data."""
    skeleton = _skeleton(state)
    problem = _load_problem(skeleton)
    if problem is None:
        return
    path, value = _offender(skeleton, "state")
    raise CheckpointError(f"checkpoint {path} holds a {type(value).__name__}, which a resume cannot load with "
                          f"torch.load(weights_only=True) ({problem}): keep state_dict() values to tensors, "
                          f"numbers, strings, lists, tuples and dicts")
