"""mgpu: PyTorch DistributedDataParallel training as Slurm batch jobs that survive preemption.

    import mgpu
    with mgpu.Session("runs/my-run") as session: ...      # a training loop of your own (mgpu.run.session)
    python jobs/submit.py --config X.yaml                 # or mgpu's trainer, from a Task (mgpu.train.task)

This package's top level imports nothing heavy: the submission path must not import torch, and
`Session` is imported on first use.
"""

from typing import TYPE_CHECKING, Any

from mgpu import moved

moved.install()  # the module names from before the subpackages still import (mgpu/moved.py)

if TYPE_CHECKING:  # what the lazy names below are, for a type checker
    from mgpu.config.loading import Config
    from mgpu.parallel.ema import EMA
    from mgpu.state.inference import load_model
    from mgpu.run.session import Session
    from mgpu.run.spawn import spawn
    from mgpu.state.train_state import State
    from mgpu.train.task import Task

__version__ = "0.1.0"
__all__ = ["Config", "EMA", "Session", "State", "Task", "load_model", "spawn"]


_LAZY = {"spawn": "mgpu.run.spawn", "load_model": "mgpu.state.inference", "Session": "mgpu.run.session",
         "Config": "mgpu.config.loading", "EMA": "mgpu.parallel.ema", "State": "mgpu.state.train_state", "Task": "mgpu.train.task"}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'mgpu' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(_LAZY[name]), name)
    # `import mgpu.spawn` (the old module name, mgpu/moved.py) binds the *module* to mgpu.spawn: bind the
    # function over it, or the next `mgpu.spawn(...)` would call a module.
    globals()[name] = value
    return value
