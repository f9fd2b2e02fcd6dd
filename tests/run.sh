#!/usr/bin/env bash
# Set up and run the whole test suite: the README's test command, and what CI runs.
#   bash tests/run.sh                     # everything: mypy, then two pytest lanes side by side (below)
#   bash tests/run.sh [pytest args...]    # mypy, then one pytest with these args (tests/e2e included unless skipped)
#   MGPU_SKIP_SLURM=1 bash tests/run.sh [pytest args...]   # no Slurm cluster, tests/e2e not run
# Creates .venv (torch pinned by constraints.txt to the CPU build), starts the local Slurm test
# clusters when running as root (slurm/cluster/start.sh installs Debian's slurm-wlm on first use),
# runs the type checker (mypy, configured in setup.cfg) and pytest. Without root the real-Slurm tests
# skip with the reason; with CI=true they fail, and MGPU_SKIP_SLURM is refused: CI runs everything.
# Without arguments the end-to-end lane (tests/e2e: mostly waiting on Slurm) runs as a second pytest beside
# the rest; its output follows the first lane's, and the script fails if either lane (or mypy) does. The
# end-to-end lane runs as three streams, three pytest-xdist workers each bound to a cluster of its own (a: n1, n2;
# b: n3, n4; c: n5, n6; slurm/cluster/clusters.sh), a test file at a time. The rest runs in MGPU_TEST_WORKERS pytest-xdist
# workers (default 3, one test file each at a time: a file's shared reference runs stay in one worker): its
# real-process tests mostly wait (watchdog allowances, sleep-paced steps, a process's start), so 3 workers keep
# 2 cores busy; 1 runs each lane in one process (the end-to-end lane on cluster a alone).
# It says what it will install and start before it does any of it.
set -euo pipefail
cd "$(dirname "$0")/.."

skip_slurm=${MGPU_SKIP_SLURM:-}
case $skip_slurm in "" | 0) skip_slurm="" ;; 1) ;; *)
  echo "tests/run.sh: MGPU_SKIP_SLURM=$skip_slurm: set it to 1 (skip the real-Slurm tests) or leave it unset" >&2
  exit 2 ;;
esac
if [ -n "$skip_slurm" ] && [ "${CI:-}" = true ]; then
  echo "tests/run.sh: MGPU_SKIP_SLURM=1 is refused with CI=true: CI runs every test, the real-Slurm ones too" >&2
  exit 2
fi

workers=${MGPU_TEST_WORKERS:-3}
case $workers in *[!0-9]* | "" | 0) echo "tests/run.sh: MGPU_TEST_WORKERS=$workers: a number of workers >= 1" >&2; exit 2 ;; esac
parallel=()
[ "$workers" -gt 1 ] && parallel=(-n "$workers" --dist loadfile)
streams=() clusters=(a)  # the end-to-end lane: three streams (a pytest-xdist worker per cluster) beside the rest
[ "$workers" -gt 1 ] && [ $# -eq 0 ] && streams=(-n 3 --dist loadfile) clusters=(a b c)

# ----------------------------------------------------------------------------- what it will do
venv_note="creates .venv (python3 -m venv) and"
[ -x .venv/bin/python ] && venv_note="into the existing .venv,"
echo "tests/run.sh: $venv_note pip-installs this package with its test extra (torch pinned by constraints.txt)"
cluster=""
if [ -n "$skip_slurm" ]; then
  echo "tests/run.sh: MGPU_SKIP_SLURM=1: no Slurm cluster is installed or started; tests/e2e is not run"
elif [ "$(id -u)" = 0 ] && [ -x slurm/cluster/start.sh ]; then
  cluster=1
  # The package list is start.sh's own (one place to change it).
  read -r -a pkgs <<<"$(sed -n 's/^PKGS=(\(.*\))$/\1/p' slurm/cluster/start.sh)"
  missing=()
  for p in "${pkgs[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    echo "tests/run.sh: as root, slurm/cluster/start.sh will apt-get install (--no-install-recommends): ${missing[*]}"
  else
    echo "tests/run.sh: Debian packages already installed: ${pkgs[*]}"
  fi
  echo "tests/run.sh: and start, unless already running, a local 2-node Slurm cluster: munged, mariadbd" \
    "(--skip-networking), slurmdbd, slurmctld, slurmd -N n1, slurmd -N n2 (cluster a, state in" \
    "${MGPU_SLURM_DIR:-/var/tmp/mgpu-slurm}; '127.0.0.1 n1 n2' added to /etc/hosts if they do not resolve)"
  if [ ${#clusters[@]} -gt 1 ]; then
    echo "tests/run.sh: and two more beside it for the end-to-end lane's other streams: slurmctld, slurmd -N n3," \
      "slurmd -N n4 (cluster b, state in ${MGPU_SLURM_DIR:-/var/tmp/mgpu-slurm}-b) and slurmctld, slurmd -N n5," \
      "slurmd -N n6 (cluster c, in ${MGPU_SLURM_DIR:-/var/tmp/mgpu-slurm}-c); '127.0.0.1 n3 n4 n5 n6' added to" \
      "/etc/hosts likewise; they use cluster a's munged and slurmdbd"
  fi
  echo "tests/run.sh: they keep running after the tests: stop them with bash slurm/cluster/stop.sh"
  echo "tests/run.sh: to skip all of that and the real-Slurm tests: MGPU_SKIP_SLURM=1 bash tests/run.sh"
else
  echo "tests/run.sh: not root: no Slurm cluster is started; the real-Slurm tests (tests/e2e) skip with the reason" \
    "(with CI=true they fail). MGPU_SKIP_SLURM=1 leaves them out"
fi

# ----------------------------------------------------------------------------- doing it
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check -c constraints.txt -e '.[test]'
# The project's own modules byte-compiled once: the tests start about 2,000 Python processes, and where
# PYTHONDONTWRITEBYTECODE is set (as on these machines) each would compile what it imports of mgpu again.
.venv/bin/python -m compileall -q -j 0 mgpu jobs tests bench >/dev/null

if [ -n "$cluster" ]; then
  for name in "${clusters[@]}"; do
    if ! MGPU_SLURM_CLUSTER=$name slurm/cluster/start.sh; then
      echo "tests/run.sh: the local Slurm cluster $name did not start (see above)" >&2
      [ "${CI:-}" = true ] && exit 1
    fi
  done
fi

export OMP_NUM_THREADS=1
if [ -n "$skip_slurm" ] || [ $# -gt 0 ]; then
  echo "tests/run.sh: type checking mgpu/ and jobs/ (mypy)"
  .venv/bin/python -m mypy
  if [ -n "$skip_slurm" ]; then
    exec .venv/bin/python -m pytest --ignore=tests/e2e "$@"
  fi
  exec .venv/bin/python -m pytest "$@"
fi

# Two lanes at once: the end-to-end tests mostly wait on Slurm while the CPUs idle. The end-to-end lane, the
# longer one, starts first; the type checker runs beside it, and its failure ends the script (and that lane).
e2e_log=$(mktemp "${TMPDIR:-/tmp}/mgpu-e2e-lane.XXXXXX")
.venv/bin/python -m pytest "${streams[@]}" --durations=12 tests/e2e >"$e2e_log" 2>&1 &
e2e_pid=$!
trap 'kill "$e2e_pid" 2>/dev/null || true; rm -f "$e2e_log"' EXIT
echo "tests/run.sh: the end-to-end lane (pytest ${streams[*]} tests/e2e) runs beside this one; its output follows"
echo "tests/run.sh: type checking mgpu/ and jobs/ (mypy)"
if ! .venv/bin/python -m mypy; then
  echo "tests/run.sh: mypy failed: the end-to-end lane is stopped, the rest not run" >&2
  exit 1
fi
rc_rest=0
.venv/bin/python -m pytest --ignore=tests/e2e --durations=12 "${parallel[@]}" || rc_rest=$?
rc_e2e=0
wait "$e2e_pid" || rc_e2e=$?
echo
echo "tests/run.sh: exit status $rc_rest (pytest --ignore=tests/e2e, above) and $rc_e2e (pytest tests/e2e," \
  "run beside it, below)"
cat "$e2e_log"
[ "$rc_rest" = 0 ] && [ "$rc_e2e" = 0 ]
