"""A rank whose gloo worker thread still holds a finished collective's last tensor when the interpreter exits
(tests/test_native_threads.py). Run as one of two ranks (RANK, WORLD_SIZE, MASTER_ADDR/PORT set).

The rank forms its group with mgpu (mgpu.parallel.distributed.process_group) and keeps the group object alive past
the group's destruction, as a DistributedDataParallel model does. It starts an all-reduce of a tensor it drops at
once, and never waits: the tensor's Python object now belongs to torch's C++ side, and the gloo worker thread that
finishes the collective must take the GIL to release it. The main thread then holds the GIL (a switch interval of
1000 s, a busy loop) until it exits; rank 1 joins the collective 0.2 s late, so that rank 0's half ends in
that loop. Without mgpu.stop.native_threads' exit, the worker asks for the GIL only once
the interpreter finalizes; CPython ends it with pthread_exit, and the forced unwind through torch's C++ frames aborts
the process ("terminate called without an active exception", SIGABRT): `--without-settle` leaves it out
(gloo_threads.skip), to show that the probe makes the abort it checks for."""

import sys
import time

import torch
import torch.distributed as dist

from mgpu.parallel import gloo_threads
from mgpu.parallel.distributed import process_group

if "--without-settle" in sys.argv:
    gloo_threads.skip()

with process_group() as context:
    kept = dist.group.WORLD  # alive past destroy_process_group, as a DDP model keeps its group
    sys.setswitchinterval(1000)  # the main thread lets go of the GIL only where it blocks
    if context.env.rank == 1:
        time.sleep(0.2)  # rank 0's half of the collective ends only during its busy loop below
    grads = torch.ones(8)
    # Python state of its own (a __dict__, as a parameter or a subclass has): torch keeps the object alive
    grads.step = 1  # type: ignore[attr-defined]
    dist.all_reduce(grads, async_op=True)  # the work is not kept
    del grads  # nor the tensor: its Python object now belongs to torch's C++ side
print("main thread done", flush=True)  # (a write lets go of the GIL: before the loop)
began = time.perf_counter()
while time.perf_counter() - began < 1.5:  # rank 1's half arrives, rank 0's worker finishes and waits for the GIL
    pass
