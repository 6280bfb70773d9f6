#!/usr/bin/env bash
# The GPU checks of the speed issue, as one script for a machine with one NVIDIA GPU (written for an H200).
#
#   bash gpu_check.sh [OUT_DIR]          # default OUT_DIR: gpu_check_out (relative = to the project folder)
#   FORCE=1 bash gpu_check.sh [OUT_DIR]  # delete the previous results in OUT_DIR first
#
# OUT_DIR must not hold results of an earlier check (bench.json, run/, snapshots/, run-nccl/, summary.json): the
# training run would resume its snapshots and append to its metrics. The script then stops with one line and exit
# code 2; FORCE=1 deletes exactly those entries (nothing else in OUT_DIR) and starts afresh.
# 1. bench.py: 12 layers x 768 wide, block 256, bf16, torch.compile; MFU against the GPU's dense bf16 datasheet
#    peak (bench.py knows H100/H200/GH200/A100, e.g. 989 TFLOP/s for an H200 SXM, and measures a matmul for
#    others); PEAK_TFLOPS=... gives the peak per GPU instead. bench.json's peak_source says which was used.
# 2. The default gpt2_train_cfg.yaml model on the one GPU, evaluated every 250 steps: the elapsed training time at
#    which the validation loss first reaches nanoGPT's best tiny-shakespeare result, 1.4697 (TARGET=...).
# 3. The NCCL code paths under torchrun (one process): StopVote's device all-reduce every step, the failure watch,
#    the end together; SIGTERM after step 100 must stop it after the next step with a snapshot (run-nccl/). The
#    worker runs as a fork of the fork server (forkserver.py): no refusal line may appear, CUDA starts in the fork.
# 4. strategy=fsdp on the GPU (FSDP2 over a group of one under torchrun, NCCL, bf16 parameters / fp32 reduction):
#    bench.py of the step-1 model under ddp, fsdp and fsdp + activation_checkpointing=blocks, each with 2 sharded
#    or single-file saves (bench-ddp.json, bench-fsdp.json, bench-fsdp-ac.json: state_bytes_per_rank, CUDA max
#    allocated, save times); then 200 steps of the default model under fsdp with a sharded snapshot every 100,
#    SIGKILLed after step 150 and run again: it must resume from its shards and finish (run-fsdp/).
# Everything lands in OUT_DIR (bench*.json, run/, snapshots/, run-nccl/, run-fsdp/, summary.json). BENCH_ARGS / TRAIN_ARGS
# add overrides, e.g. a tiny model to try the script on a CPU: BENCH_ARGS="gpt_config.n_layer=2 gpt_config.n_embd=64
# gpt_config.n_head=2 trainer_config.compile=false trainer_config.mixed_precision=fp32 trainer_config.batch_size=4"
# TRAIN_ARGS=...
set -euo pipefail
cd "$(dirname "$0")"
OUT=${1:-gpu_check_out}
PEAK_TFLOPS=${PEAK_TFLOPS:-}
TARGET=${TARGET:-1.4697}
PYTHON=${PYTHON:-python}
RESULTS=("$OUT/bench.json" "$OUT/run" "$OUT/snapshots" "$OUT/run-nccl" "$OUT/summary.json" "$OUT/bench-ddp.json"
         "$OUT/bench-fsdp.json" "$OUT/bench-fsdp-ac.json" "$OUT/run-fsdp")
for used in "${RESULTS[@]}"; do
    if [[ -e "$used" ]]; then
        if [[ "${FORCE:-0}" != 1 ]]; then
            echo "error: $OUT already holds an earlier check ($used): use another OUT_DIR, or FORCE=1 to" \
                "delete its results" >&2
            exit 2
        fi
        echo "FORCE=1: deleting the earlier results in $OUT"
        rm -rf -- "${RESULTS[@]}"
        break
    fi
done
mkdir -p "$OUT"
"$PYTHON" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')"

"$PYTHON" bench.py --steps 30 --warmup 10 ${PEAK_TFLOPS:+--peak-tflops "$PEAK_TFLOPS"} --json "$OUT/bench.json" \
    gpt_config.n_layer=12 gpt_config.n_head=12 gpt_config.n_embd=768 gpt_config.dropout=0.0 data_config.block_size=256 \
    trainer_config.batch_size=64 trainer_config.mixed_precision=bf16 trainer_config.compile=true ${BENCH_ARGS:-}

"$PYTHON" main.py trainer_config.max_steps=5000 trainer_config.eval_every_steps=250 trainer_config.progress=lines \
    trainer_config.snapshot_path="$OUT/snapshots" hydra.run.dir="$OUT/run" ${TRAIN_ARGS:-}

# wait_for_line PATTERN LOG PID TRIES: until LOG has PATTERN, PID has ended, or TRIES x 0.5 s have passed
wait_for_line() {
    for _ in $(seq "$4"); do
        grep -q "$1" "$2" && return
        kill -0 "$3" 2>/dev/null || return
        sleep 0.5
    done
}

mkdir -p "$OUT/run-nccl"
"$PYTHON" -m torch.distributed.run --standalone --nproc_per_node=1 main.py ${TRAIN_ARGS:-} trainer_config.max_steps=100000 \
    trainer_config.progress=lines trainer_config.log_every_steps=10 trainer_config.eval_every_steps=0 \
    trainer_config.snapshot_path="$OUT/run-nccl/snapshots" hydra.run.dir="$OUT/run-nccl" \
    > "$OUT/run-nccl/launch.log" 2>&1 &
NCCL_JOB=$!
wait_for_line "step 100/" "$OUT/run-nccl/launch.log" "$NCCL_JOB" 600
kill -TERM "$NCCL_JOB" 2>/dev/null || true
wait "$NCCL_JOB" || true
grep -q "saved (stop requested" "$OUT/run-nccl/launch.log" && echo "NCCL run: stopped by SIGTERM with a snapshot" \
    || { echo "error: the NCCL run did not stop with a snapshot: see $OUT/run-nccl/launch.log" >&2; exit 1; }
if grep -q "forkserver:" "$OUT/run-nccl/launch.log"; then  # a refusal (CUDA touched while the server imported?)
    echo "error: the fork server did not serve the CUDA worker: see $OUT/run-nccl/launch.log" >&2; exit 1
fi
echo "NCCL run: the worker was a fork of torchrun's fork server (forkserver.py), CUDA first initialised in the fork"

BIG="gpt_config.n_layer=12 gpt_config.n_head=12 gpt_config.n_embd=768 gpt_config.dropout=0.0 trainer_config.batch_size=64
     trainer_config.mixed_precision=bf16"
for variant in "ddp:trainer_config.strategy=ddp" "fsdp:trainer_config.strategy=fsdp" \
               "fsdp-ac:trainer_config.strategy=fsdp trainer_config.activation_checkpointing=blocks"; do
    "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node=1 bench.py --steps 20 --warmup 5 --snapshots 2 \
        --json "$OUT/bench-${variant%%:*}.json" $BIG ${variant#*:} trainer_config.snapshot_path="$OUT/bench-snapshots-${variant%%:*}" \
        ${BENCH_ARGS:-}
done
mkdir -p "$OUT/run-fsdp"
FSDP_RUN=(-m torch.distributed.run --standalone --nproc_per_node=1 main.py trainer_config.strategy=fsdp
          trainer_config.max_steps=200 trainer_config.save_every_steps=100 trainer_config.eval_every_steps=100
          trainer_config.progress=lines trainer_config.log_every_steps=10
          trainer_config.snapshot_path="$OUT/run-fsdp/snapshots" hydra.run.dir="$OUT/run-fsdp" ${TRAIN_ARGS:-})
"$PYTHON" "${FSDP_RUN[@]}" > "$OUT/run-fsdp/first.log" 2>&1 &
FSDP_JOB=$!
wait_for_line "step 150/" "$OUT/run-fsdp/first.log" "$FSDP_JOB" 1200
pkill -KILL -P "$FSDP_JOB" 2>/dev/null || true  # the worker, as the OOM killer would
kill -KILL "$FSDP_JOB" 2>/dev/null || true
wait "$FSDP_JOB" || true
"$PYTHON" "${FSDP_RUN[@]}" > "$OUT/run-fsdp/second.log" 2>&1 \
    || { echo "error: the FSDP rerun failed: see $OUT/run-fsdp/second.log" >&2; exit 1; }
grep -q "resumed from .*snapshot-000000100.dcp" "$OUT/run-fsdp/second.log" && echo "FSDP run: resumed from its shards" \
    || { echo "error: the FSDP rerun did not resume from its shards: see $OUT/run-fsdp/second.log" >&2; exit 1; }

"$PYTHON" - "$OUT" "$TARGET" <<'PY'
import json, sys
out, target = sys.argv[1], float(sys.argv[2])
rows = [json.loads(line) for line in open(f"{out}/run/metrics.jsonl")]
val = [r for r in rows if "val_loss" in r]
hit = next((r for r in val if r["val_loss"] <= target), None)
bench = json.load(open(f"{out}/bench.json"))
summary = {
    "bench_mfu": bench["mfu"], "bench_tokens_per_s": bench["tokens_per_s"], "bench_step_ms": bench["step_ms_median"],
    "bench_peak_tflops": bench["peak_tflops_per_process"], "bench_peak_source": bench["peak_source"],
    "target_val_loss": target, "best_val_loss": min(r["val_loss"] for r in val),
    "reached_at_step": hit and hit["step"], "reached_after_s": hit and hit["elapsed_s"],
}
for variant in ("ddp", "fsdp", "fsdp-ac"):
    b = json.load(open(f"{out}/bench-{variant}.json"))
    summary[variant] = {"step_ms": b["step_ms_median"], "state_bytes_per_rank": b["state_bytes_per_rank"]["total"],
                        "peak_memory_bytes": b["peak_memory_bytes"], "save_s": b["snapshot"]["written_s_median"]}
json.dump(summary, open(f"{out}/summary.json", "w"), indent=2)
print(json.dumps(summary, indent=2))
PY
