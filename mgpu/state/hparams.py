"""Optimizer hyperparameters on a resume: what the restored state overrides, and changing them on purpose.

A resumed optimizer takes its hyperparameters (lr, weight decay, betas, ...) from the checkpoint: a value the
loop passes to the optimizer's constructor is silently replaced. `constructed()` notes what the loop built,
`overridden_by_checkpoint()` says what the restore replaced (a warning each), and `apply()` is the one
explicit way to change a hyperparameter of a running run: every parameter group of every optimizer in the
state gets the value; for `lr` under an LR scheduler the schedule's base LR changes and the schedule's
current factor is kept (a warmup or a decay goes on from where it stands, at the new scale), and with it every
other learning rate the schedule follows (OneCycleLR's `max_lr` and `min_lr`, CyclicLR's `max_lrs`): the whole
schedule at the new scale. A OneCycleLR's base is its `initial_lr`, `max_lr / div_factor`.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from mgpu.errors import MgpuError

__all__ = ["HYPERPARAMETERS", "apply", "constructed", "overridden_by_checkpoint"]

HYPERPARAMETERS = ("lr", "weight_decay", "momentum", "betas", "eps", "dampening")
"""The param-group keys compared on a resume (any key of a param group may be overridden)."""
_SCHEDULE_LRS = ("max_lr", "min_lr")
"""Learning rates a schedule keeps in the param group besides its base (`initial_lr`) and follows at every step
(OneCycleLR's): an `lr` override scales them with the base, or the schedule would go back to the old ones."""


def _optimizers(objects: Mapping[str, Any]) -> dict[str, Any]:
    import torch

    return {name: value for name, value in objects.items() if isinstance(value, torch.optim.Optimizer)}


def _schedulers(objects: Mapping[str, Any]) -> list[Any]:
    return [value for value in objects.values() if hasattr(value, "base_lrs") and hasattr(value, "optimizer")]


def _base(group: Mapping[str, Any], key: str) -> Any:
    # Under a scheduler `lr` moves every step; its base is what the loop chose (torch keeps it as initial_lr).
    return group.get("initial_lr", group.get("lr")) if key == "lr" else group.get(key)


def constructed(objects: Mapping[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """The hyperparameters of every optimizer in `objects` as the loop built them, before a restore."""
    return {name: [{key: _base(group, key) for key in HYPERPARAMETERS if key in group} for group in opt.param_groups]
            for name, opt in _optimizers(objects).items()}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    return bool(a == b)


def overridden_by_checkpoint(before: dict[str, list[dict[str, Any]]], objects: Mapping[str, Any],
                             override: Mapping[str, Any]) -> list[str]:
    """Lines like `optimizer lr: the loop set 0.001, the checkpoint's 0.002 is used` for every hyperparameter the
    restore replaced (those in `override` excepted: they are set next)."""
    lines = []
    for name, opt in _optimizers(objects).items():
        for index, (built, group) in enumerate(zip(before.get(name, []), opt.param_groups)):
            for key, value in built.items():
                restored = _base(group, key)
                if key not in override and not _same(value, restored):
                    where = f"{name}" if len(opt.param_groups) == 1 else f"{name} group {index}"
                    lines.append(f"{where} {key}: the loop set {value!r}, the checkpoint's {restored!r} is used")
    return lines


def apply(objects: Mapping[str, Any], override: Mapping[str, Any]) -> list[str]:
    """Set every key of `override` in every parameter group of every optimizer in `objects` (for `lr` under a
    scheduler: its base LR, keeping the schedule's current factor). Returns lines `optimizer lr: 0.002 -> 0.001`;
    MgpuError when there is no optimizer, or a key no group has."""
    optimizers = _optimizers(objects)
    if override and not optimizers:
        raise MgpuError(f"override={dict(override)!r}: the state holds no torch.optim optimizer to apply it to")
    schedulers = _schedulers(objects)
    lines = []
    for name, opt in optimizers.items():
        for key in override:
            if not all(key in group for group in opt.param_groups):
                raise MgpuError(f"override {key!r}: {name} ({type(opt).__name__}) has no hyperparameter {key!r} "
                                f"(it has {', '.join(k for k in opt.param_groups[0] if k != 'params')})")
        for index, group in enumerate(opt.param_groups):
            for key, value in override.items():
                old = _base(group, key)
                if key == "lr" and "initial_lr" in group:
                    scale = value / group["initial_lr"] if group["initial_lr"] else None
                    factor = group["lr"] / group["initial_lr"] if group["initial_lr"] else 1.0
                    group["initial_lr"], group["lr"] = value, value * factor
                    for bound in _SCHEDULE_LRS:  # OneCycleLR's peak and floor: the whole cycle at the new scale
                        if bound in group and scale is not None:
                            group[bound] = group[bound] * scale
                    for scheduler in schedulers:
                        if scheduler.optimizer is opt:
                            scheduler.base_lrs[index] = value
                            if hasattr(scheduler, "_last_lr"):
                                scheduler._last_lr[index] = group["lr"]
                            if scale is not None and isinstance(getattr(scheduler, "max_lrs", None), list):
                                scheduler.max_lrs[index] *= scale  # CyclicLR's upper bound
                else:
                    group[key] = value
                if not _same(old, value):
                    where = f"{name}" if len(opt.param_groups) == 1 else f"{name} group {index}"
                    lines.append(f"{where} {key}: {old!r} -> {value!r}")
    return lines
