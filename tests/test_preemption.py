"""mgpu.stop.preemption: flags from signals, and the ranks' agreement on a real 2-rank gloo group."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from mgpu.stop.preemption import StopRequest
from tests.conftest import ROOT, run_world



def test_a_signal_only_sets_a_flag_and_the_time() -> None:
    with StopRequest("USR2") as stop:
        assert not stop.pending
        os.kill(os.getpid(), signal.SIGUSR2)
        assert stop.flags() == [1, 0, 0, 0, 0, 0] and [name for name, _ in stop.received] == ["SIGUSR2"]
    assert signal.getsignal(signal.SIGUSR2) is signal.SIG_DFL  # uninstalled: the previous handler is back


def test_the_first_ctrl_c_is_a_stop_the_second_interrupts() -> None:
    # Python's own handler, as in a terminal: a background job of a non-interactive shell starts with SIGINT
    # ignored (SIG_IGN), which is then the handler that comes back.
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with StopRequest("USR2") as stop:
            os.kill(os.getpid(), signal.SIGINT)
            assert stop.flags() == [0, 0, 0, 1, 0, 0] and [name for name, _ in stop.received] == ["SIGINT"]
            with pytest.raises(KeyboardInterrupt):
                os.kill(os.getpid(), signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # uninstalled: the previous is back
    finally:
        signal.signal(signal.SIGINT, before)


# (every, flag_at, stop_at, change): the agreement interval, the step rank 1 raises its flag at, the step both
# ranks must stop at, and (new interval, from step) when the interval changes.
SCHEDULES = [
    (1, 7, 8, ()),     # every step: shared at the next boundary, read one step later
    (5, 7, 11, ()),    # started at step 10 (a multiple of 5), read at 11
    (5, 10, 11, ()),   # raised just before the start at 10
    (5, 11, 16, ()),   # just after it: the next start, 15, then 16
    # The interval grows from 4 to 8 at step 13, while the reduction started at 12 is in flight: it is read
    # at 13 (it used to wait for a step that is 1 past a multiple of 8, 17, with the start at 16 skipped,
    # so a flag raised at 13 waited for the start at 24: 12 steps); the flag goes out at 16, read at 17.
    (4, 13, 17, (8, 13)),
    (8, 9, 13, (4, 9)),  # shrinking: the start at 12 (a multiple of 4), read at 13
]


@pytest.fixture(scope="module")
def agreement_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every schedule in turn on one real 2-rank gloo group: one launch, not one per schedule."""
    out = tmp_path_factory.mktemp("agreement")
    schedules = [",".join(map(str, (every, flag_at, *change))) for every, flag_at, _, change in SCHEDULES]
    proc = run_world([str(ROOT / "tests" / "agreement_steps.py"), str(out), *schedules], 2, timeout=180)
    assert proc.returncode == 0, proc.stdout
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("index", range(len(SCHEDULES)),
                         ids=[f"every{e}-flag{f}" + (f"-then{c[0]}from{c[1]}" if c else "") for e, f, _, c in SCHEDULES])
def test_every_rank_stops_at_the_same_step(index: int, agreement_runs: Path) -> None:
    stop_at = SCHEDULES[index][2]
    results = [json.loads((agreement_runs / f"{index}-rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [{k: r[k] for k in ("rank", "step", "reasons")} for r in results] == [
        {"rank": r, "step": stop_at, "reasons": ["requeue_signal"]} for r in (0, 1)]


@pytest.mark.multiprocess
def test_the_agreement_carries_every_ranks_compute_and_wait(agreement_runs: Path) -> None:
    # The same reductions as the stop flags (no other collective): every rank reads every rank's median compute and
    # wait of the interval; rank 1 works SLOW_S (100 ms) a step longer, and each rank reports its own wait.
    from tests.agreement_steps import SLOW_S, WAITED_S

    for index in range(len(SCHEDULES)):
        results = [json.loads((agreement_runs / f"{index}-rank{rank}.json").read_text()) for rank in (0, 1)]
        timing = results[0]["timing"]
        assert timing == results[1]["timing"] and results[0]["readings"] == results[1]["readings"] >= 1, results
        # Each rank's own wait, and rank 0's time blocked on the agreement's reduction that rank 1 joined late.
        assert timing["wait"][0] >= WAITED_S[0] and timing["wait"][1] >= WAITED_S[1], timing
        assert timing["compute"][1] - timing["compute"][0] > SLOW_S / 2, timing  # rank 1 works 100 ms longer
