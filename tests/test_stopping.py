"""mgpu.stop.stopping.StopController in one process, against fakes of its parts (no process group, no Slurm): the
agreement's answer, the test stop, the deadline stop and its once-said refusal, and what it reports."""

from __future__ import annotations

from typing import Any

import pytest

from mgpu.cluster.deadline import time_needed
from mgpu.errors import MgpuError
from mgpu.stop.stopping import STOP_AT_STEP, StopController, stop_at_step_from


class Flags:
    def __init__(self) -> None:
        self.requested: list[str] = []

    @property
    def pending(self) -> bool:
        return bool(self.requested)

    def request(self, reason: str) -> None:
        self.requested.append(reason)


class Agreement:
    """Answers what `answers` says at a step (as StopAgreement would, a step after a flag)."""

    def __init__(self, answers: dict[int, set[str]] | None = None, auto_every: int = 4) -> None:
        self.answers, self.auto_every = answers or {}, auto_every
        self.asked: list[tuple[int, int | None]] = []
        self.polls = 0

    def at_step(self, step: int, every: int | None = None) -> set[str]:
        self.asked.append((step, every))
        return set(self.answers.get(step, set()))

    def poll(self) -> set[str]:
        self.polls += 1
        return {"sigterm"} if self.polls == 2 else set()


class Clock:
    def __init__(self, end: float | None, limit_s: float | None = None, draining: dict[str, str] | None = None) -> None:
        self.end, self.limit_s, self.draining = end, limit_s, draining or {}

    def too_close(self, now: float, needed_s: float) -> bool:
        return self.end is not None and now + needed_s >= self.end

    def too_short(self, needed_s: float) -> bool:
        return self.limit_s is not None and needed_s > 0.5 * self.limit_s


class Ticks:
    """A monotonic clock that advances `step_s` per read."""

    def __init__(self, step_s: float) -> None:
        self.t, self.step_s = 0.0, step_s

    def __call__(self) -> float:
        self.t += self.step_s
        return self.t


def test_the_agreed_answer_is_the_controllers() -> None:
    agreement = Agreement({5: {"requeue_signal"}})
    stopper = StopController(Flags(), agreement, check_every=2)
    assert [stopper.at_step(step) for step in (1, 2, 3, 4)] == [set()] * 4 and not stopper.agreed
    assert stopper.at_step(5) == {"requeue_signal"} and stopper.agreed and stopper.requested
    assert agreement.asked == [(1, 2), (2, 2), (3, 2), (4, 2), (5, 2)]  # every step, with the configured interval


def test_the_test_stop_needs_no_agreement() -> None:
    agreement = Agreement()
    stopper = StopController(Flags(), agreement, stop_at_step=3)
    assert [bool(stopper.at_step(step)) for step in (1, 2, 3)] == [False, False, True]
    assert stopper.reasons == {"test"} and [step for step, _ in agreement.asked] == [1, 2]


@pytest.mark.parametrize("value, expected", [
    (None, None), ("", None), ("  ", None), ("3", 3), (" 12 ", 12),
    ("0", "must be a step number >= 1"), ("-2", "must be a step number >= 1"), ("x", "must be a step number >= 1"),
    ("2.5", "must be a step number >= 1"),
])
def test_the_test_stop_is_read_from_the_environment_alone(value: str | None, expected: int | str | None) -> None:
    environ = {} if value is None else {STOP_AT_STEP: value}
    if isinstance(expected, str):
        with pytest.raises(MgpuError, match=f"{STOP_AT_STEP}=.*: {expected}"):
            stop_at_step_from(environ)
    else:
        assert stop_at_step_from(environ) == expected


def test_a_flag_on_this_rank_is_requested_but_not_agreed() -> None:
    flags = Flags()
    stopper = StopController(flags, Agreement())
    flags.request("sigterm")
    assert stopper.requested and not stopper.agreed


def test_poll_between_steps_adds_to_the_reasons() -> None:
    stopper = StopController(Flags(), Agreement())
    assert stopper.poll() == set() and stopper.poll() == {"sigterm"} and stopper.reasons == {"sigterm"}


@pytest.mark.parametrize("left_s, expected", [(100.0, []), (26.0, []), (25.0, ["deadline"])])
def test_the_deadline_requests_a_stop_when_a_stop_would_not_fit(left_s: float, expected: list[str]) -> None:
    # Steps of 2 s, the agreement every 4 steps, a 5 s write, a 10 s margin: a stop needs 5*2 + 5 + 10 = 25 s.
    assert time_needed(2.0, 4, 5.0, 10.0) == 25.0
    flags = Flags()
    stopper = StopController(flags, Agreement(auto_every=4), clock=Clock(end=1000.0 + left_s), margin_s=10.0,
                             longest_write_s=lambda: 5.0, monotonic=Ticks(2.0), now=lambda: 1000.0)
    stopper.at_step(1)  # no step time yet: nothing to judge
    assert flags.requested == []
    stopper.at_step(2)
    assert flags.requested == expected


def test_a_time_limit_too_short_for_a_stop_is_left_to_the_signal() -> None:
    flags = Flags()
    stopper = StopController(flags, Agreement(auto_every=4), clock=Clock(end=1010.0, limit_s=30.0), margin_s=10.0,
                             longest_write_s=lambda: 5.0, monotonic=Ticks(2.0), now=lambda: 1000.0)
    for step in range(1, 5):
        stopper.at_step(step)
    assert flags.requested == []  # 10 + 5 + 3 (a tenth of the limit) = 18 s > half of 30 s: left to the signal


def test_no_clock_no_deadline() -> None:
    flags = Flags()
    stopper = StopController(flags, Agreement(), monotonic=Ticks(1000.0))
    for step in range(1, 4):
        stopper.at_step(step)
    assert flags.requested == [] and len(stopper.step_times) == 2


def test_a_draining_node_stops_the_run_at_the_next_step_before_any_signal() -> None:
    # Rank 0's clock saw one of the job's nodes set to DRAIN: a stop for `drain`, even before a step time is known.
    flags = Flags()
    stopper = StopController(flags, Agreement(auto_every=4), clock=Clock(end=None, draining={"n2": "IDLE+DRAIN (x)"}),
                             margin_s=10.0, longest_write_s=lambda: 5.0, monotonic=Ticks(2.0), now=lambda: 1000.0)
    stopper.at_step(1)
    assert flags.requested == ["drain"]


def test_a_reduction_a_dead_peer_left_unfinished_does_not_raise_from_the_cleanup() -> None:
    # Seen after a killed node: rank 0's cleanup (the session's, after its own failure was recorded) waited for the
    # agreement's reduction in flight and re-raised gloo's `Connection closed by peer` as a second traceback.
    import torch

    from mgpu.stop.preemption import StopAgreement, StopRequest

    class Broken:
        def wait(self) -> None:
            raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
                               "[127.0.0.1]:45123")

    agreement = StopAgreement(StopRequest())  # no process group here: the reduction in flight is the fake
    agreement._pending = (Broken(), torch.zeros(1))
    agreement.drain()
    assert agreement._pending is None
    agreement.drain()  # nothing in flight: nothing to wait for


def test_each_reading_of_the_ranks_step_times_goes_to_the_straggler_watch_once() -> None:
    # The agreement's newest reading (mgpu.stop.rank_timing.RankTimes) reaches the watch once, ending at the step its
    # reduction started at, or, started between steps (an evaluation's, step -1), at the last step boundary.
    from mgpu.stop.rank_timing import RankTimes

    class Timed(Agreement):
        readings, rank_times = 0, None

    class Watch:
        last_step = 0

        def __init__(self) -> None:
            self.updates: list[tuple[int, int]] = []

        def update(self, step: int, steps: int, compute: Any, wait: Any, now: float) -> list[str]:
            self.updates.append((step, steps))
            return [f"change at {step}"]

    agreement, watch, changes = Timed(), Watch(), []
    controller = StopController(Flags(), agreement, stragglers=watch, on_straggler=changes.append)
    controller.at_step(7)
    agreement.readings, agreement.rank_times = 1, RankTimes(4, 4, (0.2, 0.3), (0.0, 0.1))
    controller.at_step(8)
    controller.at_step(9)  # no new reading: nothing again
    agreement.readings, agreement.rank_times = 2, RankTimes(-1, 2, (0.2, 0.3), (0.0, 0.1))
    controller.poll()
    assert watch.updates == [(4, 4), (9, 2)] and changes == ["change at 4", "change at 9"]
