"""A user's IterableDataset with the Stateful protocol (state_dict/load_state_dict) through the loop's loader:
per-worker states taken at the batch the loop trains on, a resume that continues the unbroken run's batches
(the next worker first), and one-line refusals where the state cannot carry over. In-process: real
DataLoader workers, a world of one (gloo not needed); the per-rank gather through mgpu.state.train_state."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest
from torch.utils.data import IterableDataset, get_worker_info

from mgpu.data.loader import ResumableLoader
from mgpu.data.stream_loader import StatefulStreamLoader, open_loader
from mgpu.data.stream import StreamError
from mgpu.state.train_state import gather_state, restore_state


class Shards(IterableDataset):
    """Items of `sizes[k]` per shard k (item = k * 1000 + i); worker w of W reads shards w, w + W, ...; the state
    is the worker's (shard, item) cursor, as a Stateful source keeps it."""

    def __init__(self, sizes: list[int]) -> None:
        self.sizes = sizes
        self.cursor = {"shard": 0, "item": 0}

    def __iter__(self) -> Iterator[int]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        mine = list(range(worker, len(self.sizes), workers))
        while self.cursor["shard"] < len(mine):
            shard = mine[self.cursor["shard"]]
            while self.cursor["item"] < self.sizes[shard]:
                item = shard * 1000 + self.cursor["item"]
                self.cursor["item"] += 1
                yield item
            self.cursor = {"shard": self.cursor["shard"] + 1, "item": 0}
        self.cursor = {"shard": 0, "item": 0}  # the next epoch starts over

    def state_dict(self) -> dict[str, Any]:
        return dict(self.cursor)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.cursor = dict(state)


class Plain(IterableDataset):
    def __iter__(self) -> Iterator[int]:
        return iter(range(3))


SIZES = [7, 3, 10, 1, 6, 9, 2]


def make(workers: int, world: int = 1, rank: int = 0) -> StatefulStreamLoader:
    loader = open_loader(Shards(SIZES), 4, rank=rank, world_size=world, num_workers=workers, collate_fn=list)
    assert isinstance(loader, StatefulStreamLoader)
    return loader


def take(loader: StatefulStreamLoader, count: int) -> list[list[int]]:
    got = []
    for batch in loader:
        got.append(batch)
        if len(got) == count:
            break
    return got


@pytest.mark.parametrize("workers, stop", [(0, 3), (2, 3), (2, 4), (3, 1), (3, 7), (4, 5)])
def test_a_stateful_stream_resumes_with_the_unbroken_runs_batches(workers: int, stop: int) -> None:
    unbroken = take(make(workers), 100)
    assert sorted(sum(unbroken, [])) == sorted(k * 1000 + i for k, n in enumerate(SIZES) for i in range(n))
    first = make(workers)
    got = take(first, stop)
    saved = first.state_dict()
    resumed = make(workers)
    resumed.load_state_dict(saved)
    assert resumed.position == stop
    rest = take(resumed, 100)
    assert resumed.start_position == stop and resumed.epoch == 1
    assert got + rest == unbroken


def test_the_state_goes_through_the_checkpoints_per_rank_gather() -> None:
    first = make(2)
    take(first, 3)
    state = gather_state({"loader": first}, None)
    assert state is not None and len(state["loader"]["per_rank"]) == 1
    resumed = make(2)
    restore_state(state, {"loader": resumed}, rank=0, seed=0)
    assert (resumed.epoch, resumed.position) == (0, 3)


def test_what_cannot_carry_over_is_refused_in_one_line() -> None:
    first = make(2)
    take(first, 2)
    saved = first.state_dict()
    with pytest.raises(StreamError, match=r"saved with num_workers=2 per rank, this run has num_workers=3: .*"
                                          r"resume with num_workers=2,"):
        make(3).load_state_dict(saved)
    # Saved with 0 workers: the refusal names 0 (it said 1), and either 0 or 1 resumes.
    none = make(0)
    take(none, 2)
    with pytest.raises(StreamError, match=r"saved with num_workers=0 per rank, this run has num_workers=2: .*"
                                          r"resume with num_workers=0 or 1,"):
        make(2).load_state_dict(none.state_dict())
    with pytest.raises(StreamError, match=r"saved by 1 rank\(s\), this run has 2"):
        make(2, world=2).load_state_dict(saved)
    with pytest.raises(StreamError, match="Plain is an IterableDataset without state_dict"):
        open_loader(Plain(), 4, rank=0, world_size=1)
    with pytest.raises(StreamError, match="not a stateful stream"):
        make(0).load_state_dict(ResumableLoader(list(range(5)), 2, rank=0, world_size=1).state_dict())  # type: ignore[arg-type]


def test_zero_and_one_worker_share_a_state() -> None:
    first = make(0)
    got = take(first, 2)
    resumed = make(1)
    resumed.load_state_dict(first.state_dict())
    assert got + take(resumed, 100) == take(make(0), 100)


def test_every_epoch_starts_from_the_beginning() -> None:
    loader = make(2)
    one = take(loader, 100)
    two = take(loader, 100)
    assert loader.epoch == 2 and one == two


# ------------------------------------------------------------------ through the trainer (a Task's train_dataset)
# tests.tasks.StatefulBlobTask: 40 blobs as a Stateful stream in blocks of 7. In process, a world of one (the
# per-rank gather is the Session's, tested above and on real ranks in tests/test_stream_gpt.py). Batches of 3,
# two per step: with 0 workers 14 batches (the last of 1 sample), 7 steps an epoch; with 2 workers too
# (21 and 19 samples). Epoch ends evaluate and checkpoint (the defaults), so the trainer must know them.
STATEFUL = ["task.target=tests.tasks:StatefulBlobTask", "task.args.batch_norm=false", "data.batch_size=3",
            "train.grad_accum=2", "train.max_steps=17", "train.epochs=5", "log.every_steps=1",
            "log.tensorboard=false", "optim.lr=0.05"]


def fit(run_dir: Path, workers: int, monkeypatch: pytest.MonkeyPatch, stop_at: int | None = None,
        *extra: str) -> Any:
    from mgpu.config.loading import load_config
    from mgpu.cluster.environment import detect_environment
    from mgpu.train.job import run_training

    for name in ("SLURM_JOB_ID", "SLURM_NTASKS", "SLURM_PROCID", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(run_dir.parent / "inductor"))  # torch's own side effect
    if stop_at is None:
        monkeypatch.delenv("MGPU_STOP_AT_STEP", raising=False)
    else:
        monkeypatch.setenv("MGPU_STOP_AT_STEP", str(stop_at))
    ids = run_dir.parent / f"{run_dir.name}-ids"
    ids.mkdir(exist_ok=True)
    cfg = load_config(None, [*STATEFUL, f"data.num_workers={workers}", f"task.args.ids_dir={ids}",
                             f"run.dir={run_dir}", *extra])
    result, _ = run_training(cfg, env=detect_environment({}))
    return result


def trained(run_dir: Path) -> list[int]:
    return [int(i) for line in (run_dir.parent / f"{run_dir.name}-ids" / "ids-rank0.txt").read_text().splitlines()
            for i in line.split()]


def model_state(run_dir: Path) -> dict[str, Any]:
    from mgpu.state.single.store import CheckpointStore

    latest = CheckpointStore(run_dir / "checkpoints").latest()
    assert latest is not None
    return latest.state


@pytest.mark.parametrize("workers, stop_at", [(0, 3), (2, 7), (2, 10)])  # mid-epoch; an epoch's last step
def test_a_task_with_a_stateful_stream_resumes_as_the_unbroken_run(workers: int, stop_at: int, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from mgpu.record.ledger import read_ledger

    unbroken = fit(tmp_path / "unbroken", workers, monkeypatch)
    assert unbroken.status == "finished" and unbroken.step == 17 and unbroken.epoch == 2
    evaluated = [e["step"] for e in read_ledger(tmp_path / "unbroken" / "events.jsonl") if e["event"] == "evaluated"]
    assert evaluated == [7, 14, 17]  # each epoch's end, known at its last step; then the run's end
    ids = trained(tmp_path / "unbroken")
    assert sorted(ids[:40]) == sorted(ids[40:80]) == list(range(40))
    stopped = fit(tmp_path / "broken", workers, monkeypatch, stop_at)
    assert stopped.status == "stopped" and stopped.step == stop_at
    resumed = fit(tmp_path / "broken", workers, monkeypatch)
    assert resumed.status == "finished" and resumed.resumed_step == stop_at
    assert trained(tmp_path / "broken") == ids  # no sample twice, none skipped, in the same batches
    a, b = model_state(tmp_path / "broken"), model_state(tmp_path / "unbroken")
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert a["progress"] == b["progress"]


def test_a_task_stream_refuses_in_one_line_what_it_cannot_guarantee(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from mgpu.errors import MgpuError
    from mgpu.train.task import TaskError, sized_dataset
    from tests.tasks import StatefulBlobs, Blobs

    with pytest.raises(MgpuError, match=r"stream without a length \(StatefulBlobs\): set train.max_steps"):
        fit(tmp_path / "run", 0, monkeypatch, None, "train.max_steps=null")
    fit(tmp_path / "run", 2, monkeypatch, 3)
    with pytest.raises(StreamError, match=r"saved with num_workers=2 per rank, this run has num_workers=0"):
        fit(tmp_path / "run", 0, monkeypatch)
    with pytest.raises(TaskError, match=r"Plain\) without state_dict\(\)/load_state_dict\(\).*give it that protocol"):
        sized_dataset(Plain(), "T.train_dataset()")
    with pytest.raises(TaskError, match="an evaluation set is map-style"):
        sized_dataset(StatefulBlobs(Blobs(4, 0)), "T.eval_dataset()", optional=True)
