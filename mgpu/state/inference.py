"""A run's weights for inference or fine-tuning, in one call: `mgpu.load_model("runs/mnist", model)`."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from mgpu.errors import MgpuError
from mgpu.record.rundir import RunDir

__all__ = ["load_model"]


def load_model(run_dir: str | Path, model: Any = None, which: Literal["best", "latest"] = "best") -> Any:
    """The model weights of a run's best checkpoint (by eval.metric; `which="latest"`: the newest), verified.
    Loaded into `model` (any nn.Module of the task's architecture, on any device) and returned; without
    `model`, the state dict. A run without a best checkpoint falls back on the latest."""
    from mgpu.state.checkpoint import CheckpointStore

    store = CheckpointStore(RunDir(Path(run_dir)).checkpoints)
    from mgpu.state.sharded_export import consolidated_model  # [fsdp hook] a sharded run's weights, consolidated

    sharded = consolidated_model(store.directory, which)
    if sharded is not None:
        return sharded if model is None else (model.load_state_dict(sharded), model)[1]
    loaded = (store.best() if which == "best" else None) or store.latest()
    if loaded is None:
        raise MgpuError(f"{run_dir}: no checkpoint to load (is it a run directory? it has no checkpoints/)")
    weights = loaded.state["model"]
    if model is None:
        return weights
    model.load_state_dict(weights)
    return model
