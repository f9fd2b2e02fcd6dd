"""What a `Session` holds, declared once, and the few of its methods its parts call: `mgpu.run.session_start`,
`session_wrap`, `session_state` and `session_end` are written against `SessionBase`, so they import this module
and not the `Session` they are parts of (no import cycle, types checked). No torch at import.
"""

from __future__ import annotations

import contextlib
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

if TYPE_CHECKING:
    import torch

    from mgpu.cluster.environment import ProcessEnv
    from mgpu.config.loading import Config
    from mgpu.parallel.ddp import SessionDDPs
    from mgpu.record.budgets import Limits
    from mgpu.record.ledger import Ledger
    from mgpu.record.rundir import RunDir
    from mgpu.record.stragglers import StragglerWatch
    from mgpu.run.outcome import StopBudgets
    from mgpu.state.single.store import LoadedCheckpoint
    from mgpu.state.resumption import Resumption
    from mgpu.parallel.sync_wait import SyncWait
    from mgpu.stop.preemption import StopRequest
    from mgpu.stop.rank_timing import RankTimer
    from mgpu.stop.stopping import StopController
    from mgpu.stop.watchdog import Watchdog

__all__ = ["SessionBase"]


class SessionBase:
    """The state of one rank's run (see `mgpu.run.session.Session`, the only subclass)."""

    # Set by Session.__init__ before anything can fail.
    cfg: Config
    config_path: str | None
    timings: dict[str, float]
    stop: StopRequest
    _cleanup: contextlib.ExitStack
    _created: Path | None
    _began: bool
    _finished: bool
    _ended: bool
    _ended_code: int
    watchdog: Watchdog | None
    beat: Callable[..., None]
    stopper: StopController | None
    _checkpointer: Any
    _ddps: SessionDDPs | None
    _fsdp: bool
    _wrapped: weakref.WeakSet[Any]
    _state: Mapping[str, Any] | Callable[[], Mapping[str, Any]] | None
    _memory: Any
    _marks: Any
    _durable_step: int
    _durable: tuple[int, Path | None]
    step: int
    resume_step: int
    _by_batch: bool | None
    # Set by mgpu.run.session_start.start, in this order.
    limits: Limits
    env: ProcessEnv
    rank: int
    world_size: int
    local_rank: int
    is_main: bool
    run: RunDir
    slurm_job: str | None
    """The Slurm job this process belongs to, the only one it may ask about or requeue (None: none)."""
    budgets: StopBudgets
    ledger: Ledger
    started: float
    resumption: Resumption
    device: torch.device
    backend: str
    expected_save_s: float | None
    save_allowance_s: float
    resume_allowance_s: float
    ladder: dict[str, Any]
    """The timeout ladder at the start (mgpu.stop.ladder's record: the rungs and the orders broken)."""
    timer: RankTimer | None
    """This rank's compute and wait per step (mgpu.stop.rank_timing; None: a world of one, or stragglers off)."""
    _sync_wait: SyncWait | None
    stragglers: StragglerWatch | None
    """Rank 0's watch of every rank's step times (mgpu.record.stragglers; None elsewhere, or not measured)."""

    # What the parts call of the Session (defined there).
    @property
    def sharded(self) -> bool:
        raise NotImplementedError

    @property
    def checkpointer(self) -> Any:
        raise NotImplementedError

    @property
    def reasons(self) -> set[str]:
        raise NotImplementedError

    @property
    def run_id(self) -> str:
        raise NotImplementedError

    @property
    def version(self) -> str | None:
        raise NotImplementedError

    def latest(self) -> LoadedCheckpoint | None:
        raise NotImplementedError

    def begin(self, **fields: Any) -> None:
        raise NotImplementedError

    def all_reduce(self, value: Any, op: str = "sum") -> torch.Tensor:
        raise NotImplementedError

    def save(self, state: Mapping[str, Any] | Callable[[], Mapping[str, Any]] | None = None, *, best: bool = False,
             wait: bool = False, reason: str | None = None, meta: dict[str, Any] | None = None) -> Path | None:
        raise NotImplementedError
