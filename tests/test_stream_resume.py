"""The stream's guarantee on real gloo ranks with real signals (tests/stream_loop.py): stopped by SIGTERM at
seeded random steps, resumed with other worker counts and world sizes, every sample is trained on exactly
once per epoch (a per-sample log per rank), and the weights equal an unbroken run's bit for bit."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from mgpu.state.single.store import CheckpointStore
from mgpu.record.ledger import read_ledger
from tests.conftest import ROOT, start_ranks, wait_ranks
from tests.test_trainer import assert_identical

LOOP = str(ROOT / "tests" / "stream_loop.py")
WINDOWS = [13, 5, 21, 9, 17, 3, 12]  # per shard: 80 samples, shards of uneven size
ALL_IDS = Counter(k * 100 + i for k, n in enumerate(WINDOWS) for i in range(n))

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    data = tmp_path_factory.mktemp("shards")
    for k, windows in enumerate(WINDOWS):
        (k * 1000 + np.arange(windows * 8 + 1)).astype("uint16").tofile(data / f"shard-{k}.bin")
    return data


def run(run_dir: Path, shards: Path, world: int, workers: int, signal_at: int | None = None, *extra: str) -> None:
    argv = [LOOP, str(run_dir), str(shards), f"--workers={workers}", *extra]
    results = wait_ranks(start_ranks(argv + ([f"--signal-at={signal_at}"] if signal_at else []), world), timeout=240)
    codes = [rc for rc, _ in results]
    expected = [0] * world if signal_at is None else [3] + [0] * (world - 1)  # rank 0 says "stopped"
    output = "\n".join(out for _, out in results)
    assert codes == expected, output[-3000:]
    assert "Traceback" not in output and "DataLoader worker" not in output, output[-3000:]


def ids_per_epoch(run_dir: Path) -> dict[int, Counter]:
    """Every sample every rank logged it trained on, in all legs (a step trained after the stop's checkpoint
    would be trained again after the resume and count twice), of a run that was resumed."""
    assert any(e["event"] == "resumed" for e in read_ledger(run_dir / "events.jsonl")), "never resumed"
    return ids_per_epoch_unchecked(run_dir)


def ids_per_epoch_unchecked(run_dir: Path) -> dict[int, Counter]:
    seen: dict[int, Counter] = {}
    for log in sorted((run_dir / "ids").glob("rank-*.txt")):
        for line in log.read_text().splitlines():
            _step, epoch, sample = map(int, line.split())
            seen.setdefault(epoch, Counter())[sample] += 1
    return seen


def final(run_dir: Path) -> dict:
    latest = CheckpointStore(run_dir / "checkpoints").latest()
    assert latest is not None
    return latest.state


def stops(run_dir: Path) -> list[int]:
    return [e["step"] for e in read_ledger(run_dir / "events.jsonl") if e["event"] == "preempted"]


def test_five_signals_and_worker_changes_keep_every_sample_once_and_the_weights_bit_identical(
        shards: Path, tmp_path: Path) -> None:
    # 80 samples, 2 ranks x 3: 14 steps an epoch, 27 in all. Stops at seeded random steps, 5 of them.
    rng = random.Random(2025)
    signal_steps = sorted(rng.sample(range(2, 26), 5))
    workers = [2, 0, 4, 2, 4, 0]  # the worker count of each leg: 2 -> 0 -> 4 -> 2 -> 4 -> 0
    reference = tmp_path / "unbroken"
    run(reference, shards, 2, 2)
    broken = tmp_path / "broken"
    for leg, signal_at in enumerate(signal_steps):
        run(broken, shards, 2, workers[leg], signal_at)
    run(broken, shards, 2, workers[-1])
    assert stops(broken) == [k + 1 for k in signal_steps]  # the agreement: the step after the signal's
    assert ids_per_epoch(broken) == {0: ALL_IDS, 1: ALL_IDS}
    # Token windows carry no per-sample randomness, so a worker count changes nothing in the numbers.
    assert_identical(final(broken)["model"], final(reference)["model"], "model")
    assert_identical(final(broken)["optimizer"], final(reference)["optimizer"], "optimizer")


def test_a_world_size_change_4_2_3_keeps_every_sample_once(shards: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run(run_dir, shards, 4, 2, signal_at=4)  # 4 ranks x 3 = 12 samples a step: stops at step 5 (60 samples)
    run(run_dir, shards, 2, 0, signal_at=9)  # resumed at 60: 6 a step, epoch 0 ends at step 9, stop at 10
    run(run_dir, shards, 3, 4)
    assert stops(run_dir) == [5, 10]
    assert ids_per_epoch(run_dir) == {0: ALL_IDS, 1: ALL_IDS}


def test_a_stateful_stream_resumes_per_rank_and_worker_as_the_unbroken_run(shards: Path, tmp_path: Path) -> None:
    """A user's Stateful IterableDataset: each rank's and each worker's state goes into the checkpoint (gathered
    from every rank) and comes back; the epoch ends on every rank when one rank's stream ends."""
    reference, broken = tmp_path / "unbroken", tmp_path / "broken"
    run(reference, shards, 2, 2, None, "--stateful")
    run(broken, shards, 2, 2, 3, "--stateful")  # mid-epoch: workers 0 and 1 of each rank partway
    run(broken, shards, 2, 2, 11, "--stateful")
    run(broken, shards, 2, 2, None, "--stateful")
    assert stops(broken) == [4, 12]
    seen, expected = ids_per_epoch(broken), ids_per_epoch_unchecked(reference)
    assert seen == expected and all(max(c.values()) == 1 for c in seen.values())
    assert_identical(final(broken)["model"], final(reference)["model"], "model")
