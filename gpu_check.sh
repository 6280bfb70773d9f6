#!/usr/bin/env bash
# The GPU checks of issue 28 as one script, for a machine with ONE NVIDIA GPU, its own CUDA build of torch (reached
# as `python3`; PYTHON=... names another interpreter) and no internet. Budget: 8 minutes wall time in all on an H100.
#
#   make gpu-wheels                      # once, on a machine with internet: .whl/ (Hydra, OmegaConf, antlr4; ~0.4 MB)
#   bash gpu_check.sh [OUT_DIR]          # on the GPU machine, .whl/ copied beside this script; OUT_DIR: gpu_check_out
#   FORCE=1 bash gpu_check.sh [OUT_DIR]  # delete the previous results in OUT_DIR first
#
# It stops at once (one `error:` line, exit 2) where torch has no CUDA device: a CPU build would train for hours.
# Hydra and OmegaConf, if that python cannot import them, are installed from .whl/ into a temporary folder on
# PYTHONPATH; the machine's own torch and packages are never touched. Each check prints `ok: ...`, or one
# `FAIL: ...: see LOG` line and the script exits 1. Everything lands in OUT_DIR (relative = to the project folder);
# an OUT_DIR that holds an earlier check's results is refused (exit 2), FORCE=1 deletes exactly those first.
#   (a) bench.py, 12 layers x 768, block 256, bf16, torch.compile: MFU > 0 against the GPU's datasheet bf16 peak
#       (PEAK_TFLOPS=... gives it instead)                                                      bench.json  ~90 s
#   (b) the default model (gpt2_train_cfg.yaml: 6 x 384, dropout 0.2) for TRAIN_STEPS=1500 steps, evaluated every
#       EVAL_EVERY=250: the best validation loss must be below VAL_BOUND=1.7 (nanoGPT's config reaches ~1.5 there,
#       its best is 1.4697; an untrained model is at ~4.2, one that ignores its context at ~2.5)        run/  ~60 s
#   (c) NCCL under torchrun (one process): SIGTERM after step 100 stops it with a snapshot; a rerun resumes from it
#                                                                                                 run-nccl/  ~50 s
#   (d) torchrun with one process more than the node's GPUs: a non-zero exit and exactly one `error: ...CUDA device`
#       line in the workers' stderr, no traceback                                                 run-nprocs/  ~20 s
#   (e) strategy=fsdp under torchrun (one process): 200 steps, a sharded snapshot every 100, the worker SIGKILLed
#       after step 150; the rerun resumes from snapshot-000000100.dcp and finishes                 run-fsdp/  ~60 s
# Then summary.json and a list of what one GPU cannot show. Each step has a time limit, and none may run past
# BUDGET_S=480 s from the start: a check that would is killed and reported as a FAIL.
#
# Knobs: BENCH_ARGS / TRAIN_ARGS add Hydra overrides (last: they win) to (a) / (b)-(e); PEAK_TFLOPS, TARGET (the
# loss whose first step is reported, 1.4697), TRAIN_STEPS, EVAL_EVERY, VAL_BOUND, BUDGET_S, FORCE, PYTHON.
# A developer's dry run of the logic on a CPU: GPU_CHECK_ALLOW_CPU=1 skips the CUDA gate and check (d), e.g.
#   GPU_CHECK_ALLOW_CPU=1 BUDGET_S=1800 TRAIN_STEPS=200 EVAL_EVERY=100 VAL_BOUND=3.3 PYTHON=.venv/bin/python \
#   BENCH_ARGS="gpt_config.n_layer=1 gpt_config.n_head=2 gpt_config.n_embd=32 parallel_config.compile=false
#   trainer_config.mixed_precision=fp32 trainer_config.batch_size=4" TRAIN_ARGS="gpt_config.n_layer=1
#   gpt_config.n_head=2 gpt_config.n_embd=32 trainer_config.mixed_precision=fp32 trainer_config.batch_size=4
#   data_config.truncate=0.05" bash gpu_check.sh /tmp/gpu_check_dry
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}
OUT=${1:-gpu_check_out}
PEAK_TFLOPS=${PEAK_TFLOPS:-}
TARGET=${TARGET:-1.4697}
TRAIN_STEPS=${TRAIN_STEPS:-1500}
EVAL_EVERY=${EVAL_EVERY:-250}
VAL_BOUND=${VAL_BOUND:-1.7}
BUDGET_S=${BUDGET_S:-480}
START=$SECONDS

# ---------------------------------------------------------------------------------------------- the CUDA gate
probe=$("$PYTHON" -c 'import torch
ok = torch.cuda.is_available()
print(torch.__version__, ok, torch.cuda.device_count() if ok else 0)' 2>/dev/null) || probe="?"
read -r TORCH_VERSION CUDA_OK GPUS <<<"$probe"
if [[ "$CUDA_OK" != True ]]; then
    if [[ "$TORCH_VERSION" == "?" ]]; then
        TORCH_VERSION="not importable by $PYTHON"
        CUDA_OK=False
    fi
    if [[ "${GPU_CHECK_ALLOW_CPU:-0}" != 1 ]]; then
        echo "error: gpu_check.sh needs a CUDA GPU and a CUDA build of torch (torch $TORCH_VERSION, cuda available:" \
            "$CUDA_OK)" >&2
        exit 2
    fi
    echo "GPU_CHECK_ALLOW_CPU=1: a developer's dry run on the CPU (torch $TORCH_VERSION): no GPU is checked"
    ON_GPU=0
else
    ON_GPU=1
    echo "ok: torch $TORCH_VERSION sees $GPUS CUDA device(s)"
fi

# ----------------------------------------------------------------------------------------- earlier results
RESULTS=("$OUT/install.log" "$OUT/bench.json" "$OUT/bench.log" "$OUT/run" "$OUT/snapshots" "$OUT/run-nccl"
         "$OUT/run-nprocs" "$OUT/run-fsdp" "$OUT/summary.json")
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

# ----------------------------------------------------------------------------------------------- helpers
SITE=""
cleanup() {  # on any exit: no run of ours left behind, no temporary packages
    local pid
    for pid in $(jobs -p); do
        kill -KILL "$pid" 2>/dev/null || true  # the agent; its workers die with it (orphans.py)
    done
    [[ -z "$SITE" ]] || rm -rf -- "$SITE"
}
trap cleanup EXIT

fail() {  # fail WHAT LOG
    echo "FAIL: $1: see $2" >&2
    exit 1
}

limit() {  # limit SECONDS: SECONDS, or less where the whole script's budget ends sooner
    local left=$((BUDGET_S - (SECONDS - START)))
    ((left < 1)) && left=1
    echo $(($1 < left ? $1 : left))
}

run_limited() {  # run_limited WHAT LOG SECONDS COMMAND...: run to the end (output to LOG), within its time limit
    local what=$1 log=$2 seconds rc=0
    seconds=$(limit "$3")
    shift 3
    timeout -k 10 "$seconds" "$@" >"$log" 2>&1 || rc=$?
    if ((rc == 124 || rc == 137)); then
        fail "$what did not finish within $seconds s (the script's budget: BUDGET_S=$BUDGET_S)" "$log"
    fi
    return "$rc"
}

wait_for_line() {  # wait_for_line PATTERN LOG PID SECONDS: until LOG has PATTERN (0), or PID ended / time is up (1)
    local deadline=$((SECONDS + $(limit "$4")))
    while ((SECONDS < deadline)); do
        grep -qs -- "$1" "$2" && return 0
        kill -0 "$3" 2>/dev/null || { grep -qs -- "$1" "$2"; return; }
        sleep 0.2
    done
    return 1
}

stop_job() {  # stop_job PID SIGNAL: send it (0: none), wait up to 60 s for the end, then SIGKILL; its exit status
    local waited=0 rc=0
    kill "-$2" "$1" 2>/dev/null || true
    while kill -0 "$1" 2>/dev/null && ((waited < 300)); do
        sleep 0.2
        waited=$((waited + 1))
    done
    kill -KILL "$1" 2>/dev/null || true
    wait "$1" 2>/dev/null || rc=$?  # (no "Killed" notice from bash)
    return "$rc"
}

children_of() {  # children_of PID: its direct children, from /proc (no procps on the machine needed)
    "$PYTHON" -c 'import os, sys
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        if open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1] == sys.argv[1]:
            print(pid)
    except (OSError, IndexError):
        pass' "$1"
}

check_py() {  # check_py WHAT LOG ARGS... <<'PY': that Python check's output (its ok: line), or FAIL with its reason
    local said last
    if said=$("$PYTHON" - "${@:3}" 2>&1); then
        echo "$said"
    else
        last=${said##*$'\n'}
        fail "$1 (${last#AssertionError: })" "$2"
    fi
}

TIMES=()  # "check=seconds", for summary.json
timed() {  # timed NAME SINCE
    TIMES+=("$1=$((SECONDS - $2))")
}

TORCHRUN=("$PYTHON" -m torch.distributed.run --standalone --nproc_per_node=1)

# ----------------------------------------------------------------------------- Hydra & co. from .whl/, if needed
if "$PYTHON" -c 'import hydra, omegaconf, antlr4' 2>/dev/null; then
    echo "ok: $PYTHON imports hydra, omegaconf and antlr4 already: nothing installed"
else
    wheels=(.whl/*.whl)
    if [[ ! -e "${wheels[0]}" ]]; then
        echo "error: $PYTHON cannot import hydra and .whl/ holds no wheels: run \`make gpu-wheels\` on a machine with" \
            "internet and copy .whl/ beside gpu_check.sh" >&2
        exit 2
    fi
    SITE=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check_site.XXXXXX")
    {
        if "$PYTHON" -m pip --version >/dev/null 2>&1; then
            "$PYTHON" -m pip install -q --no-index --no-deps --target "$SITE" "${wheels[@]}"
        else  # no pip in that environment: a pure-Python wheel is a zip of what goes onto sys.path
            for wheel in "${wheels[@]}"; do "$PYTHON" -m zipfile -e "$wheel" "$SITE"; done
        fi
    } >"$OUT/install.log" 2>&1 || fail "installing .whl/ into $SITE" "$OUT/install.log"
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    "$PYTHON" -c 'import hydra, omegaconf, antlr4' >>"$OUT/install.log" 2>&1 \
        || fail "hydra, omegaconf or antlr4 is still not importable after installing .whl/" "$OUT/install.log"
    echo "ok: installed ${#wheels[@]} wheels of .whl/ into $SITE (on PYTHONPATH; $PYTHON's own packages untouched)"
fi

# ------------------------------------------------------------------------------------------------- (a) bench
t0=$SECONDS
run_limited "bench.py" "$OUT/bench.log" 240 "$PYTHON" benchmarks/bench.py --steps 20 --warmup 10 \
    ${PEAK_TFLOPS:+--peak-tflops "$PEAK_TFLOPS"} --json "$OUT/bench.json" \
    gpt_config.n_layer=12 gpt_config.n_head=12 gpt_config.n_embd=768 gpt_config.dropout=0.0 data_config.block_size=256 \
    trainer_config.batch_size=64 trainer_config.mixed_precision=bf16 parallel_config.compile=true ${BENCH_ARGS:-} \
    || fail "bench.py exited with an error" "$OUT/bench.log"
check_py "bench.py's MFU is not above 0, or it ran on the CPU" "$OUT/bench.log" "$OUT/bench.json" "$ON_GPU" <<'PY'
import json, sys
b = json.load(open(sys.argv[1]))
assert b["mfu"] > 0, f"MFU {b['mfu']}"
assert b["device"] != "cpu" or sys.argv[2] != "1", "bench.py ran on the CPU"
print(f"ok: bench.py on {b['device']}: MFU {b['mfu']:.3f} against {b['peak_tflops_per_process']} TFLOP/s "
      f"({b['peak_source']}); {b['tokens_per_s']:,.0f} tokens/s, {b['step_ms_median']} ms/step")
PY
timed bench $t0

# ----------------------------------------------------------------------------------- (b) the default model
t0=$SECONDS
mkdir -p "$OUT/run"
run_limited "the training run" "$OUT/run/launch.log" 240 "$PYTHON" main.py trainer_config.max_steps="$TRAIN_STEPS" \
    trainer_config.eval_every_steps="$EVAL_EVERY" trainer_config.progress=lines \
    trainer_config.snapshot_path="$OUT/snapshots" hydra.run.dir="$OUT/run" ${TRAIN_ARGS:-} \
    || fail "the training run exited with an error" "$OUT/run/launch.log"
check_py "the training run's validation loss is not below VAL_BOUND=$VAL_BOUND" "$OUT/run/launch.log" \
    "$OUT/run/metrics.jsonl" "$TRAIN_STEPS" "$VAL_BOUND" "$TARGET" <<'PY'
import json, sys
path, steps, bound, target = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
rows = [json.loads(line) for line in open(path)]
val = [r for r in rows if "val_loss" in r]
best = min(val, key=lambda r: r["val_loss"])
assert max(r["step"] for r in rows) == steps, f"the run ended at step {max(r['step'] for r in rows)}, not {steps}"
assert best["val_loss"] < bound, f"best validation loss {best['val_loss']:.4f} at step {best['step']}"
hit = next((r for r in val if r["val_loss"] <= target), None)
print(f"ok: training: {steps} steps of the default model in {rows[-1]['elapsed_s']:.0f} s, best validation loss "
      f"{best['val_loss']:.4f} at step {best['step']} (< {bound}); {target} "
      + (f"first reached at step {hit['step']}" if hit else "not reached"))
PY
timed train $t0

# ----------------------------------------------------------------------------- (c) NCCL path, SIGTERM, resume
t0=$SECONDS
RUN="$OUT/run-nccl"
mkdir -p "$RUN"
NCCL_RUN=("${TORCHRUN[@]}" main.py trainer_config.max_steps=300 trainer_config.progress=lines
          trainer_config.log_every_steps=10 trainer_config.eval_every_steps=0
          trainer_config.snapshot_path="$RUN/snapshots" hydra.run.dir="$RUN" ${TRAIN_ARGS:-})
"${NCCL_RUN[@]}" >"$RUN/first.log" 2>&1 &
job=$!
wait_for_line "step 100/" "$RUN/first.log" "$job" 150 || fail "the torchrun run did not reach step 100" "$RUN/first.log"
stop_job "$job" TERM || true
grep -q "saved (stop requested" "$RUN/first.log" \
    || fail "the torchrun run did not stop with a snapshot after SIGTERM" "$RUN/first.log"
run_limited "the torchrun rerun" "$RUN/second.log" 120 "${NCCL_RUN[@]}" \
    || fail "the torchrun rerun exited with an error" "$RUN/second.log"
grep -q "resumed from" "$RUN/second.log" || fail "the torchrun rerun did not resume" "$RUN/second.log"
echo "ok: torchrun ($([[ $ON_GPU == 1 ]] && echo NCCL || echo gloo), one process): SIGTERM after step 100 stopped" \
    "it with a snapshot; the rerun resumed from it and finished"
timed nccl $t0

# ------------------------------------------------------------------------- (d) more processes than GPUs
t0=$SECONDS
RUN="$OUT/run-nprocs"
mkdir -p "$RUN"
if [[ $ON_GPU == 1 ]]; then
    rc=0
    run_limited "torchrun with $((GPUS + 1)) processes" "$RUN/launch.log" 120 "$PYTHON" -m torch.distributed.run \
        --standalone --nproc_per_node=$((GPUS + 1)) --log-dir "$RUN/workers" --redirects 3 main.py \
        trainer_config.max_steps=5 trainer_config.snapshot_path="$RUN/snapshots" hydra.run.dir="$RUN" ${TRAIN_ARGS:-} \
        || rc=$?
    ((rc != 0)) || fail "torchrun with $((GPUS + 1)) processes on $GPUS GPU(s) did not fail" "$RUN/launch.log"
    find "$RUN/workers" -name stderr.log -exec cat {} + >"$RUN/workers-stderr.log"
    matches=$(grep -c "error: .*CUDA device" "$RUN/workers-stderr.log" || true)
    if ((matches != 1)) || grep -q "Traceback" "$RUN/workers-stderr.log"; then
        fail "torchrun with $((GPUS + 1)) processes: $matches 'error: ...CUDA device' lines in the workers' stderr" \
            "(1 wanted), or a traceback" "$RUN/workers-stderr.log"
    fi
    echo "ok: torchrun with $((GPUS + 1)) processes on $GPUS GPU(s): exit $rc, one line:" \
        "$(grep "error: .*CUDA device" "$RUN/workers-stderr.log" | cut -c1-100)..."
    timed nprocs $t0
else
    echo "skipped: (d) more processes than GPUs needs a CUDA device"
fi

# ------------------------------------------------------------------------------ (e) FSDP, SIGKILL, resume
t0=$SECONDS
RUN="$OUT/run-fsdp"
mkdir -p "$RUN"
FSDP_RUN=("${TORCHRUN[@]}" main.py parallel_config.strategy=fsdp trainer_config.max_steps=200
          trainer_config.save_every_steps=100 trainer_config.eval_every_steps=100 trainer_config.progress=lines
          trainer_config.log_every_steps=10 trainer_config.snapshot_path="$RUN/snapshots" hydra.run.dir="$RUN"
          ${TRAIN_ARGS:-})
"${FSDP_RUN[@]}" >"$RUN/first.log" 2>&1 &
job=$!
wait_for_line "step 150/" "$RUN/first.log" "$job" 150 || fail "the FSDP run did not reach step 150" "$RUN/first.log"
for worker in $(children_of "$job"); do
    kill -KILL "$worker" 2>/dev/null || true  # the worker, as the OOM killer would
done
stop_job "$job" 0 || true  # torchrun sees its worker killed and ends
run_limited "the FSDP rerun" "$RUN/second.log" 120 "${FSDP_RUN[@]}" \
    || fail "the FSDP rerun exited with an error" "$RUN/second.log"
grep -q "resumed from .*snapshot-000000100.dcp" "$RUN/second.log" \
    || fail "the FSDP rerun did not resume from snapshot-000000100.dcp" "$RUN/second.log"
grep -q "step 200/" "$RUN/second.log" || fail "the FSDP rerun did not reach step 200" "$RUN/second.log"
echo "ok: strategy=fsdp: the worker SIGKILLed after step 150; the rerun resumed from snapshot-000000100.dcp (shards)" \
    "and finished 200 steps"
timed fsdp $t0

# -------------------------------------------------------------------------------------------------- summary
"$PYTHON" - "$OUT" "$TARGET" "$VAL_BOUND" "$TORCH_VERSION" "$ON_GPU" "$((SECONDS - START))" "${TIMES[@]}" <<'PY'
import json, sys
out, target, bound, torch_version, gpu, total, *times = sys.argv[1:]
rows = [json.loads(line) for line in open(f"{out}/run/metrics.jsonl")]
val = [r for r in rows if "val_loss" in r]
hit = next((r for r in val if r["val_loss"] <= float(target)), None)
bench = json.load(open(f"{out}/bench.json"))
summary = {
    "torch": torch_version, "device": bench["device"], "dry_run_on_cpu": gpu != "1",
    "bench_mfu": bench["mfu"], "bench_tokens_per_s": bench["tokens_per_s"], "bench_step_ms": bench["step_ms_median"],
    "bench_peak_tflops": bench["peak_tflops_per_process"], "bench_peak_source": bench["peak_source"],
    "train_steps": max(r["step"] for r in rows), "train_elapsed_s": rows[-1]["elapsed_s"],
    "val_bound": float(bound), "best_val_loss": min(r["val_loss"] for r in val),
    "target_val_loss": float(target), "target_reached_at_step": hit and hit["step"],
    "checks_passed": ["bench", "train", "torchrun-sigterm-resume"]
    + (["more-processes-than-gpus"] if gpu == "1" else []) + ["fsdp-sigkill-resume"],
    "seconds": {**{name: int(s) for name, s in (t.split("=") for t in times)}, "total": int(total)},
    "not_checked_with_one_gpu": [
        "NCCL all-reduce between 2+ ranks (DDP gradient averaging, bucket order)",
        "FSDP sharding across 2+ GPUs and its resharded resume",
        "sharded saves of ranks with LOCAL_RANK > 0 (the snapshot writer thread must not create a CUDA context "
        "on GPU 0)",
        "--nproc_per_node equal to the device count on a multi-GPU node",
    ],
}
json.dump(summary, open(f"{out}/summary.json", "w"), indent=2)
print(json.dumps(summary, indent=2))
print("not checked with one GPU:")
for item in summary["not_checked_with_one_gpu"]:
    print(f"  - {item}")
PY
echo "all checks passed in $((SECONDS - START)) s (budget $BUDGET_S s); results in $OUT"
