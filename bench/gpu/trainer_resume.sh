#!/bin/bash
# GPU check 1 (main as landed): the trainer on CUDA (NCCL, bf16 auto), stopped and resumed vs unbroken.
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1; export PYTHONPATH=/tmp/site:$PWD; fi
PY=${PY:-python3}
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
R=/tmp/gpuruns; rm -rf $R
{
nvidia-smi -L 2>/dev/null; $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
common="--config jobs/configs/mnist.yaml run.root=$R train.epochs=1 train.deterministic=true"
t0=$(date +%s.%N)
timeout 200 $PY jobs/train.py $common run.name=unbroken 2>&1 | tail -4; echo "unbroken rc=${PIPESTATUS[0]}"
t1=$(date +%s.%N)
timeout 200 $PY -m torch.distributed.run --nproc-per-node 1 jobs/train.py $common run.name=stopped --stop-at-step 120 2>&1 | tail -4; echo "stopped rc=${PIPESTATUS[0]}"
timeout 200 $PY -m torch.distributed.run --nproc-per-node 1 jobs/train.py $common run.name=stopped 2>&1 | tail -6; echo "resumed rc=${PIPESTATUS[0]}"
$PY jobs/status.py --verify $R/unbroken $R/stopped; echo "verify rc=$?"
grep -h -o '"device": *"[^"]*"\|"backend": *"[^"]*"' $R/stopped/logs/rank0.json 2>/dev/null
grep -h -i "precision\|bf16" $R/stopped/logs/*.log 2>/dev/null | head -3
echo "unbroken wall: $(echo "$t1 - $t0" | bc) s"
} 2>&1 | tee $OUT/check1.log
