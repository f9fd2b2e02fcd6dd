"""train.precision's resolution (D10). No GPU here: torch.cuda's answer is a mock of two GPUs, said so below."""

from __future__ import annotations

import logging

import pytest
import torch

from mgpu.parallel.precision import resolve_precision

GPU = torch.device("cuda", 0)  # a device object only: nothing runs on it
CPU = torch.device("cpu")


def fake_gpu(native_bf16: bool):  # type: ignore[no-untyped-def]
    """torch.cuda.is_bf16_supported as on an A100 (native bf16) or a V100/T4 (emulated only): a mock of CUDA,
    which this machine does not have. Its default, including_emulation=True, says True on both."""

    def is_bf16_supported(including_emulation: bool = True) -> bool:
        return native_bf16 or including_emulation

    return is_bf16_supported


@pytest.mark.parametrize("native_bf16, wanted, expected", [
    (True, "auto", torch.bfloat16),    # Ampere and later: bf16 in hardware
    (False, "auto", torch.float32),    # V100/T4: emulated bf16 is slower than fp32, not picked
    (False, "bf16", torch.bfloat16),   # asked for explicitly: the user's choice stands
    (False, "fp16", torch.float16),
    (True, "fp32", torch.float32),
])
def test_auto_never_picks_emulated_bf16(native_bf16: bool, wanted: str, expected: torch.dtype,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", fake_gpu(native_bf16))
    assert resolve_precision(wanted, GPU) == expected


@pytest.mark.parametrize("wanted, warned", [("fp16", True), ("bf16", True), ("auto", False), ("fp32", False)])
def test_a_cpu_rank_trains_in_fp32_and_says_so_once(wanted: str, warned: bool,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="mgpu.train"):
        assert resolve_precision(wanted, CPU) == torch.float32
        assert resolve_precision(wanted, CPU, warn=False) == torch.float32  # the other ranks stay quiet
    expected = [f"train.precision={wanted}: this rank has no GPU; training runs in fp32"] if warned else []
    assert [r.getMessage() for r in caplog.records] == expected
