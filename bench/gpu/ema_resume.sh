#!/bin/bash
# GPU check of issue 43's EMA (one GPU: a world of one, NCCL's default group): mgpu.EMA in an own loop under FSDP2,
# train.ema_decay in the trainer under FSDP2 (sharded) and DDP's path (single file), each unbroken vs stopped and
# resumed, deterministic kernels: the final model and EMA compared bit for bit; mgpu.load_model(..., ema=True); and
# the resume check on the FSDP2 own loop with its EMA.
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
PY=${PY:-python3}
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
R=/tmp/emaruns; rm -rf $R; mkdir -p $R
TR="timeout 150 $PY -m torch.distributed.run --nproc-per-node 1"
compare() {  # two run directories: their latest checkpoints' model and ema, bit for bit
  $PY - "$1" "$2" <<'PYEOF'
import sys, torch
from pathlib import Path
from mgpu.state.single.store import CheckpointStore
from mgpu.state.sharded.export import consolidate, is_sharded_checkpoint
def final(run):
    store = CheckpointStore(Path(run) / "checkpoints"); path = store.latest_path()
    return consolidate(path) if is_sharded_checkpoint(path) else store.latest().state
a, b = final(sys.argv[1]), final(sys.argv[2])
for key in ("model", "ema"):
    same = set(a[key]) == set(b[key]) and all(torch.equal(a[key][k], b[key][k]) for k in a[key])
    print(f"{key}: {'identical' if same else 'DIFFERS'} ({len(a[key])} tensors, n_averaged {a['ema'].get('n_averaged')})")
PYEOF
}
pair() {  # name, stop step, command (a function below: the run directory last)...
  local name=$1 stop=$2; shift 2; local t0=$(date +%s)
  "$@" $R/$name-unbroken 2>&1 | grep -E "rror|resumed|finished" | tail -3
  echo "$name unbroken rc=${PIPESTATUS[0]} ($(( $(date +%s) - t0 )) s)"
  MGPU_STOP_AT_STEP=$stop "$@" $R/$name-stopped 2>&1 | grep -E "rror" | tail -3; echo "$name stopped rc=${PIPESTATUS[0]}"
  "$@" $R/$name-stopped 2>&1 | grep -E "rror|resumed" | tail -3; echo "$name resumed rc=${PIPESTATUS[0]}"
  compare $R/$name-unbroken $R/$name-stopped
}
STEPS=${STEPS:-160} STOP=${STOP:-100}  # the trainer's run and its stop (smaller for a try on a CPU)
trainer() { $TR jobs/train.py --config jobs/configs/mnist.yaml train.max_steps=$STEPS train.deterministic=true train.ema_decay=0.999 "${@:1:$#-1}" run.dir=${@: -1}; }
fsdp_trainer() { trainer train.parallel=fsdp "$@"; }
own() { $TR tests/own_loop.py "$1" --parallel fsdp --ema 0.9; }
{
nvidia-smi -L 2>/dev/null; $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
pair own-fsdp 7 own
grep -h -o '"device": *"[^"]*"\|"backend": *"[^"]*"' $R/own-fsdp-stopped/logs/rank0.json
pair trainer-fsdp $STOP fsdp_trainer
pair trainer-ddp $STOP trainer
$PY -c "
import torch, mgpu
from jobs.tasks.mnist import SmallCNN
net = mgpu.load_model('$R/trainer-fsdp-stopped', SmallCNN(), which='latest', ema=True)
print('load_model ema=True:', sum(p.numel() for p in net.parameters()), 'weights')"
[ -n "$SKIP_CHECK" ] && exit 0
t0=$(date +%s)
timeout 200 $PY -m mgpu.check.resume --nproc 1 -- tests/own_loop.py {run} --parallel fsdp --ema 0.9 2>&1 | tail -4
echo "check rc=${PIPESTATUS[0]} ($(( $(date +%s) - t0 )) s)"
} 2>&1 | tee $OUT/ema_resume.log
