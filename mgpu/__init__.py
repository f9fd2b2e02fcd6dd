"""mgpu: PyTorch DistributedDataParallel training as Slurm batch jobs that survive preemption.

    import mgpu
    with mgpu.Session("runs/my-run") as session: ...      # a training loop of your own (mgpu.session)
    python jobs/submit.py --config X.yaml                 # or mgpu's trainer, from a Task (mgpu.task)

This package's top level imports nothing heavy: the submission path must not import torch, and
`Session` is imported on first use.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what the lazy names below are, for a type checker
    from mgpu.config import Config
    from mgpu.inference import load_model
    from mgpu.session import Session
    from mgpu.spawn import spawn
    from mgpu.train_state import State

__version__ = "0.1.0"
__all__ = ["Config", "Session", "State", "load_model", "spawn"]


_LAZY = {"spawn": "mgpu.spawn", "load_model": "mgpu.inference", "Session": "mgpu.session", "Config": "mgpu.config",
         "State": "mgpu.train_state"}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'mgpu' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(_LAZY[name]), name)
    # Importing mgpu.spawn binds the *module* to mgpu.spawn: bind the function over it, or the next
    # `mgpu.spawn(...)` would call a module.
    globals()[name] = value
    return value
