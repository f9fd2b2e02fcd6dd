"""The fault matrix's plan (tests/e2e/fault_matrix.py): which scenarios exist, which CI runs, the table."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "e2e"))
from fault_matrix import (BEGIN, CI_SEED, END, FSDP_KINDS, KINDS, LATE_RANK, MOMENTS, WORKERS,  # noqa: E402
                          all_scenarios, ci_subset, publish, render, selected, summarize)


def test_the_whole_matrix_is_every_kind_at_every_moment() -> None:
    scenarios = all_scenarios()
    ddp = [s for s in scenarios if s.parallel == "ddp"]
    assert len(ddp) == len({s.id for s in ddp}) == 7 * 5 * 2 + 2  # the time limit: one moment
    assert {(s.kind, s.moment) for s in scenarios if s.kind == "time-limit"} == {("time-limit", "mid-step")}
    assert {s.moment for s in scenarios} == set(MOMENTS) and {s.workers for s in scenarios} == set(WORKERS)
    # FSDP2: preemption at GraceTime 0 and 10, a killed rank, a full disk, at every moment and both worker counts
    # and one rank late past the wait at one sharded save (FSDP2 alone: a sharded save's own failure)
    fsdp = [s for s in scenarios if s.parallel == "fsdp"]
    assert {(s.kind, s.moment, s.workers) for s in fsdp} == {(k, m, w) for k in FSDP_KINDS for m in MOMENTS
                                                           for w in WORKERS} | {(LATE_RANK, "checkpoint-write", 0)}
    assert len({s.id for s in scenarios}) == len(scenarios) == 72 + 41
    assert scenarios[-1].id == "late-rank@checkpoint-write/w0/fsdp"


def test_the_ci_subset_is_seeded_and_covers_every_kind_and_moment() -> None:
    subset = ci_subset()
    assert subset == ci_subset(CI_SEED)  # the same draw every time: CI runs a fixed subset
    assert [s.kind for s in subset] == list(KINDS)
    assert {s.moment for s in subset} == set(MOMENTS) and {s.workers for s in subset} == set(WORKERS)
    assert set(subset) <= set(all_scenarios())
    assert [s.kind for s in subset if s.parallel == "fsdp"] in ([k] for k in FSDP_KINDS)  # one sharded job
    assert ci_subset(1) != subset  # another seed, another draw


@pytest.mark.parametrize("selection, count", [(None, 8), ("ci", 8), ("all", 113), ("fsdp", 41),
                                                     ("seed:7", 8)])
def test_selection(selection: str | None, count: int) -> None:
    assert len(selected(selection)) == count


def test_a_bad_selection_says_what_to_use() -> None:
    with pytest.raises(ValueError, match="use ci, all, fsdp or seed:N"):
        selected("everything")


def test_the_table_lists_every_row_and_the_failures() -> None:
    rows = [{"order": 2, "id": "b", "outcome": "PREEMPTED → COMPLETED", "stops": [4], "lost": 0, "identical": True,
             "seconds": 31.2, "passed": True},
            {"order": 1, "id": "a", "outcome": "CANCELLED", "stops": [], "lost": "-", "identical": False,
             "seconds": 9.0, "passed": False, "error": "AssertionError: CANCELLED, not COMPLETED"}]
    table = render(rows).splitlines()
    assert table[2] == "| a | CANCELLED | - | - | NO | 9 |"
    assert table[3] == "| b | PREEMPTED → COMPLETED | 4 | 0 | yes | 31 |"
    assert table[5] == "2 scenarios, 1 passed; failed: a."
    assert table[-1] == "- a: AssertionError: CANCELLED, not COMPLETED"  # why, for every failed one


ROWS = [{"order": 0, "id": "scancel@mid-step/w0", "outcome": "CANCELLED → (resubmitted) → COMPLETED", "stops": [5],
         "lost": 0, "identical": True, "seconds": 40.0, "passed": True},
        {"order": 1, "id": "scancel@mid-step/w2", "outcome": "CANCELLED → (resubmitted) → COMPLETED", "stops": [6],
         "lost": 0, "identical": True, "seconds": 50.0, "passed": True},
        {"order": 2, "id": "scancel@evaluation/w0", "outcome": "", "stops": [], "lost": "-", "identical": False,
         "seconds": 90.0, "passed": False, "error": "AssertionError: timed out"},
        {"order": 3, "id": "kill-rank@mid-step/w0", "outcome": "COMPLETED", "stops": [], "lost": 1,
         "identical": True, "seconds": 30.0, "passed": True}]


def test_the_summary_has_one_row_per_stop_kind_in_the_matrix_order() -> None:
    table = summarize(ROWS).splitlines()
    assert table[2:] == ["| scancel | 3 | CANCELLED → (resubmitted) → COMPLETED: 2; -: 1 | 2 of 3 | 50 |",
                         "| kill-rank | 1 | COMPLETED: 1 | 1 of 1 | 30 |"]


def test_publish_replaces_only_the_marked_block() -> None:
    readme = f"# x\n\nbefore\n\n{BEGIN}\nNot run yet.\n{END}\n\nafter\n"
    once = publish(readme, ROWS, "python tests/e2e/fault_matrix.py", "2026-11-25")
    assert once.startswith("# x\n\nbefore\n\n" + BEGIN + "\nThe whole matrix, `python tests/e2e/fault_matrix.py` "
                           "(2026-11-25): 4 scenarios, 3 passed, 4 minutes.")
    assert once.endswith(f"| kill-rank | 1 | COMPLETED: 1 | 1 of 1 | 30 |\n{END}\n\nafter\n")
    assert "Not run yet" not in once and "[fault-matrix.md](fault-matrix.md)" in once
    assert publish(once, ROWS, "python tests/e2e/fault_matrix.py", "2026-11-25") == once  # idempotent
    with pytest.raises(ValueError, match="no <!-- fault-matrix --> ... <!-- /fault-matrix --> block"):
        publish("# x\nFAULT_MATRIX_SUMMARY\n", ROWS, "c", "d")


def test_the_preemption_page_has_the_block() -> None:
    readme = (Path(__file__).resolve().parent.parent / "docs" / "preemption.md").read_text()
    assert readme.count(BEGIN) == readme.count(END) == 1 and readme.index(BEGIN) < readme.index(END)
    assert "FAULT_MATRIX_SUMMARY" not in readme
