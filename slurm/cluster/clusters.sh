# Which local test cluster start.sh, stop.sh and policy.sh act on (sourced by them; sets DIR and the rest).
#
#   MGPU_SLURM_CLUSTER=a (the default)  nodes n1, n2; state in $MGPU_SLURM_DIR (default /var/tmp/mgpu-slurm)
#   MGPU_SLURM_CLUSTER=b                nodes n3, n4; state in $MGPU_SLURM_DIR-b
#
# Two independent clusters on this one host let two real-Slurm test streams run at once (tests/e2e under
# `pytest -n 2`, one worker per cluster): each has its own slurmctld, slurmd, partitions and preemption policy, so
# one stream's policy switch, drained node or `high` job that preempts "whatever fills the nodes" never reaches the
# other's jobs. munged, mariadbd and slurmdbd are cluster a's and serve both (slurmdbd keeps each cluster's
# accounting apart by its ClusterName). /etc/slurm/slurm.conf stays cluster a's: a client of b needs SLURM_CONF.

BASE_DIR=${MGPU_SLURM_DIR:-/var/tmp/mgpu-slurm}
B_DIR=$BASE_DIR-b
CLUSTER=${MGPU_SLURM_CLUSTER:-a}
case $CLUSTER in
  a) DIR=$BASE_DIR CLUSTER_NAME=mgpu CTLD_PORT=6817 NODES=(n1 n2) NODE_PORTS=(6831 6832) ;;
  b) DIR=$B_DIR CLUSTER_NAME=mgpub CTLD_PORT=6827 NODES=(n3 n4) NODE_PORTS=(6841 6842) ;;
  *) echo "$(basename "$0"): MGPU_SLURM_CLUSTER=$CLUSTER: a (nodes n1, n2) or b (nodes n3, n4)" >&2; exit 2 ;;
esac
SHARED_DIR=$BASE_DIR            # cluster a's state dir: the pids of munged, mariadbd and slurmdbd
SHARED_CLUSTER_NAME=mgpu        # cluster a's ClusterName (its job table in the accounting DB)
NODELIST="n[${NODES[0]#n}-${NODES[-1]#n}]"
CONF=$DIR/etc/slurm.conf
