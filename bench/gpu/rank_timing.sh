#!/bin/bash
# GPU check (issue 45): per-rank timing on a GPU, and its cost on a quiet machine. One call of a lent machine,
# ~4 min; everything lands in $OUT (run.log, the probe's per-step waits, one JSON file per bench).
# 1. mgpu.parallel.sync_wait's CUDA path (CUDA events on the default stream): 2 ranks on the one GPU (gloo reduces
#    CUDA tensors; NCCL will not put two ranks on one device), rank 1 late by 0.1 s before its forward (DDP's buffer
#    broadcast waits for it) or before its backward (the gradient reduction does); the same on CPU beside it.
# 2. bench/rank_timing.py side by side (stragglers on / off in one run), on CPU (16 quiet cores) and on the GPU.
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4 PYTHONPATH=.
PY=${PY:-python3}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
{
date -u; nvidia-smi -L
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"
for device in cuda cpu; do
  mkdir -p "$OUT/probe_$device"
  timeout 120 $PY -m torch.distributed.run --nproc-per-node 2 --master-port 29611 tests/sync_wait_probe.py "$OUT/probe_$device" $device
  echo "probe $device rc=$?"
done
$PY - <<'PYEOF'
import json, os, statistics
from tests.sync_wait_probe import SLEEP_S
for device in ("cuda", "cpu"):
    for where in ("forward", "backward"):
        try:
            late, waiting = (json.load(open(f"{os.environ['OUT']}/probe_{device}/{where}-rank{r}.json"))[1:] for r in (1, 0))
        except OSError as error:
            print(device, where, "missing", error); continue
        ok = all(s["waited"] >= 0.8 * SLEEP_S and s["waited"] <= s["wall"] for s in waiting) and \
            statistics.median(s["waited"] for s in late) < 0.3 * SLEEP_S
        print(device, where, "PASS" if ok else "FAIL", "waiting", [round(s["waited"], 4) for s in waiting],
              "late", [round(s["waited"], 4) for s in late])
PYEOF
timeout 200 $PY bench/rank_timing.py --repeats 30 --steps 120 --out "$OUT/rank_timing_quiet_cpu.json"
echo "bench cpu rc=$?"
timeout 200 $PY bench/rank_timing.py --device cuda --repeats 30 --steps 120 --out "$OUT/rank_timing_cuda.json"
echo "bench cuda rc=$?"
} 2>&1 | tee "$OUT/run.log"
