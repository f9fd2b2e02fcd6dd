#!/usr/bin/env bash
# Switch the preemption policy of the running test cluster:
#
#   slurm/cluster/policy.sh --grace N --user-signal yes|no
#
# --grace N          GraceTime of partition 'main' (the preemptable one), in seconds. With N > 0
#                    a preempted job gets only the user signal (or SIGTERM) first, SIGTERM/KILL
#                    after N s; with 0 everything arrives at once and Slurm requeues regardless.
# --user-signal yes  SlurmctldParameters=preempt_send_user_signal: at preemption Slurm also sends
#                    the job's --signal (e.g. USR2) -- what submitit's checkpoint handler needs.
# Default of the cluster (start.sh): --grace 0 --user-signal yes.
#
# Both knobs are written into slurm.conf (so a reconfigure or restart keeps them) and applied live. The cluster:
# MGPU_SLURM_CLUSTER (a, the default, b or c: clusters.sh); each has its own policy.
set -euo pipefail

# shellcheck source=clusters.sh
source "$(dirname "${BASH_SOURCE[0]}")/clusters.sh"  # DIR, CONF
export SLURM_CONF=$CONF
die() { echo "policy.sh: $*" >&2; exit 1; }
usage() { die "usage: policy.sh --grace N --user-signal yes|no"; }

grace="" signal=""
while (($#)); do
  case $1 in
    --grace) grace=${2:-}; shift 2 || usage ;;
    --user-signal) signal=${2:-}; shift 2 || usage ;;
    *) usage ;;
  esac
done
[[ $grace =~ ^[0-9]+$ && $signal =~ ^(yes|no)$ ]] || usage
[[ $(id -u) -eq 0 ]] || die "not root"
[[ -f $CONF ]] || die "no cluster config at $CONF (run start.sh)"
timeout 10 scontrol ping >/dev/null 2>&1 || die "slurmctld does not answer (run start.sh)"

# --- rewrite slurm.conf: SlurmctldParameters (other parameters kept) and main's GraceTime
params=$(sed -n 's/^SlurmctldParameters=//p' "$CONF" | tr ',' '\n' | grep -v -e '^preempt_send_user_signal$' -e '^$' | paste -sd, || true)
[[ $signal == yes ]] && params=${params:+$params,}preempt_send_user_signal
# An empty "SlurmctldParameters=" is not valid: the line is then a comment (keeping its place).
if [[ -n $params ]]; then line="SlurmctldParameters=$params"; else line="#SlurmctldParameters="; fi
tmp=$(mktemp "$CONF.XXXXXX")
sed -E -e "s|^#?SlurmctldParameters=.*$|$line|" \
  -e "/^PartitionName=main /s/GraceTime=[0-9]+/GraceTime=$grace/" "$CONF" >"$tmp"
grep -q "^#\?SlurmctldParameters=" "$tmp" || echo "$line" >>"$tmp"
chmod 644 "$tmp" && mv "$tmp" "$CONF"

ctld_params() { scontrol show config | sed -n 's/^SlurmctldParameters *= *//p'; }
has_signal() { [[ $(ctld_params) == *preempt_send_user_signal* ]]; }
effective() { if has_signal; then [[ $signal == yes ]]; else [[ $signal == no ]]; fi; }

scontrol reconfigure || die "scontrol reconfigure failed"
if ! effective; then
  # Reconfigure did not pick it up: restart slurmctld (state is saved; jobs survive).
  echo "reconfigure did not apply SlurmctldParameters; restarting slurmctld" >&2
  pid=$(<"$DIR/pids/slurmctld.pid")
  [[ $(cat "/proc/$pid/comm" 2>/dev/null) == slurmctld ]] || die "recorded slurmctld pid $pid is not slurmctld"
  kill -TERM "$pid"
  for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
  kill -0 "$pid" 2>/dev/null && die "slurmctld (pid $pid) did not exit in 20s"
  rm -f "$DIR/run/slurmctld.pid"
  slurmctld -f "$CONF" || die "slurmctld failed to restart"
  for _ in $(seq 100); do [[ -s $DIR/run/slurmctld.pid ]] && timeout 5 scontrol ping >/dev/null 2>&1 && break; sleep 0.2; done
  timeout 5 scontrol ping >/dev/null 2>&1 || die "slurmctld does not answer after restart"
  cat "$DIR/run/slurmctld.pid" >"$DIR/pids/slurmctld.pid"
  effective || die "SlurmctldParameters still '$(ctld_params)' after restart"
fi
# The conf already says so; the live update makes it explicit and is what other tools do.
scontrol update PartitionName=main GraceTime="$grace"

got_grace=$(scontrol show partition main | sed -nE 's/.*GraceTime=([0-9]+).*/\1/p')
[[ $got_grace == "$grace" ]] || die "GraceTime of main is '$got_grace', wanted $grace"
echo "policy: partition main GraceTime=$got_grace; SlurmctldParameters=$(ctld_params)" \
  "(preempt_send_user_signal: $signal)"
