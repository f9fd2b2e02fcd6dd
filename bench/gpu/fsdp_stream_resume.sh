#!/bin/bash
# GPU check 2 (after this round's merges): FSDP2 + sharded DCP checkpoints on CUDA/NCCL (bf16 auto, and fp16 with
# GradScaler over DTensor gradients), stopped and resumed vs unbroken; the streaming GPT config stopped and resumed.
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1; export PYTHONPATH=/tmp/site:$PWD; fi
PY=${PY:-python3}
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
R=/tmp/gpuruns; rm -rf $R
TR="$PY -m torch.distributed.run --nproc-per-node 1"
pair() {  # name, stop step, config + overrides...
  local name=$1 stop=$2; shift 2
  local t0=$(date +%s)
  timeout 150 $TR jobs/train.py "$@" run.root=$R run.name=$name-unbroken 2>&1 | grep -E "step .*/|eval|finished|rror" | tail -3
  echo "$name unbroken rc=${PIPESTATUS[0]} ($(( $(date +%s) - t0 )) s)"
  timeout 150 $TR jobs/train.py "$@" run.root=$R run.name=$name-stopped --stop-at-step $stop 2>&1 | grep -E "saved|stop|rror" | tail -3
  echo "$name stopped rc=${PIPESTATUS[0]}"
  timeout 150 $TR jobs/train.py "$@" run.root=$R run.name=$name-stopped 2>&1 | grep -E "resumed|finished|rror" | tail -3
  echo "$name resumed rc=${PIPESTATUS[0]}"
  $PY jobs/status.py --verify $R/$name-unbroken $R/$name-stopped; echo "$name verify rc=$?"
}
{
nvidia-smi -L 2>/dev/null; $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
M="--config jobs/configs/mnist.yaml train.epochs=1 train.deterministic=true train.parallel=fsdp"
pair fsdp-bf16 120 $M
ls $R/fsdp-bf16-stopped/checkpoints/ $R/fsdp-bf16-stopped/checkpoints/step_00000120 2>&1 | head -20
grep -h -o '"device": *"[^"]*"\|"backend": *"[^"]*"' $R/fsdp-bf16-stopped/logs/rank0.json
pair fsdp-fp16 120 $M train.precision=fp16
pair stream 40 --config jobs/configs/gpt_stream.yaml train.max_steps=80 log.every_steps=10 train.deterministic=true
$PY -m mgpu.state.sharded.export $R/fsdp-bf16-stopped $R/export.pt; echo "export rc=$?"; ls -la $R/export.pt
} 2>&1 | tee $OUT/check2.log
