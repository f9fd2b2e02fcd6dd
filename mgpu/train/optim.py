"""Optimizer and learning-rate schedule: the task's own where it brings one, else the config's."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from mgpu.config.loading import OptimConfig, ScheduleConfig
from mgpu.errors import MgpuError

__all__ = ["build_optimizer", "build_scheduler", "lr_factor", "optimizer_for", "scheduler_for"]


def build_optimizer(model: nn.Module, cfg: OptimConfig, distributed: bool) -> torch.optim.Optimizer:
    """Adam, AdamW or SGD over the trainable parameters; sharded with ZeRO when asked and distributed."""
    params = [p for p in model.parameters() if p.requires_grad]
    kinds: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
        "adam": (torch.optim.Adam, {"betas": tuple(cfg.betas)}),
        "adamw": (torch.optim.AdamW, {"betas": tuple(cfg.betas)}),
        "sgd": (torch.optim.SGD, {"momentum": cfg.momentum}),
    }
    cls, extra = kinds[cfg.name]
    kwargs = {"lr": cfg.lr, "weight_decay": cfg.weight_decay, **extra}
    if cfg.zero and distributed:
        # Imported here: torch.distributed.optim brings FSDP, DTensor and sympy, about a second of every start.
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(params, optimizer_class=cls, **kwargs)
    return cls(params, **kwargs)


def lr_factor(step: int, total_steps: int, cfg: ScheduleConfig) -> float:
    """Multiplier of the base LR before optimizer step `step` (0-based): linear warmup, then the schedule."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.name == "constant":
        return 1.0
    span = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    if cfg.name == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:  # linear
        shape = 1.0 - progress
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: ScheduleConfig, total_steps: int
                    ) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR stepped once per optimizer step; its state (the step count) is checkpointed."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, total_steps, cfg))


def optimizer_for(own: Any, task_name: str, model: nn.Module, cfg: OptimConfig,
                  distributed: bool) -> torch.optim.Optimizer:
    """`own`, the task's optimizer (parameter groups, any torch.optim class: `Task.optimizer`), else the config's."""
    if own is None:
        return build_optimizer(model, cfg, distributed=distributed)
    if not isinstance(own, torch.optim.Optimizer):
        raise MgpuError(f"{task_name}.optimizer() returned {type(own).__name__}, not a torch.optim.Optimizer")
    if cfg.zero:
        raise MgpuError(f"optim.zero=true but {task_name}.optimizer() brings its own optimizer: shard it with "
                        f"torch's ZeroRedundancyOptimizer in the task, or set optim.zero=false")
    return own


def scheduler_for(own: Any, task_name: str, optimizer: torch.optim.Optimizer, cfg: ScheduleConfig,
                  total_steps: int) -> Any:
    """`own`, the task's LR schedule (a scheduler, or a function of the step giving the lr factor:
    `Task.scheduler`), else the config's."""
    if own is None:
        return build_scheduler(optimizer, cfg, total_steps)
    if callable(own) and not hasattr(own, "state_dict"):
        return torch.optim.lr_scheduler.LambdaLR(optimizer, own)
    if not (hasattr(own, "step") and hasattr(own, "state_dict")):
        raise MgpuError(f"{task_name}.scheduler() returned {type(own).__name__}: return an LR "
                        f"scheduler, a function of the step (the lr factor), or None")
    return own
