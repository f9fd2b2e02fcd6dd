"""train.precision -> the dtype this rank's forward runs in under autocast: decided once, at start."""

from __future__ import annotations

import logging

import torch

__all__ = ["resolve_precision"]

log = logging.getLogger("mgpu.train")


def resolve_precision(wanted: str, device: torch.device, warn: bool = True) -> torch.dtype:
    """`fp32`, `fp16`, `bf16` or `auto` on `device`. `auto` is bf16 only on a GPU that has it in hardware
    (Ampere and later): torch's plain `is_bf16_supported()` also counts emulated bf16 (V100, T4), which is
    slower than fp32. A CPU rank trains in fp32 whatever was asked; `warn` (one rank) logs that once."""
    if device.type != "cuda":
        if wanted in ("fp16", "bf16") and warn:
            log.warning("train.precision=%s: this rank has no GPU; training runs in fp32", wanted)
        return torch.float32
    if wanted == "fp32":
        return torch.float32
    if wanted == "fp16":
        return torch.float16
    if wanted == "bf16" or torch.cuda.is_bf16_supported(including_emulation=False):
        return torch.bfloat16
    return torch.float32
