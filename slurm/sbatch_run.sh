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
#   MAX_RESTARTS     torchrun --max-restarts      (default: 3): worker failures within one allocation
#   MAX_REQUEUES     how many times the job requeues itself at its time limit (default: 10)
#   RUN_DIR          the run directory, hydra.run.dir (default: outputs/$SLURM_JOB_ID, the same in every allocation)
#   RDZV_PORT        rendezvous port on the head node (default: 29500)
#   PYTHON           the Python that has torch, on every node (default: python3 on PATH)
# Any arguments are passed to main.py as Hydra overrides.
#
# Time limits and preemption: the job continues by itself.
# - Time limit: SLURM sends this script SIGUSR1 two minutes before the limit (--signal=B:USR1@120: change the lead
#   time with sbatch --signal=B:USR1@SECONDS; SLURM checks time limits every 30 s, so the signal may come up to 30 s
#   later). The script passes SIGTERM on to the workers, which finish the step, save a snapshot and exit (torchrun
#   kills workers that take more than 30 s: a save must fit in that); then, unless the training had reached its
#   end, it requeues the job (scontrol requeue), at most MAX_REQUEUES times (SLURM_RESTART_COUNT counts them). The
#   next allocation resumes from the snapshot and appends to the same output file (--open-mode=append).
# - Preemption (a cluster with PreemptMode=REQUEUE) and scancel: SLURM sends SIGTERM; the workers save a snapshot
#   and exit the same way. A preempted job is requeued by SLURM itself; a cancelled one stays cancelled.
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
#SBATCH --signal=B:USR1@120           # SIGUSR1 to this script 2 minutes before the time limit (see above)
#SBATCH --requeue                     # the job may be requeued: by this script at its time limit, on preemption
#SBATCH --open-mode=append            # each allocation appends to the output file instead of truncating it
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
MAX_REQUEUES=${MAX_REQUEUES:-10}
PYTHON=${PYTHON:-python3}
RUN_DIR=${RUN_DIR:-outputs/${SLURM_JOB_ID}}
RDZV_PORT=${RDZV_PORT:-29500}
HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)  # sed reads all: no SIGPIPE under pipefail

cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}"
echo "nodes=$NODES nproc_per_node=$NPROC_PER_NODE head=$HEAD_NODE:$RDZV_PORT snapshots=$SNAPSHOT_PATH" \
    "run_dir=$RUN_DIR allocation=$((${SLURM_RESTART_COUNT:-0} + 1))"

# Restarts: with its default shared store torchrun (torch 2.13) hands the workers the TCPStore of an agent and
# rebuilds that only in an agent's first round: a node whose agent joins a running job (a lost node's agent
# started again, or --nnodes=MIN:MAX) makes every agent fail, or leaves the nodes' workers waiting in different
# stores (docs/multinode.md). With TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 global rank 0's worker hosts a new
# store for each attempt instead. Restarts of the workers (--max-restarts) come back either way: main.py gives
# every attempt its own namespace in a shared store. srun passes the variable on to every node's torchrun.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1

# How the workers were stopped decides what follows. SIGUSR1 to this script (the time limit is near): the script
# sends SIGTERM to every process of the job's steps, on every node, as SLURM's own --signal=TERM would (srun itself
# answers SIGTERM with SIGKILL to its tasks); the job requeues. SIGTERM to this script (scancel): SLURM signals the
# steps itself and the job stays cancelled; the trap keeps the script alive while the workers save. SIGTERM to the
# steps alone (preemption in REQUEUE mode, within its GraceTime): the agents exit with 143 and the job requeues.
# srun runs in the background because bash runs a trap only once its foreground command has returned.
time_is_up=0
cancelled=0
trap 'time_is_up=1; echo "SIGUSR1, the time limit is near: stopping the workers (they save a snapshot)"
      scancel --signal=TERM "$SLURM_JOB_ID" || true' USR1
trap 'cancelled=1; echo "SIGTERM: the job is cancelled; the workers save a snapshot and exit"' TERM
started_at=$(date +%s)

# torchrun, by way of slurm/torchrun_agent.py: one line instead of a traceback when SLURM stops the job. --rdzv-id
# is the job id: every node (and every restart) joins the same rendezvous; RUN_DIR is the same on every node and in
# every allocation of the job.
srun --kill-on-bad-exit=0 "$PYTHON" slurm/torchrun_agent.py \
    --nnodes="$NODES" \
    --nproc-per-node="$NPROC_PER_NODE" \
    --rdzv-backend=c10d \
    --rdzv-endpoint="$HEAD_NODE:$RDZV_PORT" \
    --rdzv-id="$SLURM_JOB_ID" \
    --max-restarts="$MAX_RESTARTS" \
    main.py trainer_config.snapshot_path="$SNAPSHOT_PATH" hydra.run.dir="$RUN_DIR" "$@" &
srun_pid=$!
status=0
while :; do
    wait "$srun_pid" && status=0 || status=$?
    kill -0 "$srun_pid" 2>/dev/null || break  # still running: wait returned for a trapped signal
done

# Requeue if the workers were stopped (not failed, not cancelled) before the training's end: rank 0 writes
# summary.json ("finished") at the end of every run.
summary=$RUN_DIR/summary.json
if [[ -f "$summary" ]] && (( $(stat -c %Y "$summary") >= started_at )) && grep -q '"finished": true' "$summary"; then
    exit $(( status == 128 + 15 ? 0 : status ))  # stopped after the end is done; a failure after it is not
fi
if (( cancelled )) || ! (( time_is_up || status == 128 + 15 )); then
    exit "$status"
fi
requeues=${SLURM_RESTART_COUNT:-0}
if (( requeues >= MAX_REQUEUES )); then
    echo "error: not requeued: the job was requeued MAX_REQUEUES=$MAX_REQUEUES times already; sbatch it again" \
        "to continue from the snapshot" >&2
    exit 1
fi
echo "requeueing job $SLURM_JOB_ID ($((requeues + 1)) of MAX_REQUEUES=$MAX_REQUEUES): the next allocation resumes" \
    "from the snapshot in $SNAPSHOT_PATH"
scontrol requeue "$SLURM_JOB_ID"  # SLURM ends this allocation at once: nothing may follow
