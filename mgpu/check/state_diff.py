"""Two saved states compared entry by entry (pure; torch only for tensors): every value by its path in the
state (`model.0.weight`, `optimizer.state.0.exp_avg`, `rng.rank1.torch`, `loader.position`), the first
difference in the order that finds a cause before its consequences, and a hint drawn from what differs.
Used by `python -m mgpu.check.resume`."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable

__all__ = ["Difference", "differences", "flatten", "hint", "order_key", "parameter_names"]

# Bookkeeping a run writes that is not training state: equal by construction or different by design.
IGNORED = ("format", "code_version", "world_size", "config", "timings", "saved_at", "wall", "version")
# The standard entries; anything else at the top of a state is the user's own.
STANDARD = ("loader", "progress", "scheduler", "scaler", "rng", "optimizer", "model", "ddp", "stream", "files")
# Causes before consequences: where the loader or a schedule or an RNG went wrong, the weights follow. The loop's
# own entries are its counters and plain values (`<user>`: with the data position) or weights (`<user-weights>`: a
# module under a key of the loop's, an EMA, ranked with the model).
_ORDER = ("loader", "progress", "stream", "<user>", "scheduler", "scaler", "rng", "optimizer.param_groups",
          "optimizer.state", "optimizer", "model", "<user-weights>", "ddp")


@dataclass
class Difference:
    """One path whose values differ: `largest` the max absolute difference of a tensor or number (inf for
    a shape, type or presence that differs), `a` and `b` short renderings of the two values."""
    path: str
    largest: float
    a: str
    b: str
    weight: bool = False  # a floating tensor (mgpu.check.state_diff.is_weight): a consequence, not a counter


def flatten(state: Any, prefix: str = "") -> dict[str, Any]:
    """Every leaf of `state` by its dotted path; a list of per-rank RNG states as `rng.rank<R>.<kind>`."""
    out: dict[str, Any] = {}

    def walk(value: Any, path: str) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                walk(item, f"{path}.{key}" if path else str(key))
        elif isinstance(value, (list, tuple)) and path.split(".")[-1] != "python" and not _number_list(value):
            for i, item in enumerate(value):
                name = f"rank{i}" if path in ("rng", "loader.per_rank") else str(i)
                walk(item, f"{path}.{name}" if path else name)
        else:
            out[path] = value

    walk(state, prefix)
    return out


def _number_list(value: Any) -> bool:
    return bool(value) and all(isinstance(v, (int, float, bool)) for v in value)


def order_key(path: str, value: Any = None) -> tuple[int, str]:
    """Where `path` (holding `value`) comes in the search for the first difference (causes first)."""
    top = path.split(".")[0]
    if top not in STANDARD:
        return _ORDER.index("<user-weights>" if is_weight(value) else "<user>"), path
    for i, prefix in enumerate(_ORDER):
        if path == prefix or path.startswith(prefix + "."):
            return i, path
    return len(_ORDER), path


def is_weight(value: Any) -> bool:
    """A floating value (a tensor: a weight, a buffer, a moment; a float: a metric such as the best so far): the
    consequence of the steps, not a counter (an integer, which decides them)."""
    return isinstance(value, float) or bool(hasattr(value, "is_floating_point") and value.is_floating_point())


def _ignored(path: str) -> bool:
    return path.split(".")[0] in IGNORED


def _compare(a: Any, b: Any, tolerance: float) -> float:
    """0 when equal (within `tolerance`, relative to the larger magnitude, for floating values), else the
    largest absolute difference (inf when they cannot be compared)."""
    if hasattr(a, "shape") and hasattr(b, "shape"):
        import torch

        if tuple(a.shape) != tuple(b.shape) or a.dtype != b.dtype:
            return math.inf
        if torch.equal(a, b):
            return 0.0
        if not a.is_floating_point():
            return math.inf if a.numel() == 0 else float((a.double() - b.double()).abs().max())
        delta = float((a.double() - b.double()).abs().max())
        scale = max(float(a.double().abs().max()), float(b.double().abs().max()), 1e-12)
        return 0.0 if delta <= tolerance * scale else delta
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and _number_list(a) and _number_list(b):
        if len(a) != len(b):
            return math.inf
        return max((_compare(x, y, tolerance) for x, y in zip(a, b)), default=0.0)
    if type(a) is not type(b) and not (isinstance(a, (int, float)) and isinstance(b, (int, float))):
        return math.inf
    if isinstance(a, (int, float)) and not isinstance(a, bool):
        if a == b or (isinstance(a, float) and math.isnan(a) and math.isnan(b)):
            return 0.0
        delta = abs(float(a) - float(b))
        return 0.0 if delta <= tolerance * max(abs(a), abs(b)) else delta
    return 0.0 if a == b else math.inf


def _show(value: Any) -> str:
    if value is _MISSING:
        return "(absent)"
    if hasattr(value, "shape"):
        if value.numel() <= 4:
            return str(value.tolist())
        return f"tensor{list(value.shape)}"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


_MISSING = object()


def differences(a: dict[str, Any], b: dict[str, Any], *, tolerance: float = 0.0,
                skip: Iterable[str] = ()) -> list[Difference]:
    """The paths where two flattened states differ, causes first (`order_key`); `skip`: path prefixes left
    out (e.g. the RNG across a world-size change)."""
    skipped = tuple(skip)
    found = []
    for path in sorted(set(a) | set(b), key=lambda p: order_key(p, a.get(p, b.get(p)))):
        if _ignored(path) or any(path == s or path.startswith(s + ".") for s in skipped):
            continue
        x, y = a.get(path, _MISSING), b.get(path, _MISSING)
        largest = math.inf if x is _MISSING or y is _MISSING else _compare(x, y, tolerance)
        if largest:
            found.append(Difference(path, largest, _show(x), _show(y), is_weight(y if x is _MISSING else x)))
    return found


def parameter_names(flat: dict[str, Any]) -> dict[str, str]:
    """`optimizer.state.<i>` -> the model parameter it belongs to (`model.layers.3.w`), matched in order and
    by shape (an optimizer's state is keyed by index; its parameters are the model's in order)."""
    params = [p for p in flat if p.startswith("model.") and hasattr(flat[p], "shape")
              and not p.rsplit(".", 1)[-1].startswith(("running_", "num_batches"))]
    indices = sorted({int(p.split(".")[2]) for p in flat if p.startswith("optimizer.state.")
                      and p.split(".")[2].isdigit()})
    names, cursor = {}, 0
    for index in indices:
        moment = next((flat[p] for p in flat if p.startswith(f"optimizer.state.{index}.")
                       and hasattr(flat[p], "shape") and len(flat[p].shape) > 0), None)
        while cursor < len(params) and moment is not None and tuple(flat[params[cursor]].shape) != tuple(moment.shape):
            cursor += 1
        if cursor < len(params):
            names[f"optimizer.state.{index}"] = params[cursor]
            cursor += 1
    return names


def named(path: str, names: dict[str, str]) -> str:
    """`optimizer.state.3.exp_avg` as `optimizer.state.3.exp_avg (model.layers.3.w)` where the name is known."""
    parts = path.split(".")
    if len(parts) > 3 and parts[0] == "optimizer" and parts[1] == "state":
        owner = names.get(".".join(parts[:3]))
        if owner:
            return f"{path} ({owner})"
    return path


_GENERATORS = {"python": "Python's `random` (random.shuffle, random.random)", "numpy": "numpy's global generator "
               "(np.random.*)", "torch": "torch's (torch.rand, randperm, dropout)", "cuda": "the GPU's (dropout on a GPU)"}


def hint(found: list[Difference], *, outside: dict[str, str], world_changed: bool, batches_differ: bool,
         has_scheduler: bool, no_batches: bool) -> str:
    """What the differences point at, in one sentence (the first difference is the clue), from what the loop
    holds: `outside` (its objects `state` lacks, name -> kind), whether the state has a scheduler, whether its batches
    were recorded (`no_batches`: its data does not come from session.loader)."""
    first = found[0].path if found else ""
    top = first.split(".")[0]
    own_loaders = [n for n, k in outside.items() if k.startswith("DataLoader")]
    kept = ", ".join(f"`{name}` ({kind})" for name, kind in sorted(outside.items()) if not kind.startswith("DataLoader"))
    schedulers = ", ".join(f"`{n}` ({k})" for n, k in sorted(outside.items()) if k.startswith("scheduler"))
    if no_batches and own_loaders:  # the data is not the session's loader's: a DataLoader of the loop's feeds it
        return (f"no batch came from the session's loader: {', '.join(f'`{n}`' for n in own_loaders)} is a DataLoader "
                "of your own, which starts its epoch over on a resume; use session.loader(dataset, ...) and put it in "
                "`state`")
    if batches_differ and own_loaders and not first.startswith("loader"):
        return (f"the batches differ: {', '.join(f'`{n}`' for n in own_loaders)} is a DataLoader of your own, not in `state`; "
                "use session.loader(dataset, ...) and put it in `state`")
    if first.startswith(("loader", "progress", "stream")) or batches_differ:
        return ("the data differs: the loader is not the session's, not in `state`, or its source does not "
                "resume where it stopped (a shuffle buffer, a worker's own state)")
    if found and top not in STANDARD and not found[0].weight:
        return (f"your own entry `{first}` differs: a counter set on a resume from something not in `state` (a "
                "variable of yours), or counted again on a resume")
    if found and top not in STANDARD and not found[0].a.startswith(("tensor", "[")):
        return (f"your own value `{first}` differs, every saved entry before it agrees: it follows from something "
                "not in `state`, or is set again on a resume")
    if first.startswith("scheduler"):
        if world_changed:
            return ("the scheduler was built from len(loader), which changes with the world size: size it in "
                    "samples or optimizer steps of the global batch, or keep the world size")
        return "the scheduler's state differs: it is not in `state`, or it is stepped on a resume before the first step"
    if first.startswith("optimizer.param_groups"):
        if has_scheduler:
            return "the optimizer's hyperparameters differ: something sets them outside the scheduler in `state`"
        if schedulers:
            return ("the optimizer's hyperparameters (learning rate, momentum) differ and no scheduler is in `state`: a "
                    f"scheduler of yours not in `state` restarts its schedule on a resume (not in `state`: {schedulers})")
        return ("the optimizer's hyperparameters (learning rate, momentum) differ and the loop has no scheduler: it sets "
                "them from something not in `state` (a step counter in a variable of yours restarts at 0 on a "
                "resume): keep that value in `state`, or compute it from session.step (restored)")
    if first.startswith("rng"):
        which = _GENERATORS.get(first.rsplit(".", 1)[-1], "")
        return (f"an RNG stream differs{f' ({which})' if which else ''}: the loop draws random numbers on a resume "
                "that the unbroken run did not draw at that point (between session.load() and the first step, e.g. a "
                "shuffle of its own at an epoch's start, or before should_stop() returns); draw them from a "
                "generator in `state`, or after the step")
    if first.startswith("model") and first.rsplit(".", 1)[-1].startswith(("running_", "num_batches")) or (
            first.startswith("model") and not first.endswith(("weight", "bias"))):
        return "a buffer differs first: a module updated outside its forward, or a buffer left out of its state_dict"
    if first.startswith(("model", "optimizer")) or (found and top not in STANDARD):
        agree = ("the data and every saved entry before them agree" if not no_batches else
                 "every saved entry before them agrees (the loop's own data is not compared: it does not come from "
                 "session.loader)")
        if kept:
            return f"the weights differ, {agree}: objects of yours not in `state`: {kept}"
        return (f"the weights differ, {agree}: an object of yours not in `state` (a plain value, an average, a "
                "counter) that decides the step")
    return "an entry of the state differs"

