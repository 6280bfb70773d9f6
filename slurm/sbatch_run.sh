#!/bin/bash
# Multi-node training on SLURM: one torchrun agent per node, meeting through c10d rendezvous on the first node.
#
#   sbatch --nodes=4 --gpus-per-node=8 slurm/sbatch_run.sh                        # defaults below
#   SNAPSHOT_PATH=s3://bucket/run1/ sbatch --nodes=2 slurm/sbatch_run.sh trainer_config.max_epochs=20
#
# Parameters (environment variables, or edit the defaults here):
#   NODES            number of nodes              (default: $SLURM_JOB_NUM_NODES, i.e. sbatch --nodes)
#   NPROC_PER_NODE   worker processes per node    (default: one per GPU SLURM allocated on the node:
#                    $SLURM_GPUS_ON_NODE, else the entries of $CUDA_VISIBLE_DEVICES; no GPUs = refused)
#   GPUS_PER_NODE    the same as NPROC_PER_NODE (its older name)
#   SNAPSHOT_PATH    trainer_config.snapshot_path (default: snapshots/slurm-$SLURM_JOB_NAME; shared storage or S3!)
#   MAX_RESTARTS     torchrun --max-restarts      (default: 3)
#   RDZV_PORT        rendezvous port on the head node (default: 29500)
# Any arguments are passed to main.py as Hydra overrides.
#
# Network and NCCL settings users typically need (set them in the environment before sbatch):
#   NCCL_DEBUG=INFO             print NCCL's choice of transport and interfaces (WARN once it works)
#   NCCL_SOCKET_IFNAME=ib0      the interface NCCL and gloo bootstrap over (e.g. ib0, eth0, ^docker,lo)
#   GLOO_SOCKET_IFNAME=ib0      the same for gloo (all of a CPU job's collectives)
#   NCCL_IB_DISABLE=1           only if InfiniBand is present but broken
# Snapshots must go to storage every node can read (a shared file system or S3): after a node is lost, the
# restarted job may have global rank 0 on another node.
# GPUs: the --gpus-per-node line below asks for 4 per node; change it to your nodes' count (or pass sbatch
# --gpus-per-node=N). Without GPUs SLURM gives the job none (some sites then hide every GPU) and the script
# refuses to start. CPU-only cluster: delete that line and set NPROC_PER_NODE (e.g. NPROC_PER_NODE=8 sbatch ...).
#
#SBATCH --job-name=mingpt-ddp
#SBATCH --gpus-per-node=4             # GPUs per node: change to what your nodes have; one worker per GPU
#SBATCH --ntasks-per-node=1           # one torchrun agent per node; it starts NPROC_PER_NODE workers
#SBATCH --exclusive
#SBATCH --signal=TERM@120             # SIGTERM 2 minutes before the time limit: workers snapshot and exit
#SBATCH --output=%x-%j.out

set -euo pipefail

NODES=${NODES:-${SLURM_JOB_NUM_NODES:-1}}
# Workers per node: as set, else one per GPU allocated on this node (the nodes of a --gpus-per-node job all get
# the same number). CUDA_VISIBLE_DEVICES is counted only where SLURM_GPUS_ON_NODE is not set (older SLURM or a
# site's own GPU plugin); "NoDevFiles" is what some SLURM versions put there when no GPU was allocated.
NPROC_PER_NODE=${NPROC_PER_NODE:-${GPUS_PER_NODE:-}}
if [[ -z "$NPROC_PER_NODE" ]]; then
    if [[ -n "${SLURM_GPUS_ON_NODE:-}" ]]; then
        NPROC_PER_NODE=$SLURM_GPUS_ON_NODE
    elif [[ -n "${CUDA_VISIBLE_DEVICES:-}" && "$CUDA_VISIBLE_DEVICES" != NoDevFiles \
            && "$CUDA_VISIBLE_DEVICES" != -1* ]]; then
        IFS=, read -ra visible_gpus <<< "$CUDA_VISIBLE_DEVICES"
        NPROC_PER_NODE=${#visible_gpus[@]}
    else
        NPROC_PER_NODE=0
    fi
    if [[ "$NPROC_PER_NODE" == 0 ]]; then
        echo "error: SLURM allocated no GPUs on this node: request them (sbatch --gpus-per-node=N), or set" \
            "NPROC_PER_NODE=N to run N CPU workers per node" >&2
        exit 2
    fi
fi
if ! [[ "$NPROC_PER_NODE" =~ ^[1-9][0-9]*$ ]]; then
    echo "error: NPROC_PER_NODE (or GPUS_PER_NODE) must be a positive whole number, got '$NPROC_PER_NODE'" >&2
    exit 2
fi
if [[ "${SLURM_GPUS_ON_NODE:-0}" =~ ^[1-9][0-9]*$ ]] && (( NPROC_PER_NODE > SLURM_GPUS_ON_NODE )); then
    echo "error: NPROC_PER_NODE=$NPROC_PER_NODE workers per node, but SLURM allocated $SLURM_GPUS_ON_NODE GPUs" \
        "per node (one worker per GPU)" >&2
    exit 2
fi
SNAPSHOT_PATH=${SNAPSHOT_PATH:-snapshots/slurm-${SLURM_JOB_NAME:-mingpt-ddp}}
MAX_RESTARTS=${MAX_RESTARTS:-3}
RDZV_PORT=${RDZV_PORT:-29500}
HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)  # sed reads all: no SIGPIPE under pipefail

cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}"
echo "nodes=$NODES nproc_per_node=$NPROC_PER_NODE head=$HEAD_NODE:$RDZV_PORT snapshots=$SNAPSHOT_PATH"

# Restarts: with its default shared store torchrun (torch 2.13) hands the workers the TCPStore of an agent and
# rebuilds that only in an agent's first round: a node whose agent joins a running job (a lost node's agent
# started again, or --nnodes=MIN:MAX) makes every agent fail, or leaves the nodes' workers waiting in different
# stores (README: Several nodes). With TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 global rank 0's worker hosts a new
# store for each attempt instead. Restarts of the workers (--max-restarts) come back either way: main.py gives
# every attempt its own namespace in a shared store. srun passes the variable on to every node's torchrun.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1

# --rdzv-id is the job id: every node (and every restart) joins the same rendezvous, and the run directory
# (outputs/<run id>) is the same on every node.
srun --kill-on-bad-exit=0 torchrun \
    --nnodes="$NODES" \
    --nproc-per-node="$NPROC_PER_NODE" \
    --rdzv-backend=c10d \
    --rdzv-endpoint="$HEAD_NODE:$RDZV_PORT" \
    --rdzv-id="$SLURM_JOB_ID" \
    --max-restarts="$MAX_RESTARTS" \
    main.py trainer_config.snapshot_path="$SNAPSHOT_PATH" "$@"
