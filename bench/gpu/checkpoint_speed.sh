#!/bin/bash
# GPU check 3 (issue 31): the same GPT eight ways side by side on one GPU (bench/gpu/side_by_side.py, size gpu),
# then the writer against this machine's disk (bench/write_speed.py) and periodic saves that come faster than writes
# (bench/periodic_saves.py). One call of a lent machine, ~8 min; each part has its own time limit so a slow one
# leaves the others their turn. Everything lands in $OUT: run.log and one JSON file per bench.
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=8
PY=${PY:-python3}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
{
date -u; nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"
$PY -c "import lightning; print('lightning', lightning.__version__)"
nproc; free -g | head -2; df -h . /tmp | cat
started=$(date +%s)
timeout ${SBS_S:-330} $PY bench/gpu/side_by_side.py --size gpu --forms hand_ddp,trainer,own,hand_fsdp,own_fsdp,trainer_fsdp,trainer_sharded,lightning --out "$OUT/side_by_side_gpu.json"
echo "side_by_side rc=$? in $(( $(date +%s) - started )) s"
started=$(date +%s)
timeout ${WRITE_S:-90} $PY bench/write_speed.py --mb 2048 --repeats 2 --out "$OUT/write_speed_gpu_host.json"
echo "write_speed rc=$? in $(( $(date +%s) - started )) s"
started=$(date +%s)
timeout ${PERIODIC_S:-80} $PY bench/periodic_saves.py --mb 128 --steps 60 --repeats 2 --out "$OUT/periodic_saves_gpu_host.json"
echo "periodic_saves rc=$? in $(( $(date +%s) - started )) s"
} 2>&1 | tee "$OUT/run.log"
