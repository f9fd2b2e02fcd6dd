#!/bin/bash
# GPU check 4 (issue 44): the survivors' save of a 4.9 GB state from the GPU into shared memory beside a plain
# torch.save of it (bench/gpu/survivors_save.py), then the writer and the periodic saves against that machine's disk
# (bench/write_speed.py, bench/periodic_saves.py: huge-page buffers, a pinned snapshot written in place, zlib-ng's
# CRC-32, which had no GPU figure). One call, ~5 min; each part has its own limit. Wheels the image lacks (zlib-ng,
# submitit) come from .whl/ (carried). Everything lands in $OUT: run.log and one JSON file per bench.
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=8
PY=${PY:-python3}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
{
date -u; nvidia-smi -L
[ -d .whl ] && $PY -m pip install -q --no-index --no-deps .whl/*.whl 2>&1 | tail -2
$PY -c "import torch, zlib_ng; print('torch', torch.__version__, torch.cuda.get_device_name(0), 'zlib-ng ok')"
nproc; free -g | head -2; df -h . /dev/shm | cat
started=$(date +%s)
timeout ${SURVIVORS_S:-150} $PY bench/gpu/survivors_save.py --gb 4.9 --out "$OUT/survivors_save_gpu.json"
echo "survivors_save rc=$? in $(( $(date +%s) - started )) s"
started=$(date +%s)
timeout ${WRITE_S:-100} $PY bench/write_speed.py --mb 2048 --repeats 2 --out "$OUT/write_speed_gpu_host.json"
echo "write_speed rc=$? in $(( $(date +%s) - started )) s"
started=$(date +%s)
timeout ${PERIODIC_S:-90} $PY bench/periodic_saves.py --mb 128 --steps 60 --repeats 2 --out "$OUT/periodic_saves_gpu_host.json"
echo "periodic_saves rc=$? in $(( $(date +%s) - started )) s"
} 2>&1 | tee "$OUT/run.log"
