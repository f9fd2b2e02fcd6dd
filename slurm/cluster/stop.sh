#!/usr/bin/env bash
# Stop the daemons that start.sh started -- only those, by the PIDs it recorded in
# $DIR/pids/ (never by name). SIGTERM, wait (bounded), SIGKILL what is left.
# Job steps (slurmstepd) that are still running are left alone, as slurmd itself would.
#
#   slurm/cluster/stop.sh                        # cluster a, and b and c first if they run (they use a's munged, slurmdbd)
#   MGPU_SLURM_CLUSTER=b slurm/cluster/stop.sh   # cluster b alone (c likewise)
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=clusters.sh
source "$HERE/clusters.sh"
WAIT_S=${MGPU_SLURM_STOP_WAIT_S:-20}

[[ $(id -u) -eq 0 ]] || { echo "stop.sh: not root" >&2; exit 1; }
if [[ $CLUSTER == a ]]; then
  for other in "${OTHERS[@]}"; do
    if compgen -G "$BASE_DIR-$other/pids/*.pid" >/dev/null; then
      MGPU_SLURM_CLUSTER=$other "$HERE/stop.sh"
    fi
  done
fi
[[ -d $DIR/pids ]] || { echo "nothing to stop ($DIR/pids missing)"; exit 0; }

# pid of NAME if the recorded process is alive and is what we started (guards against PID reuse)
ours() {
  local f=$DIR/pids/$1.pid pid
  [[ -s $f ]] || return 1
  pid=$(<"$f")
  [[ $(cat "/proc/$pid/comm" 2>/dev/null) == "${1%-n[0-9]*}" ]] && echo "$pid"
}

# Reverse start order, in three groups stopped in parallel within each (every daemon takes ~2 s to
# exit): slurmctld still reaches slurmdbd as it shuts down, and slurmdbd still reaches MariaDB.
for group in "${NODES[*]/#/slurmd-} slurmctld" slurmdbd "mariadbd munged"; do
  pids=()
  for name in $group; do
    if pid=$(ours "$name"); then
      kill -TERM "$pid" 2>/dev/null || true
      pids+=("$pid")
      echo "stopping $name (pid $pid)"
    fi
    rm -f "$DIR/pids/$name.pid"
  done
  t0=$SECONDS
  for pid in "${pids[@]}"; do
    while kill -0 "$pid" 2>/dev/null; do
      if ((SECONDS - t0 >= WAIT_S)); then
        echo "pid $pid still alive after ${WAIT_S}s: SIGKILL" >&2
        kill -KILL "$pid" 2>/dev/null || true
        sleep 0.5
        break
      fi
      sleep 0.1
    done
  done
done
rm -f "$DIR/etc/fingerprint"
echo "stopped cluster $CLUSTER"
