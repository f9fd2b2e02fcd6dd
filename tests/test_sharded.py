"""The sharded store's logic in one process (a gloo group of one): layout, verification and fallback, refusal of
unsafe pickles, keep-K, and an asynchronous save that holds the state of its step."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn

from mgpu.checkpoint import CheckpointError
from mgpu.digest import digest_file
from mgpu.ledger import Ledger
from mgpu.sharded import SafeReader, ShardedCheckpointer, restore_sharded
from mgpu.shard_arrivals import Arrivals, late_line
from mgpu.sharded_export import consolidate


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
    import mgpu.sharded

    read_back: list[str] = []
    real_sha, real_digest = mgpu.sharded._sha256, mgpu.sharded.digest_file
    monkeypatch.setattr(mgpu.sharded, "_sha256", lambda path: read_back.append(path.name) or real_sha(path))
    monkeypatch.setattr(mgpu.sharded, "digest_file", lambda path, *a: read_back.append(path.name) or real_digest(path, *a))
    save_steps(tmp_path, [1])[0].close()
    assert not [name for name in read_back if name.endswith(".distcp")], read_back  # only small files: .metadata, manifests
    path = tmp_path / "checkpoints" / "step_00000001"
    manifest = json.loads((path / "manifest_0.json").read_text())
    assert manifest["files"]["__0_0.distcp"]["checksum"] == real_digest(path / "__0_0.distcp")


def test_a_checkpoint_whose_manifest_records_sha256s_still_verifies(group: None, tmp_path: Path) -> None:
    """As saved before mgpu.digest: a whole-file sha256 per file."""
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
    from mgpu.sharded_export import main

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


def test_every_async_save_stages_through_a_stager_of_its_own(group: None, tmp_path: Path) -> None:
    # torch's DefaultStager, reused, fails every save after its first on CUDA tensors (KeyError: <class 'type'>,
    # seen on an H100 with torch 2.11; a CPU tensor does not show it): each save gets a new one, the old one closed.
    store, state = checkpointer(tmp_path, async_save=True), objects()
    stagers = []
    for at in (1, 2, 3):
        step(state)
        store.save_objects(state, at, "periodic")
        stagers.append(store._stager)
        assert store.settle() is None
    store.close()
    assert len({id(stager) for stager in stagers}) == 3 and all(stager is not None for stager in stagers)
    assert [p.name for p in sorted((tmp_path / "checkpoints").glob("step_*"))][-2:] == ["step_00000002", "step_00000003"]


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
