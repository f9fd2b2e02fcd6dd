"""The fault matrix's plan (tests/e2e/fault_matrix.py): which scenarios exist, which CI runs, the table."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "e2e"))
from fault_matrix import (CI_SEED, KINDS, MOMENTS, WORKERS, all_scenarios, ci_subset, render,  # noqa: E402
                          selected)


def test_the_whole_matrix_is_every_kind_at_every_moment() -> None:
    scenarios = all_scenarios()
    assert len(scenarios) == len({s.id for s in scenarios}) == 7 * 5 * 2 + 2  # the time limit: one moment
    assert {(s.kind, s.moment) for s in scenarios if s.kind == "time-limit"} == {("time-limit", "mid-step")}
    assert {s.moment for s in scenarios} == set(MOMENTS) and {s.workers for s in scenarios} == set(WORKERS)


def test_the_ci_subset_is_seeded_and_covers_every_kind_and_moment() -> None:
    subset = ci_subset()
    assert subset == ci_subset(CI_SEED)  # the same draw every time: CI runs a fixed subset
    assert [s.kind for s in subset] == list(KINDS)
    assert {s.moment for s in subset} == set(MOMENTS) and {s.workers for s in subset} == set(WORKERS)
    assert set(subset) <= set(all_scenarios())
    assert ci_subset(1) != subset  # another seed, another draw


@pytest.mark.parametrize("selection, count", [(None, 8), ("ci", 8), ("all", 72), ("seed:7", 8)])
def test_selection(selection: str | None, count: int) -> None:
    assert len(selected(selection)) == count


def test_a_bad_selection_says_what_to_use() -> None:
    with pytest.raises(ValueError, match="use ci, all or seed:N"):
        selected("everything")


def test_the_table_lists_every_row_and_the_failures() -> None:
    rows = [{"order": 2, "id": "b", "outcome": "PREEMPTED → COMPLETED", "stops": [4], "lost": 0, "identical": True,
             "seconds": 31.2, "passed": True},
            {"order": 1, "id": "a", "outcome": "CANCELLED", "stops": [], "lost": "-", "identical": False,
             "seconds": 9.0, "passed": False}]
    table = render(rows).splitlines()
    assert table[2] == "| a | CANCELLED | - | - | NO | 9 |"
    assert table[3] == "| b | PREEMPTED → COMPLETED | 4 | 0 | yes | 31 |"
    assert table[-1] == "2 scenarios, 1 passed; failed: a."
