#!/usr/bin/env bash
# Set up and run the whole test suite: the README's test command, and what CI runs.
#   bash tests/run.sh [pytest args...]
# Creates .venv (torch pinned by constraints.txt to the CPU build), starts the local Slurm test
# cluster when running as root (slurm/cluster/start.sh installs Debian's slurm-wlm on first use),
# then runs pytest. Without root the real-Slurm tests skip with the reason; with CI=true they fail.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check -c constraints.txt -e '.[test]'

if [ "$(id -u)" = 0 ] && [ -x slurm/cluster/start.sh ]; then
  if ! slurm/cluster/start.sh; then
    echo "tests/run.sh: the local Slurm cluster did not start (see above)" >&2
    [ "${CI:-}" = true ] && exit 1
  fi
fi

export OMP_NUM_THREADS=1
exec .venv/bin/python -m pytest "$@"
