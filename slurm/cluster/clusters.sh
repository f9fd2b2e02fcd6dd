# Which local test cluster start.sh, stop.sh and policy.sh act on (sourced by them; sets DIR and the rest).
#
#   MGPU_SLURM_CLUSTER=a (the default)  nodes n1, n2; state in $MGPU_SLURM_DIR (default /var/tmp/mgpu-slurm)
#   MGPU_SLURM_CLUSTER=b                nodes n3, n4; state in $MGPU_SLURM_DIR-b
#   MGPU_SLURM_CLUSTER=c                nodes n5, n6; state in $MGPU_SLURM_DIR-c
#
# Independent clusters on this one host let real-Slurm test streams run at once (tests/e2e under `pytest -n 3`, one
# worker per cluster): each has its own slurmctld, slurmd, partitions and preemption policy, so one stream's policy
# switch, drained node or `high` job that preempts "whatever fills the nodes" never reaches another's jobs. munged,
# mariadbd and slurmdbd are cluster a's and serve them all (slurmdbd keeps each cluster's accounting apart by its
# ClusterName). /etc/slurm/slurm.conf stays cluster a's: a client of b or c needs SLURM_CONF.

BASE_DIR=${MGPU_SLURM_DIR:-/var/tmp/mgpu-slurm}
OTHERS=(b c)                    # the clusters beside a (each uses a's shared daemons)
CLUSTER=${MGPU_SLURM_CLUSTER:-a}
# INDEX: the cluster's place among the three (its job ids: start.sh's aligned_job_id)
case $CLUSTER in
  a) DIR=$BASE_DIR CLUSTER_NAME=mgpu CTLD_PORT=6817 NODES=(n1 n2) NODE_PORTS=(6831 6832) INDEX=0 ;;
  b) DIR=$BASE_DIR-b CLUSTER_NAME=mgpub CTLD_PORT=6827 NODES=(n3 n4) NODE_PORTS=(6841 6842) INDEX=1 ;;
  c) DIR=$BASE_DIR-c CLUSTER_NAME=mgpuc CTLD_PORT=6837 NODES=(n5 n6) NODE_PORTS=(6851 6852) INDEX=2 ;;
  *) echo "$(basename "$0"): MGPU_SLURM_CLUSTER=$CLUSTER: a (nodes n1, n2), b (n3, n4) or c (n5, n6)" >&2; exit 2 ;;
esac
SHARED_DIR=$BASE_DIR            # cluster a's state dir: the pids of munged, mariadbd and slurmdbd
SHARED_CLUSTER_NAME=mgpu        # cluster a's ClusterName (its job table in the accounting DB)
NODELIST="n[${NODES[0]#n}-${NODES[-1]#n}]"
CONF=$DIR/etc/slurm.conf
