"""Module names from before mgpu/ was grouped into subpackages (issue 35), still importable and runnable.

`import mgpu.checkpoint`, `from mgpu.stream import ShardedStream` and `python -m mgpu.recovery` (a batch script
written for an older mgpu) keep working, and so do the names mgpu/state/'s modules had before it was grouped by
concept (issue 46: `import mgpu.state.checkpoint`, `python -m mgpu.state.memory_snapshot --remove-this-job`): each
old name is the new module itself (one module object, not a copy), and `python -m OLD` runs the new module. New code
uses the new names; `MOVED` is the map. No torch.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import CodeType, ModuleType
from typing import Sequence

MOVED = {
    "config_schema": "config.schema", "config": "config.loading", "config_doc": "config.reference",
    "hostlist": "cluster.hostlist", "environment": "cluster.environment", "slurm": "cluster.slurm",
    "slurm_job": "cluster.slurm_job", "requeue": "cluster.requeue", "exclusion": "record.exclusion",
    "deadline": "cluster.deadline",
    "distributed": "parallel.distributed", "ddp": "parallel.ddp", "fsdp": "parallel.fsdp",
    "precision": "parallel.precision",
    "rundir": "record.rundir", "ledger": "record.ledger", "goodput": "record.goodput", "runview": "record.runview",
    "timeline": "record.timeline", "reporting": "record.reporting", "loop_progress": "record.loop_progress",
    "checkpoint": "state.single.store", "checkpointer": "state.checkpointer", "sharded": "state.sharded.checkpointer",
    "sharded_export": "state.sharded.export", "train_state": "state.train_state", "rng": "state.rng",
    "save_budget": "state.save_budget", "shard_arrivals": "state.sharded.arrivals", "inference": "state.inference",
    "hparams": "state.hparams", "resumption": "state.resumption",
    "preemption": "stop.preemption", "stopping": "stop.stopping", "watchdog": "stop.watchdog",
    "process_exit": "stop.process_exit",
    "data": "data.sampling", "loader": "data.loader", "stream": "data.stream", "stream_loader": "data.stream_loader",
    "session": "run.session", "runner": "run.runner", "spawn": "run.spawn", "outcome": "run.outcome",
    "recovery": "run.recovery",
    "trainer": "train.trainer", "task": "train.task", "evaluation": "train.evaluation", "optim": "train.optim",
    "metrics": "train.metrics", "job": "train.job",
    "submission": "submit.submission", "doctor": "submit.doctor", "doctor_run": "submit.doctor_run",
    "doctor_probe": "submit.doctor_probe",
    # added in this round
    "budgets": "record.budgets", "failures": "record.failures", "save_record": "record.save_record",
    "check_hooks": "record.check_hooks", "uncaught": "run.uncaught",
    "session_start": "run.session_start", "session_state": "run.session_state", "session_end": "run.session_end",
    "session_wrap": "run.session_wrap", "digest": "state.files.digest", "shard_digest": "state.sharded.filesystem",
    "memory_snapshot": "state.memory.store", "memory_state": "state.memory.snapshots",
    "check_resume": "check.resume", "check_runs": "check.runs", "check_plan": "check.plan",
    "state_diff": "check.state_diff", "batch_diff": "check.batch_diff",
    # mgpu/state/ by concept (issue 46): its modules' names from before, under `mgpu.state.`
    "state.checkpoint": "state.single.store", "state.host_copy": "state.single.host_copy",
    "state.digest": "state.files.digest", "state.direct_io": "state.files.direct_io",
    "state.writeback": "state.files.writeback", "state.zip_options": "state.files.zip_options",
    "state.sharded": "state.sharded.checkpointer", "state.sharded_format": "state.sharded.format",
    "state.shard_arrivals": "state.sharded.arrivals", "state.shard_digest": "state.sharded.filesystem",
    "state.shard_verify": "state.sharded.verify", "state.dcp_safe": "state.sharded.dcp_safe",
    "state.sharded_export": "state.sharded.export",
    "state.memory_snapshot": "state.memory.store", "state.memory_state": "state.memory.snapshots",
    "state.memory_replica": "state.memory.replica", "state.memory_content": "state.memory.content",
    "state.memory_room": "state.memory.room", "state.memory_cadence": "state.memory.cadence",
    "state.step_mark": "state.memory.step_mark", "state.buffer_record": "state.memory.buffer_record",
}
# Old names that are now packages of their own: `mgpu.config`, `mgpu.data` and `mgpu.state.sharded` import as the
# packages, whose `__init__` hands on the old module's names.
_PACKAGES_NOW = {"config", "data", "state.sharded"}


class _Alias(importlib.abc.Loader):
    """Loads an old name as the new module; for `python -m OLD`, hands runpy the new module's code."""

    def __init__(self, new: str) -> None:
        self.new = new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(self.new)

    def exec_module(self, module: ModuleType) -> None:
        pass  # the new module ran when it was imported

    def get_code(self, fullname: str) -> CodeType | None:
        spec = importlib.util.find_spec(self.new)
        loader = spec.loader if spec else None
        return loader.get_code(self.new) if isinstance(loader, importlib.abc.InspectLoader) else None


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        head, _, old = fullname.partition(".")
        if head != "mgpu" or old not in MOVED or old in _PACKAGES_NOW:
            return None
        return importlib.machinery.ModuleSpec(fullname, _Alias(f"mgpu.{MOVED[old]}"))


def install() -> None:
    if not any(isinstance(finder, _Finder) for finder in sys.meta_path):
        # First: an editable install's own finder would otherwise look for the old file where it no longer is.
        sys.meta_path.insert(0, _Finder())
