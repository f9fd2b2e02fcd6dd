"""The weights' fingerprint (mgpu.parallel.fsdp.weights_fingerprint): the same for the same weights whether they are whole
or sharded by FSDP2 over 2 real gloo ranks (uneven shards included), computed without an all-gather, and it
changes with any bit of any weight."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch import nn

from mgpu.parallel.fsdp import FINGERPRINT_PREFIX, weights_fingerprint


def _model() -> nn.Module:
    torch.manual_seed(0)
    # 5 output rows over 2 ranks: 3 and 2; a 1-row layer: one rank holds nothing of it; a bias of 1.
    return nn.Sequential(nn.Linear(7, 5), nn.Linear(5, 1), nn.Embedding(3, 4))


def _rank(out: str) -> None:
    """One rank (RANK, WORLD_SIZE, MASTER_* from the environment: tests.conftest.start_ranks)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from mgpu.parallel.fsdp import shard

    dist.init_process_group("gloo")
    try:
        model = shard(_model(), torch.device("cpu"))
        assert any(isinstance(p, DTensor) for p in model.parameters())

        def no_gather(self: DTensor, *args: object, **kwargs: object) -> torch.Tensor:
            raise AssertionError("the fingerprint all-gathered a weight")

        DTensor.full_tensor = no_gather  # type: ignore[method-assign]
        Path(out, f"rank{dist.get_rank()}").write_text(weights_fingerprint(model))
    finally:
        dist.destroy_process_group()
    # Not the interpreter's finalization: the device mesh keeps the gloo group alive past destroy_process_group,
    # and torch 2.13's gloo runloop thread can drop the all-reduce's last tensor reference while the interpreter
    # finalizes; CPython then ends that C++ thread (pthread_exit), and libstdc++ aborts ("terminate called
    # without an active exception", rank exit -6 in 2 of 5 runs here; gdb: pt_gloo_runloop in __do_cancel).
    # (jobs/train.py's ranks never finalize: they leave by exit_process, os._exit after the atexit handlers.)
    os._exit(0)


@pytest.mark.multiprocess
def test_a_sharded_model_has_the_whole_models_fingerprint_without_an_all_gather(tmp_path: Path) -> None:
    from tests.conftest import start_ranks, wait_ranks

    results = wait_ranks(start_ranks(["-c", f"from tests.test_fingerprint import _rank; _rank({str(tmp_path)!r})"], 2))
    assert [code for code, _ in results] == [0, 0], results
    whole = weights_fingerprint(_model())
    assert (tmp_path / "rank0").read_text() == (tmp_path / "rank1").read_text() == whole


def test_any_bit_of_any_weight_changes_it_and_equal_weights_give_equal_ones() -> None:
    model = _model()
    before = weights_fingerprint(model)
    assert before.startswith(FINGERPRINT_PREFIX) and before == weights_fingerprint(_model())
    with torch.no_grad():
        weight = model[0].weight
        bits = weight.view(torch.int32)
        bits[2, 3] ^= 1  # the lowest mantissa bit of one element
    assert weights_fingerprint(model) != before
    two = nn.Sequential(nn.Linear(2, 2, bias=False), nn.Linear(2, 2, bias=False))
    with torch.no_grad():
        two[0].weight.fill_(1.0)
        two[1].weight.fill_(2.0)
    one_way = weights_fingerprint(two)
    with torch.no_grad():  # the same tensors in the other order: the position weighs each parameter
        two[0].weight.fill_(2.0)
        two[1].weight.fill_(1.0)
    assert weights_fingerprint(two) != one_way
    assert weights_fingerprint(nn.Sequential()) == f"{FINGERPRINT_PREFIX}{0:016x}"
