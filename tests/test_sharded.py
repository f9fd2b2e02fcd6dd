"""The sharded store's logic in one process (a gloo group of one): layout, verification and fallback, refusal of
unsafe pickles, keep-K, and an asynchronous save that holds the state of its step."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn

from mgpu.state.files.removal import wait_removed
from mgpu.state.single.store import CheckpointError
from mgpu.state.files.digest import digest_file
from mgpu.record.ledger import Ledger
from mgpu.state.sharded.dcp_safe import SafeReader
from mgpu.state.sharded.checkpointer import ShardedCheckpointer
from mgpu.state.sharded.format import restore_sharded
from mgpu.state.sharded.arrivals import Arrivals, late_line
from mgpu.state.sharded.export import consolidate


@pytest.fixture
def group(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # set by torch's first optimizer otherwise
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def objects(seed: int = 0) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    return {"model": model, "optimizer": optimizer, "progress": {"step": 0}, "note": "plain"}


def step(state: dict[str, Any]) -> None:
    state["model"](torch.randn(5, 4)).square().mean().backward()
    state["optimizer"].step()
    state["optimizer"].zero_grad()


def checkpointer(tmp_path: Path, **options: Any) -> ShardedCheckpointer:
    return ShardedCheckpointer(tmp_path / "checkpoints", 0, 1, Ledger(None, None, 0), **options)


def save_steps(tmp_path: Path, steps: list[int], **options: Any) -> tuple[ShardedCheckpointer, dict[str, Any]]:
    store, state = checkpointer(tmp_path, **options), objects()
    for n in steps:
        step(state)
        state["progress"] = {"step": n}
        store.save_objects(state, n, "periodic", wait=True)
    return store, state


def test_a_save_is_one_verified_step_directory_that_loads_back(group: None, tmp_path: Path) -> None:
    store, state = save_steps(tmp_path, [1])
    path = tmp_path / "checkpoints" / "step_00000001"
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_00000001"
    meta = json.loads((path / "meta.json").read_text())
    assert meta["kind"] == "sharded" and meta["world_size"] == 1 and meta["step"] == 1
    manifest = json.loads((path / "manifest_0.json").read_text())
    assert set(manifest["files"]) == {"rank_0.pt", "common.pt", ".metadata", "__0_0.distcp"}
    for name, entry in manifest["files"].items():
        assert entry == {"bytes": (path / name).stat().st_size, "checksum": digest_file(path / name)}
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".tmp-")]
    fresh = objects(seed=1)
    loaded = checkpointer(tmp_path).find_latest()
    assert loaded is not None and loaded.step == 1
    restore_sharded(loaded, fresh, rank=0, seed=0)
    for (name, a), b in zip(state["model"].state_dict().items(), fresh["model"].state_dict().values()):
        assert torch.equal(a, b), name
    assert fresh["progress"] == {"step": 1} and fresh["note"] == "plain"
    assert fresh["optimizer"].state_dict()["state"][0]["exp_avg"].equal(state["optimizer"].state_dict()["state"][0]["exp_avg"])
    store.close()


def test_a_shard_is_digested_while_it_is_written_not_read_back(group: None, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    import mgpu.state.sharded.checkpointer
    import mgpu.state.sharded.format

    read_back: list[str] = []
    real_sha, real_digest = mgpu.state.sharded.format.sha256_file, mgpu.state.sharded.format.digest_file
    # Wherever the save looks them up: the checkpointer (the manifests' sha256) and the layout (each file's line).
    for module in (mgpu.state.sharded.checkpointer, mgpu.state.sharded.format):
        monkeypatch.setattr(module, "sha256_file", lambda path: read_back.append(path.name) or real_sha(path))
        if hasattr(module, "digest_file"):
            monkeypatch.setattr(module, "digest_file",
                                lambda path, *a: read_back.append(path.name) or real_digest(path, *a))
    save_steps(tmp_path, [1])[0].close()
    assert not [name for name in read_back if name.endswith(".distcp")], read_back  # only small files: .metadata, manifests
    path = tmp_path / "checkpoints" / "step_00000001"
    manifest = json.loads((path / "manifest_0.json").read_text())
    assert manifest["files"]["__0_0.distcp"]["checksum"] == real_digest(path / "__0_0.distcp")


def _records(path: Path) -> list[tuple[Any, bytes]]:
    """(DCP's index, the torch.save'd bytes) of every tensor record in the shards of checkpoint `path`."""
    storage = SafeReader(path).read_metadata().storage_data
    return [(index, (path / info.relative_path).read_bytes()[info.offset:info.offset + info.length])
            for index, info in storage.items()]


def test_a_shards_tensors_carry_no_zip_crc32_and_a_changed_byte_is_still_caught(group: None, tmp_path: Path) -> None:
    import io
    import zipfile

    save_steps(tmp_path, [1, 2])[0].close()
    path = tmp_path / "checkpoints" / "step_00000002"
    records = _records(path)
    assert records
    for _, data in records:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            assert {info.CRC for info in archive.infolist()} == {0}  # mgpu's manifest checksum covers them
    # A byte of a tensor's data changed: torch.load reads it without complaint, so the manifest must catch it.
    index, data = max(records, key=lambda record: len(record[1]))
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        entry = next(info for info in archive.infolist() if "/data/" in info.filename)
    header = entry.header_offset  # the local header's own name and extra (alignment) lengths, then the data
    name_length, extra_length = (int.from_bytes(data[header + at:header + at + 2], "little") for at in (26, 28))
    start = header + 30 + name_length + extra_length + entry.file_size // 2
    info = SafeReader(path).read_metadata().storage_data[index]
    target = path / info.relative_path
    whole = bytearray(target.read_bytes())
    whole[info.offset + start] ^= 0x01
    target.write_bytes(bytes(whole))
    altered = bytes(whole[info.offset:info.offset + info.length])
    assert not torch.equal(torch.load(io.BytesIO(altered), weights_only=True),
                           torch.load(io.BytesIO(data), weights_only=True))
    loaded = checkpointer(tmp_path).find_latest()
    assert loaded is not None and loaded.step == 1
    assert loaded.skipped[0][0].name == "step_00000002" and info.relative_path in loaded.skipped[0][1]


def test_a_checkpoint_whose_manifest_records_sha256s_still_verifies(group: None, tmp_path: Path) -> None:
    """As saved before mgpu.state.files.digest: a whole-file sha256 per file."""
    save_steps(tmp_path, [1])[0].close()
    path = tmp_path / "checkpoints" / "step_00000001"
    manifest = json.loads((path / "manifest_0.json").read_text())
    for name, entry in manifest["files"].items():
        manifest["files"][name] = {"bytes": entry["bytes"], "sha256": hashlib.sha256((path / name).read_bytes()).hexdigest()}
    (path / "manifest_0.json").write_text(json.dumps(manifest))
    meta = json.loads((path / "meta.json").read_text())
    meta["manifests"]["0"] = hashlib.sha256((path / "manifest_0.json").read_bytes()).hexdigest()
    (path / "meta.json").write_text(json.dumps(meta))
    loaded = checkpointer(tmp_path).find_latest()
    assert loaded is not None and loaded.step == 1 and loaded.skipped == ()


@pytest.mark.parametrize("damage", ["flip __0_0.distcp", "truncate __0_0.distcp", "flip .metadata", "flip common.pt",
                                    "flip rank_0.pt", "flip manifest_0.json", "delete __0_0.distcp"])
def test_a_damaged_file_falls_back_to_the_previous_checkpoint(damage: str, group: None, tmp_path: Path) -> None:
    save_steps(tmp_path, [1, 2])[0].close()
    how, name = damage.split()
    target = tmp_path / "checkpoints" / "step_00000002" / name
    data = bytearray(target.read_bytes())
    if how == "flip":
        data[len(data) // 2] ^= 0xFF
        target.write_bytes(bytes(data))
    elif how == "truncate":
        target.write_bytes(bytes(data[:-10]))
    else:
        target.unlink()
    loaded = checkpointer(tmp_path).find_latest()
    assert loaded is not None and loaded.step == 1
    assert len(loaded.skipped) == 1 and loaded.skipped[0][0].name == "step_00000002"
    assert name in loaded.skipped[0][1] or "manifest_0.json" in loaded.skipped[0][1]


def test_no_valid_checkpoint_is_one_line(group: None, tmp_path: Path) -> None:
    save_steps(tmp_path, [1])[0].close()
    (tmp_path / "checkpoints" / "step_00000001" / "common.pt").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="no valid checkpoint .* 1 rejected"):
        checkpointer(tmp_path).find_latest()


class Boom:
    def __reduce__(self) -> Any:
        return (os.system, ("echo pwned > /dev/null",))


def test_a_metadata_pickle_with_a_foreign_global_is_refused(group: None, tmp_path: Path) -> None:
    save_steps(tmp_path, [1, 2])[0].close()
    path = tmp_path / "checkpoints" / "step_00000002"
    with pytest.raises(pickle.UnpicklingError, match="posix.system|os.system"):
        (path / ".metadata").write_bytes(pickle.dumps(Boom()))
        SafeReader(path).read_metadata()
    # Even with every hash made to match (a forged checkpoint), it is not unpickled: the previous one loads.
    manifest = json.loads((path / "manifest_0.json").read_text())
    manifest["files"][".metadata"] = {"bytes": (path / ".metadata").stat().st_size,
                                      "checksum": digest_file(path / ".metadata")}
    (path / "manifest_0.json").write_text(json.dumps(manifest))
    meta = json.loads((path / "meta.json").read_text())
    meta["manifests"]["0"] = hashlib.sha256((path / "manifest_0.json").read_bytes()).hexdigest()
    (path / "meta.json").write_text(json.dumps(meta))
    loaded = checkpointer(tmp_path).find_latest()
    assert loaded is not None and loaded.step == 1
    assert "posix.system is not allowed" in loaded.skipped[0][1] or "os.system" in loaded.skipped[0][1]
    with pytest.raises(CheckpointError, match="not allowed"):
        consolidate(path)


def test_a_value_a_resume_could_not_load_fails_the_first_save(group: None, tmp_path: Path) -> None:
    store, state = checkpointer(tmp_path), objects()
    state["custom"] = Boom()
    with pytest.raises(CheckpointError, match="state.custom holds a Boom"):
        store.save_objects(state, 1, "periodic", wait=True)
    assert not (tmp_path / "checkpoints" / "latest").exists()
    store.close()


def test_keep_last_and_best(group: None, tmp_path: Path) -> None:
    store, state = checkpointer(tmp_path, keep_last=2), objects()
    for n in range(1, 6):
        step(state)
        store.save_objects(state, n, "periodic", wait=True, is_best=n == 2)
    store.close()
    assert wait_removed(30)  # the pruned steps are deleted in the background (mgpu.state.files.removal)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["best", "latest", "step_00000002", "step_00000004", "step_00000005"]


def test_an_async_save_holds_its_steps_state_while_training_goes_on(group: None, tmp_path: Path) -> None:
    store, state = checkpointer(tmp_path, async_save=True), objects()
    step(state)
    before = {k: v.clone() for k, v in state["model"].state_dict().items()}
    store.save_objects(state, 1, "periodic")  # in flight
    for _ in range(3):
        step(state)  # the first forward waits for the host copy, no longer
    assert store.settle() is None
    store.close()
    saved = consolidate(tmp_path / "checkpoints" / "step_00000001")
    for key, value in before.items():
        assert torch.equal(saved["model"][key], value), key
    assert not torch.equal(state["model"].state_dict()["0.weight"], before["0.weight"])


def test_a_sharded_run_exports_and_loads_for_inference(group: None, tmp_path: Path) -> None:
    import mgpu
    from mgpu.state.sharded.export import main

    store, state = save_steps(tmp_path, [1, 2])
    store.close()
    weights = mgpu.load_model(tmp_path, which="latest")
    assert set(weights) == set(state["model"].state_dict())
    fresh = mgpu.load_model(tmp_path, objects(seed=3)["model"], which="latest")
    for key, value in state["model"].state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value), key
    assert main([str(tmp_path), str(tmp_path / "out.pt")]) == 0
    exported = torch.load(tmp_path / "out.pt", weights_only=True)
    assert exported["progress"] == {"step": 2} and torch.equal(exported["model"]["0.weight"], weights["0.weight"])
    assert main([str(tmp_path / "nowhere"), str(tmp_path / "x.pt")]) == 2 and not (tmp_path / "x.pt").exists()


def test_a_sharded_saves_ledger_entry_says_how_long_it_held_the_loop(group: None, tmp_path: Path) -> None:
    # Goodput's checkpoint time sums the ledger's blocked_s: a sharded save had none, so it counted as 0 s.
    from mgpu.record.ledger import read_ledger

    ledger = tmp_path / "ledger.jsonl"
    store = ShardedCheckpointer(tmp_path / "checkpoints", 0, 1, Ledger(ledger, "", 0), async_save=True)
    state = objects()
    step(state)
    store.save_objects(state, 1, "periodic")  # in the background: held the loop for its staging
    assert store.settle() is None
    step(state)
    store.save_objects(state, 2, "stop", wait=True)  # the stop's: held the loop for all of it
    store.close()
    saved = [e for e in read_ledger(ledger) if e["event"] == "checkpoint_saved"]
    assert [e["step"] for e in saved] == [1, 2]
    assert all(isinstance(e.get("blocked_s"), float) and e["blocked_s"] > 0 for e in saved), saved
    assert saved[1]["blocked_s"] >= saved[1]["seconds"], saved[1]


@pytest.mark.parametrize("reuse", [True, False], ids=["one-stager", "a-stager-per-save"])
def test_async_saves_stage_through_one_stager_without_cuda_and_each_save_holds_its_step(
        reuse: bool, group: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # torch's DefaultStager, reused, fails every save after its first on CUDA tensors (KeyError: <class 'type'>,
    # seen on an H100 with torch 2.11; a CPU tensor does not show it): where CUDA is, each save gets a new one, the
    # old one closed (REUSE_STAGER off here: this machine has no CUDA). Without it, one stager keeps its host
    # copy's buffers, and the next save copies into them: each checkpoint must still hold its own step.
    monkeypatch.setattr("mgpu.state.sharded.checkpointer.REUSE_STAGER", reuse)
    store, state = checkpointer(tmp_path, keep_last=3, async_save=True), objects()
    stagers, weights = [], []
    for at in (1, 2, 3):
        step(state)
        weights.append({k: v.clone() for k, v in state["model"].state_dict().items()})
        store.save_objects(state, at, "periodic")
        stagers.append(store._stager)
        assert store.settle() is None
    store.close()
    assert all(stager is not None for stager in stagers)
    assert len({id(stager) for stager in stagers}) == (1 if reuse else 3)
    for at, expected in zip((1, 2, 3), weights):
        saved = consolidate(tmp_path / "checkpoints" / f"step_{at:08d}")
        assert all(torch.equal(saved["model"][k], v) for k, v in expected.items()), at


class _CudaMachine:
    """torch as DCP's file writer sees it on a GPU node: CUDA available (no GPU here: this is the mock)."""

    def __getattr__(self, name: str) -> Any:
        if name == "cuda":
            return type("cuda", (), {"is_available": staticmethod(lambda: True)})
        return getattr(torch, name)


def test_a_staged_save_is_written_without_syncing_the_trainings_cuda_stream(
        group: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # On a CUDA machine DCP's single-threaded writer loads tensors through _OverlappingCpuLoader, which
    # synchronizes the writing thread's CUDA stream every 10 MB even for host tensors: a background sharded save
    # of 1.5 GB waited ~150 times for the training loop's queued kernels (3.5 s to durable against 0.8-1.2 s for
    # a single file, on an H200). An asynchronous save's state is already staged: it takes DCP's plain loader.
    from torch.distributed.checkpoint import filesystem

    class CopyAhead:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise AssertionError("DCP's copy-ahead loader (a CUDA stream sync every 10 MB) for a staged state")

    monkeypatch.setattr(filesystem, "torch", _CudaMachine())
    monkeypatch.setattr(filesystem, "_OverlappingCpuLoader", CopyAhead)
    store, state = checkpointer(tmp_path, async_save=True), objects()
    step(state)
    store.save_objects(state, 1, "periodic")
    assert store.settle() is None
    store.close()
    saved = consolidate(tmp_path / "checkpoints" / "step_00000001")
    assert torch.equal(saved["model"]["0.weight"], state["model"].state_dict()["0.weight"])


def test_a_world_of_one_saves_on_a_gloo_group_of_its_own(group: None, tmp_path: Path) -> None:
    # dcp.async_save needs a CPU backend in its group: one GPU rank's default group is NCCL alone ("A CPU backend
    # must be enabled for async save", seen on an H100), so the save's own gloo group exists on a world of one too.
    store = checkpointer(tmp_path)
    assert store.group is not None and dist.get_backend(store.group) == "gloo"
    store.close()


def test_the_arrivals_name_the_ranks_that_have_not_written_their_shard() -> None:
    """Four ranks of one save on one store: ranks 0 and 2 wrote their shard, 1 and 3 are late; a mark is
    removed once its save is done, and another save's marks are its own."""
    store = dist.HashStore()
    arrivals = [Arrivals(store, ".tmp-step_00000002-1-ab", rank, 4) for rank in range(4)]
    assert arrivals[0].late() == [0, 1, 2, 3]
    arrivals[0].mark()
    arrivals[2].mark()
    assert arrivals[0].late() == [1, 3]
    assert Arrivals(store, ".tmp-step_00000003-1-cd", 0, 4).late() == [0, 1, 2, 3]
    arrivals[2].clear()
    assert arrivals[0].late() == [1, 2, 3]
    arrivals[2].clear()  # twice: nothing to remove, no error


@pytest.mark.parametrize("late, rank, wait_s, line", [
    ([1], 0, 3.0, "rank 1 had not written its shard when rank 0 stopped waiting (after 3 s)"),
    ([1, 3], 2, 300.0, "ranks 1, 3 had not written their shard when rank 2 stopped waiting (after 300 s)"),
    ([0, 5], 5, None, "rank 0 had not written its shard when rank 5 stopped waiting"),  # itself: not named
    ([4], 4, 3.0, ""),  # only itself late (it reached the wait after the others gave up): nobody to name
    ([], 0, 3.0, ""),
    (list(range(1, 20)), 0, 3.0, "ranks 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16 and 3 more had not"),
])
def test_late_line(late: list[int], rank: int, wait_s: float | None, line: str) -> None:
    assert late_line(late, rank, wait_s).startswith(line) and bool(line) == bool(late_line(late, rank, wait_s))


def test_a_save_group_waits_as_long_as_it_is_told(group: None, tmp_path: Path) -> None:
    """`wait_s` is the save's own group's timeout (torch's default, 30 minutes, without it)."""
    from datetime import timedelta

    bounded, default = checkpointer(tmp_path, wait_s=42.0), checkpointer(tmp_path / "d")
    assert bounded.group is not None and default.group is not None
    timeout = lambda g: g._get_backend(torch.device("cpu")).options._timeout  # noqa: E731
    assert timeout(bounded.group) == timedelta(seconds=42)
    assert timeout(default.group) == timedelta(minutes=30)


def ema_objects() -> dict[str, Any]:
    """Six EMA-like layers (changed in place, without a forward of their own), all 1.0, beside a trained model."""
    ema = nn.Sequential(*(nn.Linear(256, 256) for _ in range(6)))
    with torch.no_grad():
        for parameter in ema.parameters():
            parameter.fill_(1.0)
    return {**objects(), "ema": ema}


def set_in_place(module: nn.Module, value: float) -> None:
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.data.fill_(value)


@pytest.mark.parametrize("form", ["sharded", "single"])
def test_nothing_the_loop_does_after_save_returns_changes_what_is_written(form: str, group: None, tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """An EMA updated in place right after save() returns (no forward, no optimizer step of its own): the
    checkpoint holds the EMA of the save's step. The asynchronous sharded save copied it in a thread that only
    the next forward or optimizer step waited for: [1.0, 2.0, 2.0, 2.0, 2.0, 2.0] was written (a race; a host
    copy made slow here, as a large state's is, loses it every time)."""
    from torch.distributed.checkpoint.staging import DefaultStager

    copy = DefaultStager._stage
    monkeypatch.setattr(DefaultStager, "_stage", lambda self, *a, **k: (time.sleep(0.5), copy(self, *a, **k))[1])
    state = ema_objects()
    if form == "sharded":
        store = checkpointer(tmp_path, async_save=True)
        store.save_objects(state, 1, "periodic")
        set_in_place(state["ema"], 2.0)
        assert store.settle() is None
        store.close()
        saved = consolidate(tmp_path / "checkpoints" / "step_00000001")["ema"]
    else:
        from mgpu.state.checkpointer import Checkpointer
        from mgpu.record.rundir import RunDir
        from mgpu.state.train_state import gather_state

        single = Checkpointer(RunDir(tmp_path), 0, 1, Ledger(None, None, 0), async_save=True)
        single.save(lambda: gather_state(state, None), 1, "periodic")
        set_in_place(state["ema"], 2.0)
        single.close()
        loaded = single.find_latest()
        assert loaded is not None and loaded.step == 1
        saved = loaded.state["ema"]
    values = [float(saved[f"{layer}.weight"].unique().item()) for layer in range(6)]
    assert values == [1.0] * 6, values
    assert all(torch.equal(saved[f"{layer}.bias"], torch.ones(256)) for layer in range(6))


# ---------------------------------------------------------------------------------------------- the export command
@pytest.fixture(scope="module")
def exported_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run directory with two sharded checkpoints (steps 1, 2) and a single-file run beside it."""
    from mgpu.state.checkpointer import Checkpointer
    from mgpu.record.rundir import RunDir
    from mgpu.state.train_state import gather_state

    root = tmp_path_factory.mktemp("exported")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        save_steps(root / "run", [1, 2])[0].close()
        single = Checkpointer(RunDir(root / "single"), 0, 1, Ledger(None, None, 0), async_save=False)
        single.save(lambda: gather_state(objects(), None), 1, "periodic")
        single.close()
    finally:
        dist.destroy_process_group()
    return root


def forge_metadata(step: Path, content: bytes) -> None:
    """`.metadata` replaced by `content`, every hash made to match (a forged or rewritten checkpoint)."""
    (step / ".metadata").write_bytes(content)
    manifest = json.loads((step / "manifest_0.json").read_text())
    manifest["files"][".metadata"] = {"bytes": len(content), "sha256": hashlib.sha256(content).hexdigest()}
    (step / "manifest_0.json").write_text(json.dumps(manifest))
    meta = json.loads((step / "meta.json").read_text())
    meta["manifests"]["0"] = hashlib.sha256((step / "manifest_0.json").read_bytes()).hexdigest()
    (step / "meta.json").write_text(json.dumps(meta))


STEP2 = "run/checkpoints/step_00000002"
EXPORT_REFUSALS = [  # (id, argv with {t} for the case's directory, a setup, the substring of the one line)
    ("out over a checkpoint's common.pt", ["{t}/run", f"{{t}}/{STEP2}/common.pt"], None, "exists: an export never"),
    ("out inside a step directory", ["{t}/run", f"{{t}}/{STEP2}/model.pt"], None,
     "is inside the checkpoint directory"),
    ("out inside the checkpoints directory", ["{t}/run", "{t}/run/checkpoints/model.pt"], None,
     "is inside the checkpoint directory"),
    ("out over an existing file", ["{t}/run", "{t}/taken.pt"], lambda t: (t / "taken.pt").write_text("mine"),
     "taken.pt exists"),
    ("out a directory", ["{t}/run", "{t}/outdir"], lambda t: (t / "outdir").mkdir(), "is a directory"),
    ("out in a missing directory", ["{t}/run", "{t}/nowhere/model.pt"], None, "does not exist"),
    ("out on a read-only filesystem", ["{t}/run", "{t}/ro/model.pt"], "read-only", "is not writable"),
    ("a single-file run", ["{t}/single", "{t}/model.pt"], None, "checkpoints are single files"),
    ("a single-file step directory", ["{t}/single/checkpoints/step_00000001", "{t}/model.pt"], None,
     "is a single-file checkpoint"),
    ("a refused .metadata", [f"{{t}}/{STEP2}", "{t}/model.pt"],
     lambda t: forge_metadata(t / STEP2, pickle.dumps(Boom())), "does not load safely: posix.system"),
    ("a corrupt .metadata", [f"{{t}}/{STEP2}", "{t}/model.pt"],
     lambda t: forge_metadata(t / STEP2, b"\x80\x04not a pickle at all"), "does not load safely"),
    ("a damaged .metadata", [f"{{t}}/{STEP2}", "{t}/model.pt"],
     lambda t: (t / STEP2 / ".metadata").write_bytes(b"x"), "is invalid"),
    ("every checkpoint of the run refused", ["{t}/run", "{t}/model.pt"],
     lambda t: [forge_metadata(p, b"x") for p in (t / "run/checkpoints").glob("step_*")], "no valid checkpoint"),
    ("a step directory without _N", ["{t}/copied", "{t}/model.pt"],
     lambda t: shutil.copytree(t / STEP2, t / "copied"), "is not a checkpoint's step directory"),
    ("no such run", ["{t}/nowhere", "{t}/model.pt"], None, "no such file or directory"),
    ("no checkpoint there", ["{t}", "{t}/model.pt"], None, "no sharded checkpoint there"),
    ("one argument", ["{t}/run"], None, "the following arguments are required: out"),
]


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.lstat().st_size, p.lstat().st_mtime_ns) for p in root.rglob("*")}


@pytest.mark.parametrize("argv, setup, expect", [pytest.param(a, s, e, id=i) for i, a, s, e in EXPORT_REFUSALS])
def test_the_export_refuses_a_bad_argument_in_one_line_and_writes_nothing(
        argv: list[str], setup: Any, expect: str, exported_run: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    import shutil as copying

    from mgpu.state.sharded.export import main
    from tests.test_bad_input import MountUnavailable, _mount

    copying.copytree(exported_run, tmp_path, dirs_exist_ok=True)
    mounted = None
    try:
        if setup == "read-only":
            (tmp_path / "ro").mkdir()
            try:
                _mount(tmp_path / "ro", "-o", "size=1m,ro")
            except MountUnavailable as unavailable:
                pytest.skip(str(unavailable))
            mounted = tmp_path / "ro"
        elif setup is not None:
            setup(tmp_path)
        before = snapshot(tmp_path)
        code = main([arg.format(t=tmp_path) for arg in argv])
        out, err = capsys.readouterr()
        assert code == 2, (out, err)
        assert out == "" and len(err.splitlines()) == 1 and err.startswith("mgpu.state.sharded.export: error: "), err
        assert expect in err, err
        assert snapshot(tmp_path) == before
    finally:
        if mounted is not None:
            subprocess.run(["umount", "-l", str(mounted)], capture_output=True)


@pytest.mark.multiprocess
def test_the_export_command_is_one_line_as_a_process(exported_run: Path) -> None:
    """`python -m mgpu.state.sharded.export` itself: a refusal on stderr in one line, no traceback, exit 2 (an export
    that works: test_a_sharded_run_exports_and_loads_for_inference)."""
    from tests.conftest import PYTHON, ROOT, base_env

    common = exported_run / STEP2 / "common.pt"
    before = common.read_bytes()
    refused = subprocess.run([PYTHON, "-m", "mgpu.state.sharded.export", str(exported_run / "run"), str(common)],
                             cwd=ROOT, env=base_env(), capture_output=True, text=True, timeout=120)
    assert (refused.returncode, refused.stdout) == (2, ""), refused
    assert refused.stderr.startswith("mgpu.state.sharded.export: error: ") and len(refused.stderr.splitlines()) == 1
    assert "exists: an export never overwrites" in refused.stderr and common.read_bytes() == before


def test_load_model_reads_the_models_tensors_alone(group: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                   ) -> None:
    """mgpu.load_model on a sharded run asks DCP for the model's entries only: no optimizer tensor is read
    (AdamW's state is 2x the model: every one was read into host memory to hand back one module)."""
    import mgpu

    store, state = save_steps(tmp_path, [1])
    store.close()
    read: list[str] = []
    real_read = SafeReader.read_data

    def spying(self: SafeReader, plan: Any, planner: Any) -> Any:
        read.extend(item.storage_index.fqn for item in plan.items)
        return real_read(self, plan, planner)

    monkeypatch.setattr(SafeReader, "read_data", spying)
    weights = mgpu.load_model(tmp_path, which="latest")
    assert set(weights) == set(state["model"].state_dict())
    for key, value in state["model"].state_dict().items():
        assert torch.equal(weights[key], value), key
    assert read and all(fqn.startswith("model.model.") for fqn in read), read
    with pytest.raises(CheckpointError, match=r"holds no module named 'teacher' \(it has \['model'\]\)"):
        from mgpu.state.sharded.export import consolidated_model

        consolidated_model(tmp_path / "checkpoints", "latest", name="teacher")


def test_a_failed_save_leaves_its_group_behind(group: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A save that failed (here its write: EIO) is never followed by a wait on its group: the next save makes a
    fresh one (a group that could not be formed fails that save in one line, the one after tries again); saves
    that succeed keep theirs."""
    from torch.distributed.checkpoint import FileSystemWriter

    store, state = checkpointer(tmp_path), objects()
    store.save_objects(state, 1, "periodic", wait=True)
    first = store.group
    store.save_objects(state, 2, "periodic", wait=True)
    assert store.group is first  # nothing failed: no new group
    real_write = FileSystemWriter.write_data
    monkeypatch.setattr(FileSystemWriter, "write_data", lambda *a: (_ for _ in ()).throw(OSError(5, "I/O error")))
    with pytest.raises(CheckpointError, match="step 3 not written"):
        store.save_objects(state, 3, "periodic", wait=True)
    monkeypatch.setattr(FileSystemWriter, "write_data", real_write)
    monkeypatch.setattr(dist, "new_group", lambda **_: (_ for _ in ()).throw(RuntimeError("Connection refused")))
    with pytest.raises(CheckpointError, match="step 4 not written: its ranks could not form the save's group: "
                                              "Connection refused"):
        store.save_objects(state, 4, "periodic", wait=True)
    monkeypatch.undo()
    assert store.save_objects(state, 5, "periodic", wait=True) is not None
    assert store.group is not None and store.group is not first
    store.close()
    assert [p.name for p in sorted((tmp_path / "checkpoints").glob("step_*"))] == ["step_00000002", "step_00000005"]


def test_each_shard_file_is_fsynced_once_after_it_is_closed(group: None, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    # Each fsync of a file is a journal commit: DCP's, before its O_DIRECT stream had written its last block,
    # and a second after the close cost a 1 GiB save 15 ms of its 360.
    import mgpu.state.files.direct_io

    synced: list[str] = []
    open_files: set[str] = set()
    real_fsync, real_close = os.fsync, mgpu.state.files.direct_io.DirectFile.close

    def fsync(fd: int) -> None:
        name = os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))
        assert name not in open_files, f"{name} fsync'd while still being written"
        synced.append(name)
        real_fsync(fd)

    def close(self: Any) -> None:
        real_close(self)
        open_files.discard(self.name)

    real_init = mgpu.state.files.direct_io.DirectFile.__init__

    def init(self: Any, fd: int, *args: Any, **kwargs: Any) -> None:
        real_init(self, fd, *args, **kwargs)
        self.name = os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))
        open_files.add(self.name)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(mgpu.state.files.direct_io.DirectFile, "__init__", init)
    monkeypatch.setattr(mgpu.state.files.direct_io.DirectFile, "close", close)
    save_steps(tmp_path, [1])[0].close()
    assert synced.count("__0_0.distcp") == 1 and synced.count(".metadata") == 1, synced
    # Issue 46: the rank's own files were fsync'd twice each (written durably, then again with the shards).
    assert synced.count("rank_0.pt") == 1 and synced.count("common.pt") == 1, synced


def test_a_ranks_files_are_fsynced_at_once_not_one_after_another(group: None, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # Issue 46: each fsync waited for a journal commit of its own, one file after another (10-60 ms of a 1 GiB
    # save); all at once, the filesystem commits them together. Each fsync here takes 0.2 s: in turn, 0.8 s.
    import threading

    active, most, lock, real_fsync = [0], [0], threading.Lock(), os.fsync

    def slow_fsync(fd: int) -> None:
        name = os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))
        if name.endswith((".distcp", ".pt", ".metadata")):
            with lock:
                active[0] += 1
                most[0] = max(most[0], active[0])
            time.sleep(0.2)
            with lock:
                active[0] -= 1
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", slow_fsync)
    save_steps(tmp_path, [1])[0].close()
    assert most[0] == 4, most  # rank_0.pt, common.pt, .metadata and the shard, together


def _resumption(tmp_path: Path, store: ShardedCheckpointer) -> Any:
    from mgpu.record.rundir import RunDir
    from mgpu.state.resumption import Resumption

    return Resumption(RunDir(tmp_path), 0, 1, 0, Ledger(None, None, 0), lambda: store)


def test_a_sessions_resume_reads_each_shard_file_once(group: None, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # Issue 46: a sharded resume hashed every shard file in a pass of its own, then DCP read it again. The session's
    # resume (mgpu.state.resumption) now checks each chunk as the load reads it: no file-level pass, one digest each.
    import mgpu.state.files.digest
    import mgpu.state.sharded.format

    store, state = save_steps(tmp_path, [1, 2])
    store.close()
    whole_file: list[str] = []
    real_digest_file = mgpu.state.sharded.format.digest_file
    monkeypatch.setattr(mgpu.state.files.digest, "digest_file",
                        lambda path, *a, **k: whole_file.append(Path(path).name) or real_digest_file(path, *a, **k))
    digested: dict[int, int] = {}
    real_update = mgpu.state.files.digest.ChunkDigest.update

    def counting_update(self: Any, data: Any) -> None:
        digested[id(self)] = digested.get(id(self), 0) + memoryview(data).nbytes
        real_update(self, data)

    monkeypatch.setattr(mgpu.state.files.digest.ChunkDigest, "update", counting_update)
    fresh = objects(seed=1)
    loaded = _resumption(tmp_path, checkpointer(tmp_path)).restore(fresh, set(), None)
    assert loaded.step == 2 and loaded.skipped == ()
    for (name, a), b in zip(state["model"].state_dict().items(), fresh["model"].state_dict().values()):
        assert torch.equal(a, b), name
    shard = tmp_path / "checkpoints" / "step_00000002" / "__0_0.distcp"
    assert not [name for name in whole_file if name.endswith(".distcp")], whole_file
    assert sum(digested.values()) - sum(n for n in digested.values() if n != shard.stat().st_size) \
        == shard.stat().st_size  # the shard's one chunk, digested once, from the pages the load read


def test_a_shard_damaged_under_the_load_falls_back_to_the_previous_checkpoint(group: None, tmp_path: Path) -> None:
    # The sizes and the small files verify up front; a flipped byte inside a tensor of the shard (which torch.load
    # would read without complaint) is found by the load's chunk checks, and the previous checkpoint restored.
    store, state = save_steps(tmp_path, [1])
    first = {key: value.clone() for key, value in state["model"].state_dict().items()}
    step(state)
    state["progress"] = {"step": 2}
    store.save_objects(state, 2, "periodic", wait=True)
    store.close()
    shard = tmp_path / "checkpoints" / "step_00000002" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    fresh = objects(seed=1)
    loaded = _resumption(tmp_path, checkpointer(tmp_path)).restore(fresh, set(), None)
    assert loaded.step == 1 and fresh["progress"] == {"step": 1}
    assert [path.name for path, _ in loaded.skipped] == ["step_00000002"]
    assert "__0_0.distcp does not match its crc32 checksum from byte 0 on" in loaded.skipped[0][1]
    for key, value in first.items():
        assert torch.equal(fresh["model"].state_dict()[key], value), key


FIRST_SAVE = """
import sys, tempfile, torch, torch.distributed as dist
from pathlib import Path
from torch import nn
from mgpu.record.ledger import Ledger
from mgpu.state.sharded.checkpointer import ShardedCheckpointer
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
saver = ShardedCheckpointer(Path(tempfile.mkdtemp()) / "checkpoints", 0, 1, Ledger(None, None, 0))
before = set(sys.modules)
saver.save_objects({"model": nn.Linear(4, 2)}, 1, "stop", wait=True)
print(sorted(name for name in set(sys.modules) - before if name.startswith("torch._dynamo")))
saver.close()
"""


@pytest.mark.multiprocess
def test_a_processs_first_sharded_save_imports_nothing_heavy(tmp_path: Path) -> None:
    # Issue 46: DCP's get_state_dict touches torch._dynamo, whose import (0.4-0.6 s here) fell inside the first save of
    # a process (the stop's, in a job that had saved nothing yet): half the sharded save's rate in a fresh Session.
    from tests.conftest import PYTHON, ROOT, base_env

    result = subprocess.run([PYTHON, "-c", FIRST_SAVE], cwd=ROOT, env=base_env(), capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines()[-1] == "[]", result.stdout[-2000:]
