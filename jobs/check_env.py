"""The smallest honest distributed job: detect the launcher, form the group, all-reduce, report.

    python jobs/check_env.py                       # a world of one
    torchrun --nproc-per-node 2 jobs/check_env.py  # two ranks on gloo
    srun ... python jobs/check_env.py --out DIR    # one JSON file per rank in DIR

Every rank contributes rank+1; the sum must be world_size*(world_size+1)/2 on every rank.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

from mgpu.cluster.environment import detect_environment  # noqa: E402
from mgpu.errors import MgpuError, exit_with  # noqa: E402

MAX_TIMEOUT_S = 7 * 24 * 3600  # as distributed.init_timeout_s


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="directory for one rank<N>.json per rank")
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="rendezvous timeout in seconds")
    args = parser.parse_args(argv)
    if not 0 < args.timeout_s <= MAX_TIMEOUT_S:  # (NaN fails too) timedelta overflows near 1e14 s
        exit_with(MgpuError(f"--timeout-s {args.timeout_s}: must be in (0, {MAX_TIMEOUT_S}] seconds"), "check_env")
    try:
        env = detect_environment()
    except MgpuError as error:
        exit_with(error, "check_env")

    import torch

    from mgpu.parallel.distributed import all_reduce, process_group  # torch only after validation

    try:
        with process_group(env, timeout=timedelta(seconds=args.timeout_s), wait_setting="--timeout-s") as ctx:
            try:
                total = int(all_reduce(float(env.rank + 1)).item())
            except RuntimeError as error:  # a rank that left after the rendezvous (gloo: connection closed)
                raise MgpuError(f"the all-reduce failed on rank {env.rank}: {' '.join(str(error).split())[:200]}; "
                                f"check the other ranks' output") from None
    except MgpuError as error:  # a rendezvous that did not complete, or the all-reduce after it
        exit_with(error, "check_env")
    expected = env.world_size * (env.world_size + 1) // 2
    record = {**env.__dict__, "nodes": list(env.nodes), "backend": ctx.backend, "device": str(ctx.device),
              "allreduce_sum": total, "expected_sum": expected, "hostname": socket.gethostname(),
              "slurmd_nodename": os.environ.get("SLURMD_NODENAME"), "pid": os.getpid(),
              "cpu_threads": torch.get_num_threads()}
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"rank{env.rank}.json").write_text(json.dumps(record, indent=1))
    print(f"rank {env.rank}/{env.world_size} ({env.launcher}, node {env.node_rank} {socket.gethostname()}, "
          f"{ctx.backend}): all-reduce sum {total}, expected {expected}", flush=True)
    return 0 if total == expected else 1


if __name__ == "__main__":
    sys.exit(main())
