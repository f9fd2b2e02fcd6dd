"""A Session's way to its first step: who this rank is, the run directory and its budgets, the process group,
the wrapped DDPs' registry, the run's claim, the save allowance measured from earlier saves, the watchdog, the
stop controller and the seeded generators; then the ledger's `started` event when the run begins, and at the
first step the collective timeout that no longer needs a rendezvous allowance. Each part is registered with the session's cleanup as it is made, in the order its
teardown needs. `mgpu.run.session.Session` calls these; nothing else should. No torch at import.
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from typing import Any

from mgpu.cluster.environment import ProcessEnv, detect_environment
from mgpu.cluster.requeue import complete_resume_command
from mgpu.record.ledger import Ledger
from mgpu.run.outcome import StopBudgets
from mgpu.record.budgets import Limits
from mgpu.state.resumption import Resumption
from mgpu.record.rundir import RunDir
from mgpu.run.runner import join_run, prepare_run_dir, setup_logging, start_watchdog
from mgpu.run.session_end import arm_teardown
from mgpu.cluster.slurm_job import owns_slurm_job
from mgpu.run.session_base import SessionBase


__all__ = ["after_first_step", "longest_write_s", "record_start", "start", "straggler_changed", "timeout_ladder"]

log = logging.getLogger("mgpu.train")


def start(session: SessionBase, env: ProcessEnv | None) -> None:
    """Everything between the stop signals caught and the loop's first call: sets the session's `limits`, `env`,
    `rank`, `world_size`, `local_rank`, `is_main`, `run`, `slurm_job`, `budgets`, `ledger`, `started`,
    `resumption`, `device`, `backend`, `expected_save_s`, `save_allowance_s`, `resume_allowance_s`, `watchdog`,
    `beat`, `timer`, `stragglers` (rank 0's), `stopper`, `ladder` (its broken orders said by rank 0)."""
    cfg = session.cfg
    session.limits = Limits.from_environ()  # before torch is imported: a bad value fails in milliseconds
    session.env = env or detect_environment()
    session.rank, session.world_size = session.env.rank, session.env.world_size
    session.local_rank = session.env.local_rank
    session.is_main = session.rank == 0
    session.run = RunDir.of(cfg.run)
    session._created = prepare_run_dir(session.run)  # what this attempt creates, removed if it never trains
    setup_logging(session.run, session.rank)
    session.slurm_job = session.env.job_id if owns_slurm_job() else None
    session.budgets = StopBudgets.read(session.run, session.env, session.slurm_job, session.limits)
    session.budgets.refuse_if_spent(session.run, session.env)
    session.ledger = Ledger(session.run.ledger if session.is_main else None, session.env.job_id,
                            session.env.restart_count)
    session.started = time.time()
    session.resumption = Resumption(session.run, session.rank, session.world_size, cfg.train.seed, session.ledger,
                                    lambda: session.checkpointer)

    from mgpu.parallel.ddp import SessionDDPs
    from mgpu.parallel.distributed import process_group
    from mgpu.state.rng import seed_rank
    from mgpu.stop.stopping import StopController

    cleanup = session._cleanup
    # The watchdog outlives the group's teardown, which it bounds (see mgpu.run.session_end.arm_teardown): stopped after it.
    cleanup.callback(lambda: session.watchdog.stop() if session.watchdog is not None else None)
    ctx = cleanup.enter_context(process_group(
        session.env, timeout=timedelta(seconds=cfg.distributed.init_timeout_s),
        backend=None if cfg.distributed.backend == "auto" else cfg.distributed.backend, trace_dir=session.run.logs))
    session._ddps = SessionDDPs()
    cleanup.callback(session._ddps.release)  # before the group's teardown (reverse order)
    session.timings["group"] = time.time()
    session.device = ctx.device
    session.backend = ctx.backend
    # The saves and resumes so far, earlier runs' included (the side record: the same on every rank): how long
    # the next save should take sizes the watchdog's allowance, the collective timeout and the deadline stop;
    # the checkpoint's size and the read rate, the resume's allowance.
    from mgpu.state.save_budget import allowances

    budget = allowances(session.run.ledger, session.world_size, cfg.watchdog.checkpoint_s, cfg.watchdog.first_step_s,
                        session.run.checkpoints)
    session.expected_save_s, session.save_allowance_s = budget.expected_save_s, budget.save_allowance_s
    session.resume_allowance_s = budget.resume_allowance_s
    if session.is_main and session.save_allowance_s > cfg.watchdog.checkpoint_s:
        log.info("a checkpoint save is expected to take %.0f s here (the saves measured so far): the watchdog "
                 "allows %.0f s for one, more than watchdog.checkpoint_s", session.expected_save_s or 0.0,
                 session.save_allowance_s)
    if cfg.watchdog.enabled:
        session.watchdog = start_watchdog(cfg, session.env, session.run, session.backend,
                                          checkpoint_s=session.save_allowance_s, resume_s=budget.resume_allowance_s)
        cleanup.callback(lambda: arm_teardown(session))
        session.beat = session.watchdog.beat
    if cfg.stragglers.enabled and session.world_size > 1:
        from mgpu.parallel.sync_wait import SyncWait
        from mgpu.stop.rank_timing import RankTimer

        session._sync_wait = SyncWait(session.device)  # session.wrap's DDPs report their waits to it
        session.timer = RankTimer(session._sync_wait.take)
        if session.is_main:
            from mgpu.record.stragglers import StragglerWatch
            from mgpu.run.runner import rank_node

            stragglers = cfg.stragglers
            session.stragglers = StragglerWatch(session.world_size, stragglers.margin, stragglers.hold_steps,
                                                stragglers.hold_s, node_of=lambda rank: rank_node(session.run, rank))
    # Only with the watchdog running: the claim's broadcast is the first collective after the rendezvous, and a rank
    # whose peer froze there (SIGSTOP, a lost node) waited distributed.init_timeout_s, not watchdog.first_step_s.
    join_run(session.run, session.env, str(session.device), session.backend)
    session.stopper = StopController.for_rank(
        session.stop, cfg.preemption, cleanup, slurm_job=session.slurm_job if session.is_main else None,
        longest_write_s=lambda: longest_write_s(session), nodes=session.env.nodes, timer=session.timer,
        stragglers=session.stragglers, on_straggler=lambda change: straggler_changed(session, change))
    seed_rank(cfg.train.seed, session.rank, cfg.train.deterministic)
    session.ladder = timeout_ladder(session)
    if session.is_main:  # every order broken, in one line, before the first step that may need it kept
        for problem in session.ladder["problems"]:
            log.warning("timeouts: %s", problem)


def timeout_ladder(session: SessionBase, step_s: float | None = None,
                   collective_timeout_s: float | None = None) -> dict[str, Any]:
    """Every bound this run lives under, in order, and what breaks the order (mgpu.stop.ladder), as the ledger holds
    it: at the start, and at the first step with its time and the collective timeout then set."""
    from mgpu.cluster.kill_time import KillTimes
    from mgpu.stop.ladder import Figures, ladder

    cfg = session.cfg
    return ladder(Figures(
        init_timeout_s=cfg.distributed.init_timeout_s, watchdog=session.watchdog is not None,
        step_multiple=cfg.watchdog.step_multiple, floor_s=cfg.watchdog.floor_s, first_step_s=cfg.watchdog.first_step_s,
        eval_s=cfg.watchdog.eval_s, save_allowance_s=session.save_allowance_s,
        resume_allowance_s=session.resume_allowance_s, expected_save_s=session.expected_save_s, step_s=step_s,
        collective_timeout_s=collective_timeout_s, agree_every=cfg.preemption.check_every_steps,
        kill=KillTimes.from_environ() if session.slurm_job else None,
        deadline_margin_s=cfg.preemption.deadline_margin_s if session.slurm_job else 0.0)).record()


def straggler_changed(session: SessionBase, change: Any) -> None:
    """Rank 0: a rank named a straggler, or cleared (mgpu.record.stragglers.Change): one line, one ledger event."""
    from mgpu.record.stragglers import change_line

    if change.named:
        log.warning("%s", change_line(change))
        exclude = {"exclude": True} if session.cfg.stragglers.exclude_node else {}  # at the next requeue
        session.ledger.write("straggler", **change.fields(), **exclude)
    else:
        log.info("%s", change_line(change))
        session.ledger.write("straggler_cleared", **change.fields())


def record_start(session: SessionBase, fields: dict[str, Any]) -> None:
    """The ledger's `started` event (who, where, the limits, the config and code; `fields`), then `resumed`."""
    env, limits = session.env, session.limits
    session.ledger.write("started", world_size=session.world_size, nodes=list(env.nodes), launcher=env.launcher,
                         device=str(session.device), backend=session.backend, run_dir=str(session.run.path),
                         limits={"max_requeues": limits.max_requeues, "max_failures": limits.max_failures},
                         ladder=session.ladder,
                         **{"config_path": session.config_path, "git_sha": session.version, **fields})
    session.resumption.record()


def longest_write_s(session: SessionBase) -> float:
    """What the deadline stop leaves for the save: this process's longest write, or the time the saves of
    earlier runs say the next one takes, whichever is longer."""
    own = session._checkpointer.longest_write_s if session._checkpointer is not None else 0.0
    return max(own, session.expected_save_s or 0.0)


def after_first_step(session: SessionBase) -> None:
    """Every rank reached a first step: collectives need no rendezvous allowance any more (a hung peer
    then fails a collective in minutes, not in distributed.init_timeout_s); rank 0 completes a template's resume
    command; the ledger's `first_step`."""
    from mgpu.parallel.distributed import set_collective_timeout

    seconds = None
    if session.watchdog is not None and session.world_size > 1:
        assert session.stopper is not None
        seconds = round(session.watchdog.collective_timeout(session.cfg.watchdog.collective_timeout_s), 1)
        set_collective_timeout(timedelta(seconds=seconds), session.stopper.agreement.group)  # type: ignore[attr-defined]  # the agreement the controller built for this rank
    session.timings["first_step"] = time.time()
    if session.is_main and session.slurm_job:
        complete_resume_command()  # a template's sbatch options from accounting now, not within a stop's KillWait
    began = session.timings.get("first_batch", session.timings.get("restored", session.timings["group"]))
    ladder = timeout_ladder(session, step_s=max(0.0, session.timings["first_step"] - began),
                            collective_timeout_s=seconds)
    if session.is_main:  # the ladder once, as training starts (not before: a run refused earlier prints one line)
        from mgpu.record.timeouts import ladder_lines

        log.info("%s", "\n".join(ladder_lines(ladder, problems=False)))
        for problem in ladder["problems"]:
            if problem not in session.ladder["problems"]:  # said at the start already
                log.warning("timeouts: %s", problem)
    session.ledger.write("first_step", step=session.step, collective_timeout_s=seconds,
                         checkpoint_allowance_s=round(session.save_allowance_s, 1),
                         timings={k: round(v, 3) for k, v in session.timings.items()}, ladder=ladder)
