#!/bin/bash
# Multi-node training on SLURM: one torchrun agent per node, meeting through c10d rendezvous on the first node.
#
#   sbatch --nodes=4 --gpus-per-node=8 slurm/sbatch_run.sh                        # defaults below
#   SNAPSHOT_PATH=s3://bucket/run1/ sbatch --nodes=2 slurm/sbatch_run.sh trainer_config.max_epochs=20
#
# Parameters (environment variables, or edit the defaults here):
#   NODES            number of nodes              (default: $SLURM_JOB_NUM_NODES, i.e. sbatch --nodes)
#   GPUS_PER_NODE    processes (GPUs) per node    (default: $SLURM_GPUS_ON_NODE, else 8)
#   SNAPSHOT_PATH    trainer_config.snapshot_path (default: snapshots/slurm-$SLURM_JOB_NAME; shared storage or S3!)
#   MAX_RESTARTS     torchrun --max-restarts      (default: 3)
#   RDZV_PORT        rendezvous port on the head node (default: 29500)
# Any arguments are passed to main.py as Hydra overrides.
#
# Network and NCCL settings users typically need (set them in the environment before sbatch):
#   NCCL_DEBUG=INFO             print NCCL's choice of transport and interfaces (WARN once it works)
#   NCCL_SOCKET_IFNAME=ib0      the interface NCCL and gloo bootstrap over (e.g. ib0, eth0, ^docker,lo)
#   GLOO_SOCKET_IFNAME=ib0      the same for gloo (used for the CPU control group and on CPU nodes)
#   NCCL_IB_DISABLE=1           only if InfiniBand is present but broken
# Snapshots must go to storage every node can read (a shared file system or S3): after a node is lost, the
# restarted job may have global rank 0 on another node.
#
#SBATCH --job-name=mingpt-ddp
#SBATCH --ntasks-per-node=1           # one torchrun agent per node; it starts GPUS_PER_NODE workers
#SBATCH --exclusive
#SBATCH --signal=TERM@120             # SIGTERM 2 minutes before the time limit: workers snapshot and exit
#SBATCH --output=%x-%j.out

set -euo pipefail

NODES=${NODES:-${SLURM_JOB_NUM_NODES:-1}}
GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
SNAPSHOT_PATH=${SNAPSHOT_PATH:-snapshots/slurm-${SLURM_JOB_NAME:-mingpt-ddp}}
MAX_RESTARTS=${MAX_RESTARTS:-3}
RDZV_PORT=${RDZV_PORT:-29500}
HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)

cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}"
echo "nodes=$NODES gpus_per_node=$GPUS_PER_NODE head=$HEAD_NODE:$RDZV_PORT snapshots=$SNAPSHOT_PATH"

# Restarts: torchrun keeps one rendezvous TCPStore for all restarts of the job, so a restarted worker can read a
# peer's address left by the previous attempt (gloo "Connection refused", NCCL connect errors) and the restart
# is lost. main.py (setup_distributed) gives every attempt a fresh namespace in that store, so nothing needs to
# be set here. TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (rank 0's worker hosting a new store each attempt) is no
# longer needed; it does no harm if your site sets it.

# --rdzv-id is the job id: every node (and every restart) joins the same rendezvous, and the run directory
# (outputs/<run id>) is the same on every node.
srun --kill-on-bad-exit=0 torchrun \
    --nnodes="$NODES" \
    --nproc-per-node="$GPUS_PER_NODE" \
    --rdzv-backend=c10d \
    --rdzv-endpoint="$HEAD_NODE:$RDZV_PORT" \
    --rdzv-id="$SLURM_JOB_ID" \
    --max-restarts="$MAX_RESTARTS" \
    main.py trainer_config.snapshot_path="$SNAPSHOT_PATH" "$@"
