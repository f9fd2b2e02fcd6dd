"""mgpu.run.outcome: the resume command a stopped run prints, runnable as printed, and the one map from outcome to
exit code. Pure functions, tables."""

from __future__ import annotations

import pytest

from mgpu.run.outcome import SPAWN_ARGV, STOPPED_EXIT_CODE, Outcome, _command_line, _own_command, exit_code

VENV = "/home/u/proj/.venv/bin/python3"


@pytest.mark.parametrize("launcher, environ, argv, orig, expected", [
    # plain python from a venv that is not active: the interpreter's full path, the user's MGPU_* variables
    ("local", {"MGPU_MAX_REQUEUES": "3", "MGPU_RUN_DIR_FILE": "/x", "HOME": "/h"}, ["port_loop.py", "--lr", "1e-3"],
     [VENV, "port_loop.py", "--lr", "1e-3"],
     f"cd /w && MGPU_MAX_REQUEUES=3 {VENV} port_loop.py --lr 1e-3"),
    # `python -m pkg.train`: the interpreter's own command line, not sys.argv's file path
    ("local", {}, ["/w/pkg/train.py", "a b"], [VENV, "-u", "-m", "pkg.train", "a b"],
     f"cd /w && {VENV} -u -m pkg.train 'a b'"),
    # a rank mgpu.spawn started: its interpreter command line is multiprocessing's, its argv the parent's
    ("local", {"MGPU_RECOVERY": "batch"}, ["jobs/loops/translate_loop.py", "--nprocs=2"], None,
     f"cd /w && MGPU_RECOVERY=batch {VENV} jobs/loops/translate_loop.py --nprocs=2"),
    # torchrun on one node: its command line rebuilt from what it told the worker
    ("torchrun", {"LOCAL_WORLD_SIZE": "4", "GROUP_WORLD_SIZE": "1", "MASTER_PORT": "29500"}, ["loop.py", "--x"], None,
     f"cd /w && {VENV} -m torch.distributed.run --nproc-per-node 4 loop.py --x"),
    # torchrun on two nodes, with restarts: this node's line (the other runs it with its --node-rank)
    ("torchrun", {"LOCAL_WORLD_SIZE": "8", "GROUP_WORLD_SIZE": "2", "GROUP_RANK": "0", "MASTER_ADDR": "n1",
                  "MASTER_PORT": "29400", "TORCHELASTIC_MAX_RESTARTS": "3", "MGPU_MAX_FAILURES": "2"},
     ["train.py"], None,
     f"cd /w && MGPU_MAX_FAILURES=2 {VENV} -m torch.distributed.run --nproc-per-node 8 --nnodes 2 --node-rank 0 "
     f"--master-addr n1 --master-port 29400 --max-restarts 3 train.py"),
    # a task of an srun step of 4 tasks on 2 nodes (a batch script of one's own, no submitter): srun again, the
    # same world (a one-task job's batch shell: the command alone)
    ("slurm", {"SLURM_NTASKS": "4", "SLURM_NNODES": "2"}, ["loop.py"], [VENV, "loop.py"],
     f"cd /w && srun --nodes 2 --ntasks 4 {VENV} loop.py"),
    ("slurm", {"SLURM_NTASKS": "1", "SLURM_NNODES": "1"}, ["loop.py"], [VENV, "loop.py"], f"cd /w && {VENV} loop.py"),
])
def test_the_resume_command_runs_as_printed(launcher: str, environ: dict[str, str], argv: list[str],
                                            orig: list[str] | None, expected: str) -> None:
    assert _own_command(launcher, environ, argv, orig, VENV, "/w") == expected


@pytest.mark.parametrize("kind, code", [("finished", 0), ("requeued", 0), ("other_rank", 0),
                                        ("stays_down", STOPPED_EXIT_CODE)])
def test_one_map_from_outcome_to_exit_code(kind: str, code: int) -> None:
    assert exit_code(Outcome(kind)) == code  # type: ignore[arg-type]


@pytest.mark.parametrize("launcher, environ, spawned, orig, expected", [
    # plain python, srun's task, submitit: the interpreter's own command line
    ("single", {}, False, [VENV, "-u", "loop.py", "--x"], [VENV, "-u", "loop.py", "--x"]),
    # a rank of `python -m mgpu.run.spawn -n 2 loop.py`: the spawning command, so pasting it starts 2 ranks again
    ("env", {SPAWN_ARGV: f'["{VENV}", "-m", "mgpu.run.spawn", "-n", "2", "loop.py", "--x"]'}, True, [VENV, "-c", "mp"],
     [VENV, "-m", "mgpu.run.spawn", "-n", "2", "loop.py", "--x"]),
    # another spawned process (not mgpu.spawn's), or a damaged variable: sys.argv (its parent's)
    ("env", {}, True, [VENV, "-c", "from multiprocessing.spawn import spawn_main"], None),
    ("env", {SPAWN_ARGV: "{not json"}, True, [VENV, "-c", "mp"], None),
    # torchrun: rebuilt from its variables (_torchrun_options), never the worker's own line
    ("torchrun", {}, False, [VENV, "-u", "loop.py"], None),
])
def test_the_command_line_a_resume_repeats(launcher: str, environ: dict[str, str], spawned: bool, orig: list[str],
                                           expected: list[str] | None) -> None:
    assert _command_line(launcher, environ, spawned, orig) == expected
