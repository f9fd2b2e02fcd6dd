"""What `python -m mgpu.check.resume` learns from inside a run: each rank's batches (a digest per sample, and
the sample ids where the loader has them), at a process's first step the objects of the loop's that its `state`
does not hold, and at its end a digest of those objects' states. Off (one environment lookup) unless the checker
set MGPU_CHECK_RESUME_DIR for the run; then each rank appends to `<dir>/batches.rank<R>.jsonl` and writes
`<dir>/outside.rank<R>.<pid>.json` and `<dir>/outside_end.rank<R>.<pid>.json`.

The records are a side file, never a checkpoint's content: a run under the checker trains and saves as it
would without it.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

__all__ = ["CHECK_DIR", "checking", "digest_samples", "digest_state", "record_batch", "record_step", "record_outside",
           "record_outside_end"]

CHECK_DIR = "MGPU_CHECK_RESUME_DIR"

# What a loop keeps that decides its next steps: a type by the name of one of its classes (no torch import), from
# torch (modules, optimizers, schedulers, DataLoaders, generators), numpy (a Generator: default_rng) or `random`.
_KINDS = {"Module": "module", "Optimizer": "optimizer", "LRScheduler": "scheduler", "_LRScheduler": "scheduler",
          "DataLoader": "DataLoader", "Generator": "generator", "Random": "generator", "RandomState": "generator"}
_LIBRARIES = ("torch", "numpy", "random")
_outside: dict[str, Any] = {}  # the loop's objects outside `state`, kept from its first step to its end (checker only)


def _directory() -> Path | None:
    where = os.environ.get(CHECK_DIR)
    return Path(where) if where else None


def checking() -> bool:
    """Whether this run is one of the resume check's: its periodic saves then wait for the writer instead of
    being deferred (mgpu.state.checkpointer), so that the runs it compares save the same steps at the same
    points of the loop whatever the machine's timing."""
    return _directory() is not None


def _append(name: str, record: dict[str, Any]) -> None:
    where = _directory()
    if where is None:
        return
    with open(where / name, "a") as file:
        file.write(json.dumps(record) + "\n")


def digest_samples(batch: Any) -> list[str]:
    """One short digest per sample of `batch` (tensors, numbers, strings, nested in tuples, lists and dicts;
    dimension 0 is the sample): the same samples give the same digests whatever batch they were in."""
    leaves: list[Any] = []

    def walk(value: Any) -> None:
        if isinstance(value, dict):
            for key in sorted(value, key=str):
                walk(value[key])
        elif isinstance(value, (list, tuple)) and value and not isinstance(value[0], (str, int, float)):
            for item in value:
                walk(item)
        else:
            leaves.append(value)

    walk(batch)
    size = next((len(leaf) for leaf in leaves if _sized(leaf)), 1)
    hashes = [hashlib.sha1() for _ in range(size)]
    for leaf in leaves:
        if _sized(leaf) and len(leaf) == size:
            for i in range(size):
                hashes[i].update(_bytes(leaf[i]))
        else:
            for h in hashes:
                h.update(_bytes(leaf))
    return [h.hexdigest()[:16] for h in hashes]


def _sized(leaf: Any) -> bool:
    shape = getattr(leaf, "shape", None)
    if shape is not None:
        return len(shape) > 0
    return isinstance(leaf, (list, tuple))


def _bytes(value: Any) -> bytes:
    if hasattr(value, "detach"):
        return value.detach().cpu().contiguous().numpy().tobytes() + str(value.dtype).encode()
    return repr(value).encode()


def record_batch(rank: int, epoch: int, position: int, batch: Any, ids: Any = None, workers: int = 0) -> None:
    """This rank's batch at (epoch, position after it): its samples' digests, and their ids when known."""
    if _directory() is None:
        return
    _append(f"batches.rank{rank}.jsonl", {"epoch": int(epoch), "position": int(position), "workers": workers,
                                          "ids": None if ids is None else [int(i) for i in ids],
                                          "samples": digest_samples(batch)})


def record_step(rank: int, step: int) -> None:
    """Step `step` ended on this rank (the batches recorded before it were its own)."""
    if _directory() is not None:
        _append(f"batches.rank{rank}.jsonl", {"step": int(step)})


def record_outside(rank: int, state: Any, frame: Any) -> None:
    """The loop's objects that decide its next steps (modules, optimizers, schedulers, DataLoaders,
    generators) in `frame`'s locals that `state` does not hold, by name and type: a resume rebuilds them."""
    where = _directory()
    if where is None or frame is None or state is None:
        return
    if frame.f_globals.get("__name__", "").startswith("mgpu."):
        return  # the trainer's own loop: its state is complete by construction
    held: set[int] = set()

    def hold(value: Any, depth: int = 0) -> None:
        if id(value) in held or depth > 4:
            return
        held.add(id(value))
        if isinstance(value, dict) or hasattr(value, "items"):
            try:
                for item in list(value.values()):
                    hold(item, depth + 1)
            except Exception:  # noqa: BLE001  (a mapping-like object that cannot list itself)
                pass
        elif isinstance(value, (list, tuple)):
            for item in value:
                hold(item, depth + 1)
        modules = getattr(value, "modules", None)
        if callable(modules) and (_kind(value) or "").startswith("module"):
            for sub in modules():
                held.add(id(sub))
        for attribute in ("module", "optimizer"):  # DDP's module; a scheduler's optimizer
            inner = getattr(value, attribute, None)
            if inner is not None and not isinstance(inner, (int, float, str)):
                hold(inner, depth + 1)

    hold(state)
    outside: dict[str, str] = {}
    for name, value in frame.f_locals.items():  # in the order the loop made them: an object by its first name
        if not name.startswith("_") and (kind := _kind(value)) and id(value) not in held:
            outside[name] = kind
            held.add(id(value))
    _outside.clear()
    _outside.update({name: frame.f_locals[name] for name in outside})
    if outside:
        (where / f"outside.rank{rank}.{os.getpid()}.json").write_text(json.dumps(outside))


def record_outside_end(rank: int) -> None:
    """At the run's end (the session's): a digest of the state of each object `record_outside` found outside
    `state` (None for one whose state cannot be read: a DataLoader), so that the checker can compare them with the
    unbroken run's: an EMA, a generator or a counter-holding scheduler kept outside `state` ends elsewhere."""
    where = _directory()
    if where is None or not _outside:
        return
    digests = {name: digest_state(value) for name, value in _outside.items()}
    (where / f"outside_end.rank{rank}.{os.getpid()}.json").write_text(json.dumps(digests))
    _outside.clear()


def digest_state(value: Any) -> str | None:
    """A short digest of what an object would resume from (a module's, optimizer's or scheduler's state_dict, a
    generator's state), the same for equal states; None where none can be read (a DataLoader)."""
    if type(value).__name__ == "DataLoader":
        return None
    if callable(getattr(value, "state_dict", None)):
        state = value.state_dict()
    elif callable(getattr(value, "get_state", None)):  # torch.Generator
        state = value.get_state()
    elif hasattr(value, "bit_generator"):  # numpy's Generator
        state = value.bit_generator.state
    elif callable(getattr(value, "getstate", None)):  # random.Random
        state = value.getstate()
    else:
        return None
    digest = hashlib.sha1()

    def walk(item: Any) -> None:
        if isinstance(item, dict):
            for key in sorted(item, key=str):
                digest.update(repr(key).encode())
                walk(item[key])
        elif isinstance(item, (list, tuple)):
            for part in item:
                walk(part)
        elif hasattr(item, "detach"):
            local = item.to_local() if callable(getattr(item, "to_local", None)) else item  # a DTensor: this rank's
            digest.update(_bytes(local))
        elif hasattr(item, "tobytes"):  # a numpy array
            digest.update(item.tobytes())
        elif not callable(item):
            digest.update(repr(item).encode())

    walk(state)
    return digest.hexdigest()[:16]


def _kind(value: Any) -> str | None:
    for cls in type(value).__mro__:
        if cls.__name__ in _KINDS and cls.__module__.split(".")[0] in _LIBRARIES:
            return f"{_KINDS[cls.__name__]} ({type(value).__name__})"
    return None
