"""Small tasks for the trainer's tests: fast on CPU, with dropout and batch norm so RNG and buffers matter."""

from __future__ import annotations

import collections
import dataclasses
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from jobs.tasks.gpt import GptTask
from mgpu.train.task import Task


class Blobs(Dataset):
    """`size` points in 8-d, 3 classes; each item also carries its index so tests can account for it."""

    def __init__(self, size: int, seed: int) -> None:
        centers = torch.randn(3, 8, generator=torch.Generator().manual_seed(1234)) * 2
        g = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(0, 3, (size,), generator=g)
        self.x = centers[self.labels] + torch.randn(size, 8, generator=g)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[i], self.labels[i], i


class BlobTask(Task):
    """MLP with dropout and batch norm. `ids_dir`: append every trained sample id to ids-rank<R>.txt."""

    def __init__(self, size: int = 40, eval_size: int = 17, ids_dir: str | None = None,
                 batch_norm: bool = True) -> None:
        self.size, self.eval_size, self.ids_dir, self.batch_norm = size, eval_size, ids_dir, batch_norm

    def build_model(self) -> nn.Module:
        norm = nn.BatchNorm1d(16) if self.batch_norm else nn.Identity()
        # No bias before a batch norm, which cancels it: its gradient would be rounding noise, which Adam turns into
        # steps of the learning rate's size, so runs whose reductions round differently (DDP and FSDP2) would drift
        # apart in the running mean it shifts and so in every evaluation, by up to 1e-4 here.
        return nn.Sequential(nn.Linear(8, 16, bias=not self.batch_norm), norm, nn.ReLU(), nn.Dropout(0.3),
                             nn.Linear(16, 3))

    def train_dataset(self) -> Dataset:
        return Blobs(self.size, 0)

    def eval_dataset(self) -> Dataset:
        return Blobs(self.eval_size, 1)

    def loss(self, model: nn.Module, batch: tuple) -> torch.Tensor:
        x, y, ids = batch
        if self.ids_dir:
            rank = dist.get_rank() if dist.is_initialized() else 0
            with open(Path(self.ids_dir) / f"ids-rank{rank}.txt", "a") as f:
                f.write(" ".join(str(int(i)) for i in ids) + "\n")
        return F.cross_entropy(model(x), y, reduction="none")

    def metrics(self, model: nn.Module, batch: tuple) -> dict[str, torch.Tensor]:
        x, y, _ = batch
        logits = model(x)
        return {"loss": F.cross_entropy(logits, y, reduction="none"), "accuracy": (logits.argmax(1) == y).float()}


class SlowBlobTask(BlobTask):
    """BlobTask whose steps take `step_s` seconds (for signal tests that need time to act); `slow_rank`'s take
    `slow_factor` times as long (a straggler: the numerics are the same)."""

    def __init__(self, step_s: float = 0.2, ballast_mb: int = 0, slow_rank: int = -1, slow_factor: float = 1.0,
                 **kwargs) -> None:
        super().__init__(**kwargs)
        self.step_s, self.ballast_mb, self.slow_rank, self.slow_factor = step_s, ballast_mb, slow_rank, slow_factor

    def build_model(self) -> nn.Module:
        model = super().build_model()
        if self.ballast_mb:  # a large buffer makes every checkpoint slow to write
            model.register_buffer("ballast", torch.zeros(self.ballast_mb * 2**18))
        return model

    def loss(self, model: nn.Module, batch: tuple) -> torch.Tensor:
        import time

        slow = self.slow_rank >= 0 and dist.is_initialized() and dist.get_rank() == self.slow_rank
        time.sleep(self.step_s * (self.slow_factor if slow else 1.0))
        return super().loss(model, batch)


class ThrottledBlobTask(SlowBlobTask):
    """SlowBlobTask whose process joins the cgroup $MGPU_TEST_READ_CGROUP names (its `cgroup.procs`; tests/throttle.py:
    the kernel throttles its reads) when the task is built: after the imports, before the resume reads the
    checkpoint. Not a task argument (a resume refuses to change those); unset, nothing."""

    def __init__(self, **kwargs) -> None:
        import os

        super().__init__(**kwargs)
        procs = os.environ.get("MGPU_TEST_READ_CGROUP")
        if procs:
            Path(procs).write_text(f"{os.getpid()}\n")


class DiskFillingBlobTask(BlobTask):
    """BlobTask whose rank 0 fills the filesystem of `fill_dir` at its `fill_at`-th loss call and frees it
    again at call `free_at` (0: never): checkpoints in between meet a real ENOSPC.

    `settle_dir` (a run's checkpoints directory): from call `fill_at` on, rank 0 first waits for the background
    writer to finish the save it is writing, so that the next due save is not deferred (a writer at low priority
    on a loaded machine can take several of these millisecond steps): the saves due while the disk is full then
    meet it (a fresh clone's CI saw all of them deferred, none failed), and those after it is free are written
    (CI saw every one deferred to the stop's)."""

    def __init__(self, fill_dir: str = "", fill_at: int = 3, free_at: int = 0, settle_dir: str = "",
                 **kwargs) -> None:
        super().__init__(**kwargs)
        self.fill_dir, self.fill_at, self.free_at, self.calls = Path(fill_dir), fill_at, free_at, 0
        self.settle_dir = Path(settle_dir) if settle_dir else None

    def loss(self, model: nn.Module, batch: tuple) -> torch.Tensor:
        from tests.conftest import fill

        self.calls += 1
        if not dist.is_initialized() or dist.get_rank() == 0:
            if self.calls == self.fill_at:
                fill(self.fill_dir)
            elif self.calls == self.free_at:
                (self.fill_dir / "ballast").unlink()
            if self.settle_dir is not None and 0 < self.fill_at <= self.calls and self.free_at:
                self._writer_settled(self.settle_dir)
        return super().loss(model, batch)

    @staticmethod
    def _writer_settled(checkpoints: Path, limit_s: float = 60.0) -> None:
        """Wait until no save is being written under `checkpoints` (one is built under a .tmp-* name), then
        0.5 s more: the writer reports the save and prunes before it is free."""
        deadline = time.monotonic() + limit_s
        while any(checkpoints.glob(".tmp-*")) and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.5)


class NoisyBlobs(Blobs):
    """Blobs with random per-sample augmentation drawn in __getitem__ (in a DataLoader worker when there are)."""

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        x, y, index = super().__getitem__(i)
        return x + 0.5 * torch.randn(8), y, index


class AugmentedBlobTask(BlobTask):
    """BlobTask trained on NoisyBlobs: resume is bit-identical only if each sample's noise is reproduced."""

    def train_dataset(self) -> Dataset:
        return NoisyBlobs(self.size, 0)


class SignalingBlobTask(SlowBlobTask):
    """SlowBlobTask whose rank 0 sends `signals` to its whole process group (every rank and DataLoader
    worker, as slurmstepd signals every process of a step) at its `at`-th call of `where` ("loss" or
    "metrics"); `eval_step_s` slows evaluation batches so a stop can land inside one."""

    def __init__(self, signals: str = "TERM", at: int = 5, where: str = "loss", eval_step_s: float = 0.0,
                 once_file: str = "", **kwargs) -> None:
        super().__init__(**kwargs)
        self.signals, self.at, self.where, self.eval_step_s = signals.split("+"), at, where, eval_step_s
        self.once_file = once_file  # when set: signal only if this file does not exist yet (then create it)
        self.calls = {"loss": 0, "metrics": 0}

    def _maybe_signal(self, where: str) -> None:
        import os
        import signal

        self.calls[where] += 1
        if where == self.where and self.calls[where] == self.at and (not dist.is_initialized() or dist.get_rank() == 0):
            if self.once_file:
                if os.path.exists(self.once_file):
                    return
                open(self.once_file, "w").close()
            for name in self.signals:
                os.killpg(os.getpgrp(), getattr(signal, f"SIG{name}"))

    def loss(self, model: nn.Module, batch: tuple) -> torch.Tensor:
        self._maybe_signal("loss")
        return super().loss(model, batch)

    def metrics(self, model: nn.Module, batch: tuple) -> dict[str, torch.Tensor]:
        import time

        self._maybe_signal("metrics")
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"metrics call {self.calls['metrics']}", flush=True)
        time.sleep(self.eval_step_s)
        return super().metrics(model, batch)


# ---------------------------------------------------------------- tasks that break the contract (bad input)
class EmptyTrainTask(BlobTask):
    def train_dataset(self) -> Dataset:
        return Blobs(0, 0)


class EmptyEvalTask(BlobTask):
    def eval_dataset(self) -> Dataset:
        return Blobs(0, 1)


class StreamTask(BlobTask):
    def train_dataset(self) -> Dataset:
        from torch.utils.data import IterableDataset

        class Stream(IterableDataset):
            def __iter__(self):
                yield from Blobs(8, 0)

        return Stream()


class CursorStream(IterableDataset):
    """A user's Stateful stream (as a Hugging Face streaming dataset is; no mgpu.data.stream order): rank r's worker w
    of W reads the units (blocks, shards) r * W + w, + R * W, ... front to back; its state is its (unit, item)
    cursor, the unit named by UNIT. A subclass says what its units are, how many items each has, and reads one."""

    UNIT = "unit"
    rank: int | None = None
    world: int | None = None
    """This rank's place (None: the process group's, when there is one)."""

    def __init__(self) -> None:
        self.cursor = {self.UNIT: 0, "item": 0}

    def units(self) -> Any:
        raise NotImplementedError

    def count(self, unit: Any) -> int:
        raise NotImplementedError

    def read(self, unit: Any, item: int) -> Any:
        raise NotImplementedError

    def __iter__(self):  # type: ignore[no-untyped-def]
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        rank, world = (rank if self.rank is None else self.rank), (world if self.world is None else self.world)
        mine = self.units()[rank * workers + worker::world * workers]
        key = self.UNIT
        while self.cursor[key] < len(mine):
            unit = mine[self.cursor[key]]
            while self.cursor["item"] < self.count(unit):
                value = self.read(unit, self.cursor["item"])
                self.cursor["item"] += 1
                yield value
            self.cursor = {key: self.cursor[key] + 1, "item": 0}
        self.cursor = {key: 0, "item": 0}

    def state_dict(self) -> dict:
        return dict(self.cursor)

    def load_state_dict(self, state: dict) -> None:
        self.cursor = dict(state)


class StatefulBlobs(CursorStream):
    """Blobs as a Stateful stream: its units are the contiguous blocks of `block` items."""

    UNIT = "block"

    def __init__(self, blobs: Blobs, block: int = 7) -> None:
        self.blobs, self.block = blobs, block
        super().__init__()

    def units(self) -> range:
        return range(0, len(self.blobs), self.block)

    def count(self, unit: int) -> int:
        return min(self.block, len(self.blobs) - unit)

    def read(self, unit: int, item: int) -> Any:
        return self.blobs[unit + item]


class StatefulBlobTask(BlobTask):
    """BlobTask whose training set is a Stateful IterableDataset (no length): train.max_steps sets the run."""

    def train_dataset(self) -> Dataset:
        return StatefulBlobs(Blobs(self.size, 0))


class TokenShardTask(Task):
    """A tiny next-token model (dropout in it) over token shards read through mgpu.data.stream.ShardedStream:
    `files`, a glob of uint16 .bin shards; `ids_dir`: append each trained window's first token to ids-rank<R>.txt."""

    def __init__(self, files: str = "", block: int = 8, shuffle_buffer: int = 16, ids_dir: str | None = None,
                 step_s: float = 0.0) -> None:
        self.files, self.block, self.shuffle_buffer, self.ids_dir, self.step_s = \
            files, block, shuffle_buffer, ids_dir, step_s

    def build_model(self) -> nn.Module:
        return nn.Sequential(nn.Embedding(64, 16), nn.Dropout(0.2), nn.Linear(16, 64))

    def train_dataset(self) -> Dataset:
        from mgpu.data.stream import ShardedStream, TokenWindows

        return ShardedStream(self.files, TokenWindows(self.block, "uint16"), shuffle_buffer=self.shuffle_buffer)

    def loss(self, model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        if self.ids_dir:
            rank = dist.get_rank() if dist.is_initialized() else 0
            with open(Path(self.ids_dir) / f"ids-rank{rank}.txt", "a") as f:
                f.write(" ".join(str(int(w[0])) for w in batch) + "\n")
        if self.step_s:
            time.sleep(self.step_s)
        tokens = batch % 64
        logits = model(tokens[:, :-1])
        return F.cross_entropy(logits.transpose(1, 2), tokens[:, 1:], reduction="none").mean(1)


class StatefulTokenShards(CursorStream):
    """Token shards as a Stateful stream: its units are the shard files, its items their windows."""

    UNIT = "shard"

    def __init__(self, files: list[str], reader: Any, rank: int | None = None, world: int | None = None) -> None:
        """`rank`, `world`: this rank's place (default: the process group's, when there is one)."""
        self.files, self.reader, self.rank, self.world = files, reader, rank, world
        super().__init__()

    def units(self) -> list[str]:
        return self.files

    def count(self, unit: str) -> int:
        return self.reader.count(unit)

    def read(self, unit: str, item: int) -> Any:
        return self.reader.read(unit, item)


class StatefulGptTask(GptTask):
    """The GPT stream's token shards (stream: true) read through a Stateful IterableDataset of the task's own."""

    def train_dataset(self) -> Any:
        stream = super().train_dataset()
        return StatefulTokenShards(stream.files, stream.readers[0])


class NoLenTask(BlobTask):
    def train_dataset(self) -> Dataset:
        class NoLen(Dataset):
            def __getitem__(self, i: int):
                return Blobs(8, 0)[i]

        return NoLen()


class ScalarMetricTask(BlobTask):
    def metrics(self, model: nn.Module, batch: tuple) -> dict[str, torch.Tensor]:
        x, y, _ = batch
        return {"loss": F.cross_entropy(model(x), y)}  # a mean: not one value per sample


class Opaque:
    """Not a tensor, number, string, list or dict: torch.load(weights_only=True) refuses it."""


class UnloadableStateTask(BlobTask):
    """A model whose state_dict holds an Opaque (via get_extra_state): it saves, a resume could not load it."""

    def build_model(self) -> nn.Module:
        class WithExtra(nn.Sequential):
            def get_extra_state(self):
                return {"tokenizer": Opaque()}

            def set_extra_state(self, state):
                pass

        return WithExtra(*super().build_model())


# ---------------------------------------------------------------- batches that are not tuples of tensors
class NamedBatchTask(BlobTask):
    """Batches as a namedtuple holding a dataclass: the trainer moves them to the device as they are."""

    def collate_fn(self):
        return collate_named

    def loss(self, model: nn.Module, batch) -> torch.Tensor:
        return F.cross_entropy(model(batch.inputs.x), batch.y, reduction="none")

    def metrics(self, model: nn.Module, batch) -> dict[str, torch.Tensor]:
        logits = model(batch.inputs.x)
        return {"loss": F.cross_entropy(logits, batch.y, reduction="none"),
                "accuracy": (logits.argmax(1) == batch.y).float()}


@dataclasses.dataclass
class Inputs:
    x: torch.Tensor
    ids: torch.Tensor


Pair = collections.namedtuple("Pair", "inputs y")


def collate_named(samples: list) -> Pair:
    x, y, ids = (torch.stack([torch.as_tensor(s[i]) for s in samples]) for i in range(3))
    return Pair(Inputs(x, ids), y)


class HangingBlobTask(SlowBlobTask):
    """SlowBlobTask whose rank `rank` (-1: every rank) hangs at its `at`-th loss call: `sleep` (forever, inside loss),
    `stop` (SIGSTOP to itself: a frozen process), or `save` (every later write into a checkpoint file
    blocks forever, as on a dead filesystem). `hang_file`: once, marked by `<hang_file>.rank<N>`."""

    def __init__(self, at: int = 5, rank: int = 1, mode: str = "sleep", hang_file: str = "", **kwargs) -> None:
        super().__init__(**kwargs)
        self.at, self.rank, self.mode, self.hang_file, self.calls = at, rank, mode, hang_file, 0

    def loss(self, model: nn.Module, batch: tuple) -> torch.Tensor:
        import os
        import signal
        import time

        self.calls += 1
        me = dist.get_rank() if dist.is_initialized() else 0
        marker = f"{self.hang_file}.rank{me}" if self.hang_file else ""
        if self.calls == self.at and self.rank in (me, -1) and not (marker and os.path.exists(marker)):
            if marker:
                open(marker, "w").close()
            if self.mode == "sleep":
                time.sleep(3600)
            elif self.mode == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            else:
                import mgpu.state.files.digest
                import mgpu.state.files.direct_io

                mgpu.state.files.digest.DigestingFile.write = lambda *args: time.sleep(3600)
                mgpu.state.files.direct_io.DirectFile.write = lambda *args: time.sleep(3600)
        return super().loss(model, batch)


class UnevenBlobTask(BlobTask):
    """BlobTask whose rank `slow_rank` takes `slow_factor` times longer per loss call (`step_s` each), and
    `pause_s` longer still at its loss call number `pause_at` (0: never)."""

    def __init__(self, step_s: float = 0.1, slow_rank: int = 1, slow_factor: float = 3.0, pause_at: int = 0,
                 pause_s: float = 0.0, **kwargs) -> None:
        super().__init__(**kwargs)
        self.step_s, self.slow_rank, self.slow_factor = step_s, slow_rank, slow_factor
        self.pause_at, self.pause_s, self.calls = pause_at, pause_s, 0

    def loss(self, model: nn.Module, batch: tuple) -> torch.Tensor:
        import time

        me = dist.get_rank() if dist.is_initialized() else 0
        self.calls += 1
        time.sleep(self.step_s * (self.slow_factor if me == self.slow_rank else 1.0)
                   + (self.pause_s if me == self.slow_rank and self.calls == self.pause_at else 0.0))
        return super().loss(model, batch)


class CrashingBlobTask(BlobTask):
    """BlobTask whose rank `rank` raises its own error at its `at`-th loss call (a bug in one rank's code)."""

    def __init__(self, at: int = 3, rank: int = 1, **kwargs) -> None:
        super().__init__(**kwargs)
        self.at, self.rank, self.calls = at, rank, 0

    def loss(self, model: nn.Module, batch: tuple) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.at and (dist.get_rank() if dist.is_initialized() else 0) == self.rank:
            raise ValueError(f"rank {self.rank}'s own bug at loss call {self.at}")
        return super().loss(model, batch)


class SlowHashBlobTask(BlobTask):
    """BlobTask whose checkpoint hashes read slowly (a loaded filesystem): `chunk` bytes every
    $SLOW_HASH_PAUSE_S seconds (unset: as usual; not a task argument, which a resume refuses to change), so
    that a resume's hash outlasts watchdog.first_step_s while it keeps reading."""

    def __init__(self, chunk: int = 1024, **kwargs) -> None:
        import os

        super().__init__(**kwargs)
        pause_s = float(os.environ.get("SLOW_HASH_PAUSE_S", "0"))
        if pause_s > 0:
            import mgpu.state.files.digest

            real = mgpu.state.files.digest.digest_file

            def slow_digest_file(path: Path, *args, **kwargs):  # the verification every resume runs
                with open(path, "rb") as file:
                    while file.read(chunk):
                        time.sleep(pause_s)
                return real(path, *args, **kwargs)

            mgpu.state.files.digest.digest_file = slow_digest_file  # type: ignore[attr-defined]  # a test's slow disk


class KilledBlobTask(BlobTask):
    """BlobTask whose rank `rank` SIGKILLs itself at its `at`-th loss call (an OOM kill, a segfault; `at` 0: never),
    once, marked by `once_file`; without one, in every run."""

    def __init__(self, at: int = 0, rank: int = 1, once_file: str = "", **kwargs) -> None:
        super().__init__(**kwargs)
        self.at, self.rank, self.once_file, self.calls = at, rank, once_file, 0

    def loss(self, model: nn.Module, batch: tuple) -> torch.Tensor:
        import os
        import signal

        self.calls += 1
        me = dist.get_rank() if dist.is_initialized() else 0
        if self.calls == self.at and me == self.rank and not (self.once_file and os.path.exists(self.once_file)):
            if self.once_file:
                open(self.once_file, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        return super().loss(model, batch)
