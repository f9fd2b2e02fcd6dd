"""mgpu: PyTorch DistributedDataParallel training as Slurm batch jobs that survive preemption.

    import mgpu
    with mgpu.Session("runs/my-run") as session: ...      # a training loop of your own (mgpu.session)
    python jobs/submit.py --config X.yaml                 # or mgpu's trainer, from a Task (mgpu.task)

This package's top level imports nothing heavy: the submission path must not import torch, and
`Session` is imported on first use.
"""

from typing import Any

__version__ = "0.1.0"
__all__ = ["Config", "Session", "State", "load_model", "spawn"]


def __getattr__(name: str) -> Any:
    if name == "spawn":
        from mgpu.spawn import spawn

        return spawn
    if name == "load_model":
        from mgpu.inference import load_model

        return load_model
    if name == "Session":
        from mgpu.session import Session

        return Session
    if name == "State":
        from mgpu.train_state import State

        return State
    if name == "Config":
        from mgpu.config import Config

        return Config
    raise AttributeError(f"module 'mgpu' has no attribute {name!r}")
