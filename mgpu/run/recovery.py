"""After a failed training step: requeue the job within its failure budget. No torch.

When a rank dies (OOM, SIGKILL, a crash, a hung NCCL call), `srun --kill-on-bad-exit` ends the step
and the batch script goes on. Slurm never requeues a FAILED job by itself, so something must ask for
it, and it cannot be a training rank: with NCCL the survivors sit in CUDA waits where no Python runs
until srun's KILL. The batch script can: after srun returns it runs

    python -m mgpu.run.recovery --may-restart --exit-code $? --run-dir DIR            (jobs/submit.py's teardown)
    python -m mgpu.run.recovery --may-restart --exit-code $? --config CFG [k=v ...]   (slurm/train*.sbatch)
    python -m mgpu.run.recovery --may-restart --exit-code $? --run-dir-file FILE      (slurm/loop.sbatch)

and this module decides. A run that stopped cleanly has already decided (its `stop_decision` is in
the ledger) and is left alone; a deterministic failure (bad input, a full disk: `failed` with
`retry: false`, or exit code 2) is not requeued into the same wall. Otherwise, while the job is
still RUNNING and the failure budget (`MGPU_MAX_FAILURES` per job, default 3) allows: after a hang the
watchdog pinned on one node, that node is excluded and the job requeued; else the script starts the
step again in the same allocation (it prints `restart`: no requeue hold), or, without
`--may-restart`, the job is requeued. Scripts without this line fall back on the first surviving
rank requeueing (`mgpu.train.job`), deduplicated by the `.failure-<job>-<restart>` claim either way.

A stop Slurm did not answer (rank 0's `stop_decision` carries `unknown`, or its requeue got no answer:
`requeue_unknown`; the step's exit code is then mgpu.run.outcome.UNANSWERED_EXIT_CODE) is not a failure: it is
settled by `mgpu.run.unanswered` (asked again; after Slurm's signal, the job kept alive until Slurm answers or
ends it). A failed step whose `scontrol show job` gets no answer starts again in place, which needs nothing from
Slurm. This module exits with the code mgpu set for the step (mgpu.run.outcome.recorded_exit_code), which the
batch scripts end with: a launcher's own code (torchrun's and submitit's 1) does not reach Slurm.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Literal, Mapping, Sequence

from mgpu.record.budgets import FAILURE_KINDS, Limits, failure_requeues
from mgpu.errors import USAGE_EXIT_CODE, MgpuError
from mgpu.record.failures import record_failure
from mgpu.record.ledger import Ledger, read_ledger
from mgpu.record.exclusion import (apply_exclusion, exclude_straggler, partition_nodes, plan_exclusion, straggler_node,
                                   unavailable_nodes)
from mgpu.cluster.hostlist import expand_hostlist
from mgpu.cluster.requeue import Budget, JobView, decide, query_job, requeue, resume_command
from mgpu.record.rundir import RunDir
from mgpu.cluster.slurm import SlurmUnanswered
from mgpu.run.outcome import recorded_exit_code
from mgpu.run.unanswered import open_stop, settle_stop, this_attempt
from mgpu.cluster.slurm_job import owns_slurm_job

__all__ = ["handle_failure", "main", "peer_consequence", "rank_failed"]

log = logging.getLogger("mgpu.train.job")


_CONSEQUENCE = re.compile(r"Connection closed by peer|Connection reset by peer|Broken pipe|remote worker crash|"
                          r"NCCL communicator was aborted|Socket Timeout|timed out in call to|"
                          r"failed to recv, got 0 bytes|Watchdog caught collective operation timeout", re.I)
_CONSEQUENCE_TYPES = ("DistBackendError", "DistNetworkError", "DistStoreError")


def peer_consequence(error: BaseException) -> bool:
    """A rank's error that only says another rank went away (gloo's `Connection closed by peer`, a collective
    timeout): the consequence of a failure, not its cause. The ledger records the cause from the rank that had
    it; this one is kept, marked, for when no rank could say more."""
    return type(error).__name__ in _CONSEQUENCE_TYPES or _CONSEQUENCE.search(str(error)) is not None


def _handled(attempt: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    """This attempt's own stop decision, or its non-retryable failure, if it recorded one."""
    for event in reversed(attempt):
        if event.get("event") == "stop_decision" or (event.get("event") == "failed" and event.get("retry") is False):
            return event
    return None


Action = Literal["restart", "requeued", "none"]


def handle_failure(run: RunDir, job_id: str, restart: int, limits: Limits, message: str,
                   rank: int | None = None, may_restart: bool = False,
                   before_requeue: Callable[[], object] | None = None) -> tuple[Action, str]:
    """After run `restart` of job `job_id` failed with `message`: what to do, done. Never raises.

    A hang the watchdog pinned on one node: exclude that node and requeue (a new allocation without it).
    Otherwise, with `may_restart` (the batch script can start srun again), restart in this allocation:
    no requeue hold, which is minutes on production clusters. Else requeue. All within the failure budget;
    exactly one caller acts (the first to create the attempt's failure claim). `before_requeue`: called just
    before a requeue (the batch script's: the snapshots in memory removed on every node)."""
    try:
        run.path.mkdir(parents=True, exist_ok=True)
        events = read_ledger(run.ledger)
        attempt = this_attempt(events, job_id, restart)
        restarts_here = sum(1 for e in events if e.get("event") == "restarted" and e.get("job_id") == job_id
                            and e.get("restart") == restart)
        claim = run.failure_claim(job_id, restart).with_name(
            run.failure_claim(job_id, restart).name + (f"-{restarts_here}" if restarts_here else ""))
        try:
            fd = os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return "none", "another process handles this failure"
        with os.fdopen(fd, "w") as file:
            file.write(f"{message}\n")
        undecided = open_stop(attempt)
        if undecided is not None:
            settled = settle_stop(run, job_id, restart, limits, events, attempt, undecided)
            return ("requeued" if settled.kind == "requeued" else "none"), settled.message
        handled = _handled(attempt)
        if handled is not None:
            return "none", (f"nothing to do: the run recorded {handled['event']} "
                            f"({handled.get('reason') or handled.get('error')})")
        ledger = Ledger(run.ledger, job_id, restart)
        who = {} if rank is None else {"rank": rank}  # the failing rank wrote its own `failed` (Session.fail)
        hang = next((e for e in reversed(attempt) if e.get("event") == "hang"), None)
        kind = "hang" if hang else "failure"
        budget = Budget(failure_requeues(events, job_id), limits.max_failures, "failure")
        bad = hang["hosts"][0] if hang and hang.get("ranks") and len(hang.get("hosts") or []) == 1 else None
        try:
            view = query_job(job_id)
        except SlurmUnanswered as error:
            return _restart_unanswered(ledger, kind, budget, error.note, message, who, may_restart, bad)
        decision = decide(set(), view, restart, budget)
        plan = None
        if bad and decision.requeue:
            nodes = partition_nodes(view.partition)
            plan = plan_exclusion(bad, expand_hostlist(view.excluded) if view.excluded else [], nodes, view.num_nodes,
                                  unavailable_nodes(nodes))
        if plan is not None and plan.nodes is None and "would leave" in plan.why:
            if not (may_restart and decision.event not in ("preempted", "time_limit")):
                why = (f"after a hang: {plan.why}; the job stays down: check {bad} (scontrol show node {bad}), then "
                       f"resume with: {resume_command()}")
                ledger.write("stop_decision", what="node_excluded", requeue=False, reason=why, error=message)
                return "none", why
            # The allocation is intact and a hang is often transient (a stalled filesystem, a slow peer): a
            # restart in place, counted against the failure budget (decide() said it is not spent), is worth
            # more than a job that stays down. A node that hangs every time spends the budget, then stays down.
            plan = replace(plan, why=f"{plan.why}: restarting in place instead ({budget.describe()}); if it hangs "
                                     f"again, check {bad} (scontrol show node {bad})")
        # A step that failed while the job is being preempted or reaching its time limit (e.g. a rank killed by
        # the user signal before it could install a handler) must not start again here: the allocation is ending.
        in_place = may_restart and not (plan and plan.nodes) and decision.event not in ("preempted", "time_limit")
        action: Action = ("restart" if in_place else "requeued") if decision.requeue else "none"
        if action == "none" and bad and plan is None and budget.spent:
            decision = replace(decision, why=f"{decision.why}; the hangs were pinned on {bad}: check it (scontrol "
                                             f"show node {bad})")
        if action == "none" and decision.event != "requeued_by_slurm":  # the job stays down: say how it continues
            cancelled = decision.event in ("cancelled", "interrupted")
            decision = replace(decision, why=f"{decision.why}; " + ("to resume: " if cancelled else
                               "the job stays down; fix what failed, then resume with: ") + resume_command())
        why = f"after a {kind}: {decision.why}" + (f"; {plan.why}" if plan else "")
        ledger.write("stop_decision", what=decision.event, requeue=decision.requeue, action=action, reason=why,
                     error=message, **who)
        if action == "restart":
            ledger.write("restarted", after=kind, message="the step starts again in this allocation")
            return action, "restarting the step in this allocation (no requeue hold)"
        if action == "none":
            return action, decision.why
        if before_requeue is not None:
            before_requeue()
        outcome = requeue(job_id)
        ledger.write("requeued", how=outcome.how, message=outcome.message, after=kind)
        if plan is not None and plan.nodes:
            apply_exclusion(job_id, plan.nodes)  # pending now: Slurm takes it (not while running)
            ledger.write("node_excluded", node=bad, excluded=list(plan.nodes), reason=f"hang: ranks {hang['ranks']}")  # type: ignore[index]  # a plan comes from a hang
        note = ""
        if not (plan and plan.nodes) and (straggler := straggler_node(attempt)) is not None:
            note = f"; {exclude_straggler(job_id, *straggler, ledger)}"  # stragglers.exclude_node: at this requeue
        return action, f"requeued after the {kind}: {outcome.message}" + (f"; {plan.why}" if plan else "") + note
    except Exception as inner:  # noqa: BLE001  (never hide the failure that brought us here)
        return "none", (f"could not requeue after the failure: {type(inner).__name__}: {inner}; to resume: "
                        f"{resume_command(ask=False)}")


def _restart_unanswered(ledger: Ledger, kind: str, budget: Budget, unknown: str, message: str, who: dict[str, int],
                        may_restart: bool, bad: str | None) -> tuple[Action, str]:
    """After a failed step, Slurm gave no answer about the job: a restart in place needs nothing from Slurm (the
    allocation is there, the budget is in the ledger), so it is the way back; a requeue or an exclusion is not."""
    said = f"Slurm gave no answer ({unknown})"
    if budget.spent or not may_restart:
        why = (f"after a {kind}: {said}; " + (f"the {budget.kind} budget is spent ({budget.used} of {budget.limit} "
               f"{budget.noun} used)" if budget.spent else "the batch script cannot start the step again here") +
               f"; the job stays down; fix what failed, then resume with: {resume_command()}")
        ledger.write("stop_decision", what="unknown", requeue=False, action="none", reason=why, error=message,
                     unknown=unknown, **who)
        return "none", why
    node = f"; the hang was pinned on {bad}, which cannot be excluded without Slurm: check it" if bad else ""
    why = (f"after a {kind}: {said}; a restart in place needs nothing from Slurm: restarting the step in this "
           f"allocation ({budget.describe()}){node}")
    ledger.write("stop_decision", what="unknown", requeue=True, action="restart", reason=why, error=message,
                 unknown=unknown, **who)
    ledger.write("restarted", after=kind, message="the step starts again in this allocation")
    return "restart", f"{why} (no requeue hold)"


def rank_failed(error: BaseException, run: RunDir, *, rank: int, job_id: str, restart: int, slurm_job: str | None,
                limits: Limits, by_batch: bool | None = None) -> None:
    """A session's rank failed: record it and, within the failure budget, requeue the job while the group still
    exists (tearing it down can block on a dead peer until srun's KILL). Where the batch script decides after
    srun returns (`by_batch`, default MGPU_RECOVERY=batch), it alone does. Bad input is never requeued."""
    consequence = peer_consequence(error)
    if rank == 0 or not (consequence or isinstance(error, MgpuError)):
        # Every rank with an error of its own records it (rank 0's is often only the consequence: `Connection
        # closed by peer`); retry: whether a requeue can help; bad input or a full disk fails the same way again.
        # Rank 0 in the ledger; the others each in a file of their own (mgpu.record.failures: many nodes' concurrent
        # appends to one file are not atomic on NFS).
        fields = {"error": f"{type(error).__name__}: {error}", "retry": not isinstance(error, MgpuError),
                  "host": socket.gethostname(), **({"consequence": True} if consequence else {})}
        if rank == 0:
            Ledger(run.ledger, job_id, restart).write("failed", rank=rank, **fields)
        else:
            try:
                record_failure(run.path, job_id, restart, rank, fields, time.time())
            except OSError as unwritten:
                logging.getLogger("mgpu.train").error("rank %d: cannot record its failure in %s: %s", rank,
                                                      run.path, unwritten.strerror or unwritten)
    by_batch = by_batch if by_batch is not None else os.environ.get("MGPU_RECOVERY") == "batch"
    if slurm_job and isinstance(error, Exception) and not isinstance(error, MgpuError) and not by_batch:
        _, what = handle_failure(run, slurm_job, restart, limits,
                                 f"rank {rank} failed: {type(error).__name__}: {error}", rank=rank)
        logging.getLogger("mgpu.train").error("rank %d failed: %s: %s; %s", rank, type(error).__name__, error, what)


CLEANUP_S = 30.0
"""The bound on removing a failed job's snapshots from every node before it is requeued."""


def remove_on_every_node(job_id: str, environ: Mapping[str, str] | None = None,
                         run: Callable[..., Any] | None = None) -> str:
    """Before a requeue: the job's snapshots in memory (and its watchdog board) removed on every node of the
    allocation, one srun task per node (`python -m mgpu.state.memory.store --remove-this-job`). The batch
    script's own teardown never runs once the job is requeued (Slurm ends it), and the requeued job may start on
    other nodes. Bounded by CLEANUP_S; never raises; what it did, one line per node."""
    environ = os.environ if environ is None else environ
    nodes = environ.get("SLURM_JOB_NUM_NODES") or environ.get("SLURM_NNODES") or "1"
    command = ["srun", f"--nodes={nodes}", f"--ntasks={nodes}", "--ntasks-per-node=1", "--overlap",
               "--kill-on-bad-exit=0", sys.executable, "-m", "mgpu.state.memory.store", "--remove-this-job"]
    try:
        proc = (run or subprocess.run)(command, capture_output=True, text=True, timeout=CLEANUP_S,
                                       start_new_session=True)
    except (OSError, subprocess.SubprocessError) as error:
        return f"the snapshots in memory of job {job_id} on its other nodes were not removed: {error}"
    said = [line for line in proc.stdout.splitlines() if line.startswith("mgpu.state.memory.store:")]
    if proc.returncode != 0 or not said:
        return (f"the snapshots in memory of job {job_id} on its other nodes were not removed: srun exited "
                f"{proc.returncode}: {' '.join(proc.stderr.split())[:300]}")
    return "; ".join(sorted(said))


def _run_dir(args: argparse.Namespace) -> RunDir | None:
    if args.run_dir:
        return RunDir(args.run_dir)
    if args.run_dir_file:  # slurm/loop.sbatch: the session of a loop of one's own wrote where its run is
        try:
            return RunDir(Path(Path(args.run_dir_file).read_text().strip()))
        except OSError:
            return None  # the session never started: there is no run to requeue
    from mgpu.config.loading import load_config

    return RunDir.of(load_config(args.config, args.overrides).run)


def main(argv: Sequence[str] | None = None) -> int:
    """The batch script's line after srun. Exits with the code mgpu set for the step (`recorded_exit_code`: what
    rank 0 or this module decided, as it would have exited under srun), else the step's own code, so the job's
    state stays true under every launcher; the batch script ends with it."""
    parser = argparse.ArgumentParser(prog="python -m mgpu.run.recovery", description=__doc__.splitlines()[0])
    parser.add_argument("--exit-code", type=int, required=True, help="srun's exit code ($?)")
    parser.add_argument("--run-dir", help="the run directory")
    parser.add_argument("--config", help="or: the job's config and overrides, to find the run directory")
    parser.add_argument("--run-dir-file", help="or: a file holding the run directory (what a session announced)")
    parser.add_argument("--may-restart", action="store_true",
                        help="the script runs srun again when this prints 'restart' (and exits 0)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_intermixed_args(argv)
    if args.exit_code == 0 or not owns_slurm_job():
        return args.exit_code
    # `scontrol requeue` signals every process of the job, this one included; it must still set the
    # exclusion (only possible once the job is pending) and write the ledger.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if args.exit_code == USAGE_EXIT_CODE:
        # jobs/train.py's exit for bad input or a full disk (mgpu.errors): the same again on a requeue. The
        # ledger says so too, when it could be written; a full disk may have stopped that.
        print(f"mgpu.run.recovery: the step exited {USAGE_EXIT_CODE} (bad input or a full disk, see its one-line "
              f"error): not requeued; fix it, then resume with: {resume_command()}", file=sys.stderr, flush=True)
        return args.exit_code
    from mgpu.cluster.environment import SlurmEnvironment

    try:
        run = _run_dir(args)
        limits = Limits.from_environ()
        restart = SlurmEnvironment._restarts(os.environ)  # a non-integer one is one line, as in the ranks
    except MgpuError as error:
        print(f"mgpu.run.recovery: error: {error}", file=sys.stderr, flush=True)
        return args.exit_code
    if run is None:
        print(f"mgpu.run.recovery: the step exited {args.exit_code} before its session announced a run directory "
              f"({args.run_dir_file}): not requeued; fix it, then resume with: {resume_command()}",
              file=sys.stderr, flush=True)
        return args.exit_code
    job_id = SlurmEnvironment.job_id(os.environ)
    def before_requeue() -> None:
        print(f"mgpu.run.recovery: {remove_on_every_node(job_id)}", file=sys.stderr, flush=True)

    message = f"the training step exited with code {args.exit_code}"
    action, outcome = handle_failure(run, job_id, restart, limits, message, may_restart=args.may_restart,
                                     before_requeue=before_requeue)
    print(f"mgpu.run.recovery: job {job_id} run {restart}: {outcome}", file=sys.stderr, flush=True)
    if action == "restart":
        print("restart", flush=True)
        return 0
    from mgpu.state.memory.store import remove_job  # [memory snapshots hook] no restart in place: none is needed

    remove_job(job_id)
    # The code mgpu set, whatever the launcher made of it (torchrun and submitit exit 1 for any rank's failure).
    recorded = recorded_exit_code(this_attempt(read_ledger(run.ledger), job_id, restart))
    return args.exit_code if recorded is None else recorded


if __name__ == "__main__":
    sys.exit(main())
