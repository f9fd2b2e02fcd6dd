"""Seeding and RNG state capture: every source of randomness a step can touch, per rank.

States are stored as tensors and plain Python values so that `torch.load(weights_only=True)` can
read them back (numpy's state array becomes a tensor).
"""

from __future__ import annotations

import hashlib
import os
import random
from typing import Any, cast

import numpy as np
import torch

__all__ = ["capture_rng_state", "derived_seed", "restore_rng_state", "seed_everything", "seed_rank", "seed_step",
           "step_rng_state", "stream_seed", "use_deterministic_kernels"]

TORCH_SEEDS = 2**64
"""torch.manual_seed takes [0, 2**64) ("Overflow when unpacking long long" above)."""


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (all CUDA devices included)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def stream_seed(*parts: int | str) -> int:
    """A seed in [0, 2**63) for the tuple `parts`, whatever their size: 63 bits of their BLAKE2b digest, so two
    different tuples share a seed with odds of 2**-63."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8, person=b"mgpu-seed").digest()
    return int.from_bytes(digest, "big") >> 1


def derived_seed(packed: int, exact: bool, *parts: int | str) -> int:
    """`packed`, the arithmetic packing of `parts` that seeded their stream before, while it is exact (no two
    tuples pack alike: the caller says) and a seed torch accepts; else `stream_seed(*parts)`. Every stream
    that could be seeded before stays the same (a run resumed across the upgrade stays bit-identical); a
    packing too large for torch (train.seed >= 18447 for a sample's seed) no longer overflows."""
    return packed if exact and 0 <= packed < TORCH_SEEDS else stream_seed(*parts)


def capture_rng_state() -> dict[str, Any]:
    """This process's RNG states, in a form `torch.load(weights_only=True)` accepts."""
    kind, keys, pos, has_gauss, cached = cast(tuple[str, np.ndarray, int, int, float], np.random.get_state())
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        # This rank's own device only: a resume may see another number of devices (--gpus-per-task=1
        # then all visible), and restoring by index would then fail or seed another GPU.
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Undo `capture_rng_state`: the next random draw is the one the saved process would have made."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    numpy_state = state["numpy"]
    np.random.set_state((numpy_state["kind"], numpy_state["keys"].numpy().astype(np.uint32),
                         numpy_state["pos"], numpy_state["has_gauss"], numpy_state["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(_this_device_state(state["cuda"], torch.cuda.current_device()))


def _this_device_state(saved: Any, device: int) -> Any:
    """The saved CUDA generator state of this rank's device: one state (this format), or the per-visible-
    device list older checkpoints hold, of which the rank's device was the one at its index (or the only one)."""
    if isinstance(saved, (list, tuple)):
        return saved[device] if device < len(saved) else saved[0]
    return saved


def seed_step(seed: int, rank: int, step: int) -> None:
    """Every generator of this rank seeded for what follows optimizer step `step` (a session does it at every step's
    end: mgpu.run.session.Session.should_stop): python's, numpy's, torch's CPU generator and this rank's CUDA
    device's, from (seed, rank, step) alone. So a rank's RNG at a step's end is derived, never needs keeping: a
    rank lost with its process resumes that step with the draws the unbroken run made (mgpu.state.memory.step_mark).
    Microseconds: the generators are seeded directly (torch.manual_seed looks at every device kind)."""
    value = stream_seed("step", seed, rank, step)
    random.seed(value)
    np.random.seed(value % 2**32)
    torch.default_generator.manual_seed(value)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.default_generators[torch.cuda.current_device()].manual_seed(value)


def step_rng_state(seed: int, rank: int, step: int) -> dict[str, Any]:
    """`capture_rng_state()` as it is right after `seed_step(seed, rank, step)`, without changing this process's."""
    saved = capture_rng_state()
    try:
        seed_step(seed, rank, step)
        return capture_rng_state()
    finally:
        restore_rng_state(saved)


def use_deterministic_kernels(enabled: bool) -> None:
    """train.deterministic: the same kernels, in the same order, on every run; a kernel without a
    deterministic version raises instead of running. Call before the first GPU matmul (cuBLAS reads its
    workspace setting when it starts)."""
    if not enabled:
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def seed_rank(seed: int, rank: int, deterministic: bool) -> None:
    """A rank's start: deterministic kernels if `deterministic` (before any GPU matmul), then every generator
    seeded from `seed + rank` (each rank its own dropout and augmentation draws)."""
    use_deterministic_kernels(deterministic)
    seed_everything(seed + rank)
