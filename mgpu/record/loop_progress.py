"""A loop of one's own in the run's ledger: `session.log(loss=loss)` writes the `progress` event the trainer
writes (step, epoch, metrics, a fingerprint of the weights), so that `jobs/status.py` shows the loop's epoch,
metrics and loss curve, and `jobs/status.py --verify` compares two of its runs step by step.

- Due every `log.every_steps` steps of the session's step count (0: at every call; the loop then chooses when),
  so the loop calls it once per optimizer step, after `should_stop()` (`session.step` is then the step just
  done). A call that is not due reads nothing: a tensor metric is read (`.item()`, a host sync) only when due.
- The metrics are rank 0's, as given (all-reduce them first for a mean over ranks): numbers or one-element
  tensors; anything else is refused in one line, at every call, due or not.
- The epoch is that of the state's `session.loader` (its `epoch`), when the state given to `load()` has one.
- Rank 0 prints the trainer's kind of line when due: step (of `session.total_steps` when the loop set it), epoch,
  metrics, steps a second since the last line and, with a total, the ETA.
- The fingerprint covers every module in that state, in its order (`mgpu.parallel.fsdp.weights_fingerprint`, the
  trainer's): an FSDP2 model's (and an EMA sharded like it) is a collective, which is why `log` is called on every
  rank, as `should_stop`.
"""

from __future__ import annotations

import logging
import numbers
import time
from typing import Any, Callable, Mapping

from mgpu.errors import MgpuError
from mgpu.record.ledger import Ledger

__all__ = ["Clock", "check_metrics", "epoch_of", "fingerprint", "log_progress", "progress_line", "read_metrics"]

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

    from mgpu.parallel.fsdp import has_shards, weights_fingerprint

    modules = [value for value in objects.values() if isinstance(value, nn.Module)]
    prints = [weights_fingerprint(module) for module in modules if is_main or has_shards(module)]
    return ",".join(prints) if is_main and prints else None


class Clock:
    """The pace between two progress lines: steps a second since the last due call (None at the first)."""

    def __init__(self) -> None:
        self.last: tuple[float, int] | None = None

    def rate(self, step: int) -> float | None:
        now = time.monotonic()
        last, self.last = self.last, (now, step)
        if last is None or step <= last[1] or now <= last[0]:
            return None
        return (step - last[1]) / (now - last[0])


def progress_line(step: int, total: int | None, epoch: int | None, metrics: Mapping[str, float],
                  rate: float | None) -> str:
    """The trainer's line for a loop of one's own: `step 20/64 epoch 1  loss 0.1234  1.5 steps/s  ETA 29s` (the
    total and the ETA when the loop told the session its total, `session.total_steps`)."""
    from mgpu.record.goodput import duration
    from mgpu.record.reporting import format_metrics

    line = f"step {step}" + (f"/{total}" if total else "") + (f" epoch {epoch}" if epoch is not None else "")
    line += f"  {format_metrics(metrics)}" if metrics else ""
    if rate:
        line += f"  {rate:.3g} steps/s"
        if total and total > step:
            line += f"  ETA {duration((total - step) / rate)}"
    return line


def log_progress(ledger: Ledger, step: int, every: int, state: State, is_main: bool,
                 metrics: Mapping[str, Any], clock: Clock | None = None, total: int | None = None,
                 ranks: Mapping[str, Any] | None = None) -> bool:
    """*Collective* when due and a module is sharded. Write the `progress` event at `step` if it is due (every
    `every` steps; 0: always), with `ranks` (every rank's step times: mgpu.record.stragglers) when known, and on
    rank 0 its line (`progress_line`, paced by `clock`); returns whether it was due."""
    check_metrics(metrics)
    if every and step % every:
        return False
    objects = (state() if callable(state) else state) if state is not None else {}
    weights = fingerprint(objects, is_main)
    if is_main:
        epoch = epoch_of(objects)
        values = read_metrics(metrics)
        ledger.write("progress", step=step, **({} if epoch is None else {"epoch": epoch}),
                     metrics=values, fingerprint=weights, **({"ranks": ranks} if ranks else {}))
        rate = clock.rate(step) if clock is not None else None
        logging.getLogger("mgpu.train").info("%s", progress_line(step, total, epoch, values, rate))
    return True
