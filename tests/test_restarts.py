"""Every restart explained (mgpu.record.restarts): the cause, the rank and node, the decision and why, and the way
back to training cut into its phases, from ledgers by tables; what status lists and the goodput table sums."""

from __future__ import annotations

from typing import Any

import pytest

from mgpu.record.goodput import goodput, goodput_lines
from mgpu.record.restarts import PHASES, UNTIMED, phase_totals, restart_lines, restarts
from tests.test_goodput import HUNG, KILLED_RANK, PREEMPTED, ev, progress

# rank 0's way back after the preemption of PREEMPTED (stopped at 100, last event 103): the process at 195
TIMINGS = {"process": 195.0, "session": 198.0, "group": 201.0, "find": 201.5, "loaded": 203.0, "restored": 204.0,
           "first_batch": 204.5, "first_step": 210.0}


def timed(events: list[dict[str, Any]], restart: int, timings: dict[str, float]) -> list[dict[str, Any]]:
    return [{**e, "timings": timings} if e["event"] == "first_step" and e["restart"] == restart else e for e in events]


SCANCELLED = [ev(0, "started"), ev(1, "first_step", step=1), progress(20, 9),
              ev(21, "preempted", step=9, reasons=["sigterm"], signals=["SIGTERM"], signal_times=[20.5]),
              ev(22, "stop_decision", step=9, what="cancelled", requeue=False, reason="cancelled: stays down")]
GRACE0 = [*PREEMPTED[:6], ev(102.5, "stop_decision", what="requeued_by_slurm", requeue=False,
                                reason="Slurm requeues it (GraceTime 0)"),
          ev(200, "started", restart=1), ev(200.1, "resumed", restart=1, step=95),
          ev(210, "first_step", restart=1, step=96)]
EXCLUDED = [*HUNG[:4], ev(96, "stop_decision", what="user_signal", requeue=True, action="requeued", error="exit 4",
                          reason="after a hang: requeued; excluding n2 (now excluded: n2)"),
            ev(96.5, "requeued", how="self", after="hang"), ev(96.6, "node_excluded", node="n2", excluded=["n2"]),
            *HUNG[6:]]
FAILED_RANK = [ev(0, "started"), ev(1, "first_step", step=1), progress(30, 12),
               ev(31, "failed", rank=1, host="n2", error="RuntimeError: CUDA error: an illegal memory access"),
               ev(31.5, "failed", rank=0, host="n1", error="RuntimeError: Connection closed by peer", consequence=True),
               ev(40, "stop_decision", what="user_signal", requeue=True, action="restart", error="exit 1",
                  reason="after a failure: restarting in place (failures 1 of 3 used)"),
               ev(40.1, "restarted", after="failure"),
               ev(45, "started"), ev(45.2, "resumed", step=10), ev(52, "first_step", step=11)]
KILLED = [ev(0, "started"), ev(1, "first_step", step=1), progress(30, 12)]
UNANSWERED = [*SCANCELLED[:4], ev(22, "stop_decision", step=9, what="unknown", requeue=False, unknown="timed out",
                                  reason="Slurm did not answer")]

CASES = {
    # name: (events, [(step, cause, where, decision, why, back)])
    "a grace-period preemption, self-requeued": (
        timed(PREEMPTED, 1, TIMINGS), [(95, "preempted: requeue_signal (SIGUSR2)", "", "requeued by itself", "", True)]),
    "GraceTime 0: Slurm requeues": (
        GRACE0, [(95, "requeued_by_slurm: requeue_signal (SIGUSR2)", "", "requeued by Slurm",
                  "Slurm requeues it (GraceTime 0)", True)]),
    "scancel: stays down": (SCANCELLED, [(9, "cancelled: sigterm (SIGTERM)", "", "stays down", "cancelled: stays down",
                                          False)]),
    "Slurm did not answer": (UNANSWERED, [(9, "unknown: sigterm (SIGTERM)", "", "unknown (Slurm did not answer)",
                                           "Slurm did not answer", False)]),
    "a killed rank, restarted in place": (KILLED_RANK, [(10, "failure: exited 137", "", "restarted in place", "",
                                                         True)]),
    "a rank's own error, not its peer's consequence": (
        FAILED_RANK, [(12, "failure: RuntimeError: CUDA error: an illegal memory access", "rank 1 on n2",
                       "restarted in place", "after a failure: restarting in place (failures 1 of 3 used)", True)]),
    "a hang, its node excluded": (
        EXCLUDED, [(21, "hang (no progress for 60 s)", "rank 1 on n2", "requeued by itself, n2 excluded",
                    "after a hang: requeued; excluding n2 (now excluded: n2)", True)]),
    "killed without a trace, not back (the newest attempt has no end: running)": (KILLED, []),
    "killed without a trace, then back": (
        [*KILLED, ev(60, "started", restart=1), ev(61, "first_step", restart=1, step=1)],
        [(12, "killed without a trace (SIGKILL, a lost node, the time limit's kill)", "", "none recorded", "", True)]),
}


@pytest.mark.parametrize("name", CASES)
def test_every_restart_explained(name: str) -> None:
    events, expected = CASES[name]
    assert [(r.step, r.cause, r.where, r.decision, r.why, r.back) for r in restarts(events)] == expected


def test_the_way_back_in_its_phases() -> None:
    (restart,) = restarts(timed(PREEMPTED, 1, TIMINGS))
    # stopped at 100 (USR2), last event 103, process 195, session 198, group 201, restored 204, first step 210
    assert restart.phases == {"stopping": 3.0, "hold": 92.0, "process start": 3.0, "rendezvous": 3.0,
                              "state load": 3.0, "first step": 6.0}
    assert list(restart.phases) == list(PHASES) and restart.total_s == 110.0  # the stop to the next first step
    # a ledger from before the timings: the way back in one stretch; a run with no checkpoint: load from the group
    (untimed,) = restarts(PREEMPTED)
    assert untimed.phases == {"stopping": 3.0, UNTIMED: 107.0}
    (fresh,) = restarts(timed(PREEMPTED, 1, {k: v for k, v in TIMINGS.items() if k not in ("loaded", "restored")}))
    assert fresh.phases["state load"] == 0.0 and fresh.phases["first step"] == 9.0


def test_status_lists_them_and_the_goodput_table_sums_them() -> None:
    events = timed(PREEMPTED, 1, TIMINGS) + [
        ev(310, "preempted", restart=1, step=110, reasons=["sigterm"], signals=["SIGTERM"], signal_times=[305.0]),
        ev(311, "stop_decision", restart=1, step=110, what="requeued_by_slurm", requeue=False),
        ev(400, "started", restart=2), ev(420, "first_step", restart=2, step=111,
                                          timings={**{k: v + 200 for k, v in TIMINGS.items()}})]
    events = [e for e in events if not (e["event"] == "finished")]
    found = restarts(events)
    lines = restart_lines(found)
    assert lines[0] == "restarts    2: cause, where, decision and why; the way back to training"
    assert lines[1] == "   1. after step 95: preempted: requeue_signal (SIGUSR2); requeued by itself"
    assert lines[2] == ("      back in 1m50s: stopping 3s, hold 1m32s, process start 3s, rendezvous 3s, state load 3s, "
                        "first step 6s")
    assert lines[3] == "   2. after step 110: requeued_by_slurm: sigterm (SIGTERM); requeued by Slurm"
    totals = phase_totals(found)
    assert totals["hold"] == 92.0 + (395.0 - 311.0) and totals["first step"] == 12.0
    table = goodput_lines(goodput(events), False, totals)
    at = table.index("   the way back, every restart summed (status's `restarts`):")
    assert table[at - 1].startswith("  restarting ")
    assert table[at + 1].split()[:2] == ["hold", "2m56s"] and table[at + 5].split()[:3] == ["first", "step", "12s"]
    assert restart_lines([]) == [] and "the way back" not in "\n".join(goodput_lines(goodput(events), False, {}))
