"""The user's side of a job: model, data, loss and metrics. No distributed code in it.

A config names a `Task` subclass by import path (`task.target: jobs.tasks.mnist:MnistTask`) and
passes `task.args` to its constructor. The trainer handles ranks, sharding, DDP, precision,
checkpoints and logging. Losses are **per sample** (shape `[batch]`) or a `LossSum` (summed over
tokens, with the token count), and metrics per sample, `Ratio`s or `Statistics` (mgpu.train.metrics), so the
trainer can weight and reduce them exactly, however the samples fall on ranks and micro-batches.
A task may bring its own optimizer and learning-rate schedule, and log its own scalars and texts.

    class MnistTask(Task):
        def build_model(self):   return SmallCNN()
        def train_dataset(self): return SyntheticDigits(60_000, seed=0)
        def eval_dataset(self):  return SyntheticDigits(10_000, seed=1)
        def loss(self, model, batch):
            images, labels = batch
            return F.cross_entropy(model(images), labels, reduction="none")
        def metrics(self, model, batch):
            images, labels = batch
            logits = model(images)
            return {"loss": F.cross_entropy(logits, labels, reduction="none"),
                    "accuracy": (logits.argmax(1) == labels).float()}
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from typing import Any, Callable, Mapping

import torch
from torch import nn
from torch.utils.data import Dataset, IterableDataset

from mgpu.errors import MgpuError
from mgpu.train.metrics import LossSum, Ratio, Statistics

__all__ = ["Task", "TaskError", "build_task", "import_task_class", "sized_dataset"]


class TaskError(MgpuError):
    """The configured task cannot be imported or built."""


class Task(ABC):
    """Subclass this; `__init__` receives `task.args` from the config as keyword arguments."""

    log: Any = None
    """Set by the trainer (mgpu.record.reporting.TaskLog): `self.log.scalar(name, value)` and `self.log.text(name,
    text)` go to the run's TensorBoard (and wandb) on rank 0; None outside a trainer, e.g. in a unit test."""

    def __init__(self, **args: Any) -> None:
        if args:
            raise TaskError(f"{type(self).__name__} takes no task.args, got {sorted(args)}")

    @abstractmethod
    def build_model(self) -> nn.Module:
        """A fresh model on the CPU. Every rank builds it; the trainer seeds and moves it."""

    @abstractmethod
    def train_dataset(self) -> Dataset:
        """A map-style dataset (`len` and integer indexing) or an mgpu.data.stream.ShardedStream, the same on every
        rank (mgpu shards it; exact on any world size and worker count); or an IterableDataset with
        `state_dict()`/`load_state_dict()` (torchdata's Stateful, a Hugging Face streaming dataset) that shards
        itself over ranks and workers: checkpointed per rank and worker, resumed on the same world size and
        `data.num_workers`; it has no length, so `train.max_steps` is needed."""

    def eval_dataset(self) -> Dataset | None:
        """The held-out dataset for `metrics`, or None for no evaluation."""
        return None

    @abstractmethod
    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor | LossSum | Mapping[str, Any]:
        """Per-sample training losses, shape `[batch]` (the gradient is the mean over the step's samples); or
        a `LossSum(total, weight)`, e.g. summed over the batch's tokens and their count (the mean over the
        step's tokens, on every rank and micro-batch together); or a dict with either under "loss" and
        training metrics beside it (per-sample tensors, `Ratio`, `Statistics`: logged as `train/<name>`)."""

    def metrics(self, model: nn.Module, batch: Any) -> Mapping[str, torch.Tensor | Ratio | Statistics]:
        """Evaluation values: per-sample tensors (shape `[batch]`, averaged over the whole eval set), `Ratio`s
        (sums of numerator and denominator over the set, e.g. token accuracy) or `Statistics` (counts summed
        over the set, then computed, e.g. corpus BLEU). Default: the training loss."""
        out = self.loss(model, batch)
        return {"loss": out["loss"] if isinstance(out, Mapping) else out}  # type: ignore[dict-item]  # a LossSum loss is reported as is

    def optimizer(self, model: nn.Module) -> torch.optim.Optimizer | None:
        """Your optimizer over `model`'s parameters (any torch.optim class, parameter groups: e.g. no weight
        decay on norms and biases); checkpointed and resumed like the built-in one. None: the config's
        (`optim.*`)."""
        return None

    def scheduler(self, optimizer: torch.optim.Optimizer, total_steps: int) -> Any:
        """Your learning-rate schedule, stepped once per optimizer step: an LR scheduler over `optimizer`, or
        a function of the step (0, 1, ...) giving the factor of each group's initial lr (a LambdaLR is made of
        it). None: the config's (`schedule.*`). `total_steps`: the run's optimizer steps."""
        return None

    def shard(self, model: nn.Module, mesh: Any) -> nn.Module | None:
        """Under train.parallel=fsdp: shard `model` your own way with torch.distributed.fsdp.fully_shard over
        `mesh` (which submodules, mp_policy, reshard_after_forward), the root last, and return it. None:
        mgpu's default (each top-level child with parameters, then the root)."""
        return None

    def collate_fn(self) -> Callable[[list[Any]], Any] | None:
        """How samples form a batch (None: torch's default collate)."""
        return None

    def tokens_per_sample(self) -> int | None:
        """For language models: tokens in one sample, so throughput is also reported in tokens/s."""
        return None


def import_task_class(target: str) -> type[Task]:
    """`"package.module:ClassName"` -> the class, with one-line errors."""
    module_name, _, class_name = target.partition(":")
    if not module_name or not class_name:
        raise TaskError(f"task.target={target!r}: expected 'module.path:ClassName'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise TaskError(f"task.target={target!r}: cannot import {module_name!r} ({error}); run from the "
                        "repository root or install the package that defines it") from None
    cls = getattr(module, class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, Task)):
        raise TaskError(f"task.target={target!r}: {module_name} has no Task subclass named {class_name!r}")
    return cls


def build_task(target: str, args: Mapping[str, Any]) -> Task:
    """Import and construct the task; a bad `task.args` key fails in one line."""
    cls = import_task_class(target)
    try:
        return cls(**dict(args))
    except TypeError as error:
        raise TaskError(f"task.args for {target}: {error}") from None


def sized_dataset(dataset: Any, what: str, optional: bool = False) -> Dataset | None:
    """`dataset` if mgpu can resume it (map-style with len() > 0; for training also a ShardedStream or a Stateful
    IterableDataset); TaskError in one line otherwise.

    `what` names the method that returned it; `optional`: None is allowed (no evaluation)."""
    if dataset is None and optional:
        return None
    name = type(dataset).__name__
    from mgpu.data.stream import ShardedStream

    if isinstance(dataset, ShardedStream) and not optional:
        return dataset  # resumed by sample id (mgpu.data.stream)
    if isinstance(dataset, IterableDataset):
        from mgpu.data.stream_loader import is_stateful

        if optional:
            raise TaskError(f"{what} returned an IterableDataset ({name}): an evaluation set is map-style (__len__ "
                            "and __getitem__), so that every sample counts once on one rank")
        if is_stateful(dataset):
            return dataset  # checkpointed per rank and worker (mgpu.data.stream_loader.StatefulStreamLoader)
        raise TaskError(f"{what} returned an IterableDataset ({name}) without state_dict()/load_state_dict(), which "
                        "the trainer cannot resume where it stopped: give it that protocol (torchdata's Stateful, as a "
                        "Hugging Face streaming dataset has), read its files through mgpu.data.stream.ShardedStream (as "
                        "jobs/tasks/gpt.py does with stream: true), or give it __len__ and __getitem__")
    try:
        size = len(dataset)
    except TypeError:
        raise TaskError(f"{what} returned a {name}, which has no len(): return a map-style dataset "
                        "(__len__ and __getitem__)") from None
    if size == 0:
        fix = "return None to train without evaluation" if optional else "check the data the task reads"
        raise TaskError(f"{what} is empty ({name} of length 0): {fix}")
    return dataset
