"""A run's weights for inference or fine-tuning, in one call: `mgpu.load_model("runs/mnist", model)`, or its EMA's
(`ema=True`: the average `mgpu.EMA` or `train.ema_decay` kept, as weights of the same architecture)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from mgpu.errors import MgpuError
from mgpu.record.rundir import RunDir

__all__ = ["load_model"]


def load_model(run_dir: str | Path, model: Any = None, which: Literal["best", "latest"] = "best", *,
               ema: bool | str = False) -> Any:
    """The model weights of a run's best checkpoint (by eval.metric; `which="latest"`: the newest), verified.
    Loaded into `model` (any nn.Module of the task's architecture, on any device) and returned; without
    `model`, the state dict. A run without a best checkpoint falls back on the latest. `ema=True`: the weights of
    the run's EMA (the state's `"ema"` entry: the trainer's with `train.ema_decay`, or a loop's `mgpu.EMA`; a
    string names another entry) instead of the model's."""
    from mgpu.state.single.store import CheckpointStore

    name = "ema" if ema is True else (ema or "model")
    store = CheckpointStore(RunDir(Path(run_dir)).checkpoints)
    from mgpu.state.sharded.export import consolidated_model  # [fsdp hook] a sharded run's weights, consolidated

    try:
        weights = consolidated_model(store.directory, which, name)
    except MgpuError as error:
        raise MgpuError(f"{run_dir}: {error}") from None
    if weights is None:
        loaded = (store.best() if which == "best" else None) or store.latest()
        if loaded is None:
            raise MgpuError(f"{run_dir}: no checkpoint to load (is it a run directory? it has no checkpoints/)")
        if name not in loaded.state:
            kept = ", ".join(repr(key) for key, value in loaded.state.items() if isinstance(value, dict))
            raise MgpuError(f"{run_dir}: its checkpoint {loaded.path.name} holds no {name!r} (it has {kept})")
        weights = loaded.state[name]
    if ema:
        from mgpu.parallel.ema import ema_weights

        weights = ema_weights(weights)
    if model is None:
        return weights
    model.load_state_dict(weights)
    return model
