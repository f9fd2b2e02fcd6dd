"""Bit-identical resumes on 4 gloo ranks with DDP's defaults, for model shapes a resume can trip on (a forward
that appends an auxiliary loss, a forward counter in get_extra_state, PowerSGD's comm hook with its error
feedback, BatchNorm + dropout): the resumed DDP gets the saved run's gradient buckets (mgpu.parallel.ddp), and the
model's forward never runs an extra time. One unbroken reference per shape, shared by its stops."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mgpu.state.single.store import CheckpointStore
from tests.conftest import ROOT, start_ranks, wait_ranks
from tests.test_trainer import assert_identical

LOOP = str(ROOT / "tests" / "ddp_shapes_loop.py")
WORLD = 4  # 3+ ranks: the sum of an all-reduce depends on the element's offset in its bucket
# The step each shape stops at: 1, saved before DDP's rebuild (at step 2's forward); 3, after it, and after
# PowerSGD has started compressing (start_powerSGD_iter=2).
STOPS = {"aux": 1, "counter": 3, "powersgd": 3, "batchnorm": 1}

pytestmark = pytest.mark.multiprocess


def run(run_dir: Path, shape: str, *extra: str) -> list[tuple[int, str]]:
    return wait_ranks(start_ranks([LOOP, str(run_dir), f"--shape={shape}", *extra], WORLD), timeout=400)


def final(run_dir: Path) -> dict:
    latest = CheckpointStore(run_dir / "checkpoints").latest()
    assert latest is not None and not latest.skipped
    return latest.state


@pytest.fixture(scope="module", params=list(STOPS))
def reference(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict, str]:
    run_dir = tmp_path_factory.mktemp(request.param) / "run"
    results = run(run_dir, request.param)
    assert [rc for rc, _ in results] == [0] * WORLD, results[0][1][-3000:]
    return request.param, final(run_dir), results[0][1]


def test_the_recorded_layout_is_the_one_ddp_rebuilt(reference: tuple[str, dict, str]) -> None:
    # mgpu derives the rebuilt buckets from the ready order it records; DDP's logging data has the reducer's.
    _, _, output = reference
    line = next(line for line in output.splitlines() if line.startswith("reducer's rebuilt buckets"))
    reducers, ours = line.split(": ", 1)[1].split("; mgpu's: ")
    assert reducers == ours, line


def test_a_resume_on_4_ranks_is_bit_identical(reference: tuple[str, dict, str], tmp_path: Path) -> None:
    shape, expected, _ = reference
    stop_at = STOPS[shape]
    first = run(tmp_path, shape, f"--stop-at-step={stop_at}")
    assert [rc for rc, _ in first] == [3] + [0] * (WORLD - 1), first[0][1][-3000:]
    assert CheckpointStore(tmp_path / "checkpoints").latest().step == stop_at
    second = run(tmp_path, shape)
    assert [rc for rc, _ in second] == [0] * WORLD, second[0][1][-3000:]
    resumed = final(tmp_path)
    assert resumed["loader"] == expected["loader"]
    assert_identical(resumed["model"], expected["model"], "model")  # the counter too (its extra state)
    assert_identical(resumed["optimizer"], expected["optimizer"], "optimizer")
    if shape == "powersgd":  # the hook's own state: iterations, error feedback, warm-start matrices, per rank
        for ours, theirs in zip(resumed["ddp"][0]["hooks"], expected["ddp"][0]["hooks"]):
            assert ours[0]["iter"] == theirs[0]["iter"]
            for key in ("error_dict", "p_memory_dict", "q_memory_dict"):
                assert ours[0][key].keys() == theirs[0][key].keys()
                for bucket in ours[0][key]:
                    assert torch.equal(ours[0][key][bucket], theirs[0][key][bucket]), (key, bucket)


HOOK_SCRIPT = r"""
import torch, torch.distributed as dist
from mgpu.parallel.ddp import ResumableDDP, bucket_layout

dist.init_process_group("gloo")
rank = dist.get_rank()

class Feedback:  # a comm hook state with its own state_dict (as an error-feedback hook keeps one per rank)
    def state_dict(self):
        return {"rank": rank, "memory": torch.full((4,), float(rank))}

    def load_state_dict(self, state):
        pass

def hook(state, bucket):
    return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda fut: fut.value()[0])

model = ResumableDDP(torch.nn.Linear(4, 2))
model.register_comm_hook(Feedback(), hook)
model(torch.ones(2, 4)).sum().backward()
layout = bucket_layout(model)
hooks = (layout or {}).get("hooks") or []
print("hooks", [states[0]["rank"] for states in hooks], flush=True)
dist.barrier()  # neither rank tears gloo down while the other still talks to it (CI: rank 1 aborted in the teardown)
dist.destroy_process_group()
"""


def test_a_comm_hooks_state_is_gathered_to_the_writer_only(tmp_path: Path) -> None:
    """At every save each rank's comm hook state goes to rank 0, which writes it (the checkpoint holds every
    rank's state once, each rank resumes its own), not to every rank (world x the state in each rank's memory)."""
    results = wait_ranks(start_ranks(["-c", HOOK_SCRIPT], 2), 60)
    assert [rc for rc, _ in results] == [0, 0], results
    assert "hooks [0, 1]" in results[0][1], results[0][1]
    assert "hooks []" in results[1][1], results[1][1]


def test_the_private_bucket_answer_fails_loudly_when_torch_moves_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """mgpu.parallel.ddp gives a resumed reducer its buckets through one torch private (no public way exists): a torch
    without it, or a DDP constructor that no longer asks it, is an error, never a resume in another order."""
    import torch.distributed as dist

    from mgpu.parallel.ddp import BUCKET_ASSIGNMENT, _initial_buckets

    with pytest.raises(RuntimeError, match="did not ask torch.distributed._compute_bucket_assignment_by_size"):
        with _initial_buckets([[0, 1]], [1024]):
            pass  # a constructor that never asks
    assert getattr(dist, BUCKET_ASSIGNMENT).__name__ == "_compute_bucket_assignment_by_size"  # put back
    monkeypatch.delattr(dist, BUCKET_ASSIGNMENT)
    with pytest.raises(RuntimeError, match="has no torch.distributed._compute_bucket_assignment_by_size"):
        with _initial_buckets([[0, 1]], [1024]):
            pass
