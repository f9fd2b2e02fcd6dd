"""A loop of one's own in the run's ledger: `session.log(loss=loss)` writes the `progress` event the trainer
writes (step, epoch, metrics, a fingerprint of the weights), so that `jobs/status.py` shows the loop's epoch,
metrics and loss curve, and `jobs/status.py --verify` compares two of its runs step by step.

- Due every `log.every_steps` steps of the session's step count (0: at every call; the loop then chooses when),
  so the loop calls it once per optimizer step, after `should_stop()` (`session.step` is then the step just
  done). A call that is not due reads nothing: a tensor metric is read (`.item()`, a host sync) only when due.
- The metrics are rank 0's, as given (all-reduce them first for a mean over ranks): numbers or one-element
  tensors; anything else is refused in one line, at every call, due or not.
- The epoch is that of the state's `session.loader` (its `epoch`), when the state given to `load()` has one.
- The fingerprint covers every module in that state, in its order (`mgpu.parallel.fsdp.weights_fingerprint`, the
  trainer's): an FSDP2 model's is a collective, which is why `log` is called on every rank, as `should_stop`.
"""

from __future__ import annotations

import numbers
from typing import Any, Callable, Mapping

from mgpu.errors import MgpuError
from mgpu.record.ledger import Ledger

__all__ = ["check_metrics", "epoch_of", "fingerprint", "log_progress", "read_metrics"]

State = Mapping[str, Any] | Callable[[], Mapping[str, Any]] | None


def _is_tensor(value: Any) -> bool:
    import torch

    return isinstance(value, torch.Tensor)


def check_metrics(metrics: Mapping[str, Any]) -> None:
    """MgpuError (one line) for a metric that is not one real number; reads no tensor's value."""
    import torch

    for name, value in metrics.items():
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise MgpuError(f"Session.log({name}=...): a tensor of {value.numel()} values; give one number "
                                f"(e.g. {name}.mean())")
            if value.dtype.is_complex or value.dtype == torch.bool:
                raise MgpuError(f"Session.log({name}=...): a {value.dtype} tensor; give a real number")
        elif isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise MgpuError(f"Session.log({name}=...): a number or a one-element tensor, got a "
                            f"{type(value).__name__}")


def read_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The metrics as floats (a tensor's `.item()`: a host sync)."""
    return {name: float(value.item() if _is_tensor(value) else value) for name, value in metrics.items()}


def epoch_of(objects: Mapping[str, Any]) -> int | None:
    """The epoch of the state's `session.loader` (anything with an int `epoch` and `position`), else None."""
    for value in objects.values():
        epoch, position = getattr(value, "epoch", None), getattr(value, "position", None)
        if isinstance(epoch, int) and isinstance(position, int):
            return epoch
    return None


def fingerprint(objects: Mapping[str, Any], is_main: bool) -> str | None:
    """*Collective* for a sharded module. The weights' fingerprint of every module in `objects`, comma-joined
    in their order (one module: the trainer's form); None on ranks other than 0, or with no module."""
    from torch import nn

    from mgpu.parallel.fsdp import is_sharded, weights_fingerprint

    modules = [value for value in objects.values() if isinstance(value, nn.Module)]
    prints = [weights_fingerprint(module) for module in modules if is_main or is_sharded(module)]
    return ",".join(prints) if is_main and prints else None


def log_progress(ledger: Ledger, step: int, every: int, state: State, is_main: bool,
                 metrics: Mapping[str, Any], ranks: Mapping[str, Any] | None = None) -> bool:
    """*Collective* when due and a module is sharded. Write the `progress` event at `step` if it is due (every
    `every` steps; 0: always), with `ranks` (every rank's step times: mgpu.record.stragglers) when known; returns
    whether it was due."""
    check_metrics(metrics)
    if every and step % every:
        return False
    objects = (state() if callable(state) else state) if state is not None else {}
    weights = fingerprint(objects, is_main)
    if is_main:
        epoch = epoch_of(objects)
        ledger.write("progress", step=step, **({} if epoch is None else {"epoch": epoch}),
                     metrics=read_metrics(metrics), fingerprint=weights, **({"ranks": ranks} if ranks else {}))
    return True
