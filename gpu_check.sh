#!/usr/bin/env bash
# The GPU checks of issues 28 and 42 as one script, for a machine with ONE NVIDIA GPU, its own CUDA build of torch
# (reached as `python3`; PYTHON=... names another interpreter) and no internet, such as a lent machine that runs one
# command in a copy of the working tree and brings back the files of one folder. Budget: 8 minutes wall time in all
# on an H100, torch.compile's warm-ups included (the times below are estimates: not yet run on a GPU).
#
#   bash gpu_check.sh "$OUT"             # OUT_DIR (default gpu_check_out; relative = to the project folder) ends
#                                        # holding gpu_check.tar.gz (every log) and summary.json, nothing else
#   FORCE=1 bash gpu_check.sh OUT_DIR    # delete an earlier check's results in OUT_DIR first
#
# It stops at once (one `error:` line, exit 2) where torch has no CUDA device: a CPU build would train for hours.
# Hydra, OmegaConf and antlr4, where that python cannot import them (or not hydra-core 1.3 and omegaconf 2.3), are
# installed from the wheels committed in .gpu-wheels/ (pure Python, 0.4 MB; `make gpu-wheels` rebuilds them) into a
# temporary folder first on PYTHONPATH; the machine's own torch and packages are never touched. Each check prints `ok: ...` (or `skipped: ...` and why), or one
# `FAIL: ...: see LOG` line and the script exits 1. Logs go to OUT_DIR/gpu_check/ while it runs; on any exit after
# the gate (a FAIL, a signal) they are packed into OUT_DIR/gpu_check.tar.gz beside summary.json (passed, the failure,
# each check's line and seconds). Snapshots (~130 MB each) and every temporary file go to one scratch folder outside
# OUT_DIR, deleted at the end.
#   (a) bench.py, 12 layers x 768, block 256, batch 64, bf16, torch.compile: bf16, dynamo and inductor (their log
#       lines) and an MFU against the GPU's datasheet bf16 peak (PEAK_TFLOPS=... gives it) of at least MFU_FLOOR:
#       by default 0.2 on an H100/H200, on other GPUs only above 0                                  bench/  ~90 s
#   (b) the default model (gpt2_train_cfg.yaml: 6 x 384, dropout 0.2) for TRAIN_STEPS=1500 steps, evaluated every
#       EVAL_EVERY=250: the best validation loss must be below VAL_BOUND=1.7 (nanoGPT's config reaches ~1.5 there,
#       its best is 1.4697; an untrained model is at ~4.2, one that ignores its context at ~2.5)       train/  ~60 s
#   (c) NCCL under torchrun (one process), a 5,000-step run: SIGTERM once step 100 is logged stops it mid-training
#       with a snapshot; a rerun resumes from that step and trains 50 more                          sigterm/  ~40 s
#   (d) torchrun with one process more than the node's GPUs: a non-zero exit and exactly one `error: ...CUDA device`
#       line in the workers' stderr, no traceback                                                   nprocs/  ~20 s
#   (e) strategy=fsdp under torchrun (one process), a 5,000-step run with a sharded snapshot every 100 steps: the
#       worker is SIGKILLed once the log says the step-100 snapshot is saved (it is written in the background); the
#       rerun resumes from the newest complete snapshot (the last one logged as saved, or the one after it) and
#       trains to 150 steps past the last one logged                                              fsdp-kill/  ~45 s
#   (f)-(j) FEATURE_STEPS=100 steps each, one process each, started before (c) and run beside (c)-(e), JOBS at a
#       time (8 on a GPU, 2 on a CPU; 1 where nvidia-smi reports an exclusive compute mode, and then after (e)).
#       Each must finish, keep its losses finite, end with a training loss at least 5% below its first logged one,
#       and show its feature on:
#       (f) compile under DDP (torchrun): dynamo compiled graphs, inductor their forward and backward   compile-ddp/
#       (g) compile under FSDP (torchrun), the same                                                   compile-fsdp/
#       (h) mixed_precision=fp16: the plan line says float16, every metrics row has the scaler's loss_scale     fp16/
#       (i) activation_checkpointing=blocks, and bench.py with and without it: on a GPU, peak CUDA memory with it
#           below 0.8 x without (on a CPU bench.py reports the whole process's peak RSS: not compared)
#                                                                            activation-checkpointing/, ac-bench-*/
#       (j) optimizer_config.name=muon: the final snapshot holds Muon's momentum buffers for the blocks' matrices
#           and AdamW's moments for the rest                                           muon/  ~90 s beside (c)-(e)
# FSDP ((e), (g)) needs torch 2.7 (mingpt/compat.py FSDP_TORCH) and Muon ((j)) torch.optim.Muon (2.9): with an older
# torch they are reported as skipped, with the reason. Then summary.json and a list of what one GPU cannot show. Each
# step has a time limit, and none may run past BUDGET_S=480 s from the start: a check that would is killed and
# reported as a FAIL.
#
# Knobs: BENCH_ARGS / TRAIN_ARGS add Hydra overrides (last: they win) to (a) / (b)-(j); PEAK_TFLOPS, MFU_FLOOR,
# TARGET (the loss whose first step is reported, 1.4697), TRAIN_STEPS, EVAL_EVERY, VAL_BOUND, FEATURE_STEPS, JOBS,
# BUDGET_S, FORCE, PYTHON.
# A developer's dry run of the logic on a CPU: the command below, which tests/e2e/test_gpu_check.py reads and runs
# (~100 CPU-s in CI, AVX2 EPYC). GPU_CHECK_ALLOW_CPU=1 skips the CUDA gate and check (d);
# TORCH_COMPILE_OVERRIDE_BACKENDS='>=0:aot_eager' (torch's own debugging switch, ignored on a GPU) keeps dynamo but
# skips inductor's half a minute of C++ compiling a graph; 1 block of width 32 and 32-token windows (bench.py's too),
# a 5% slice of the text, 100 steps of (b), 30 of each feature, a higher learning rate with a short warm-up so that
# so few steps lower the loss, one thread a process; PEAK_TFLOPS spares bench.py the bf16 matmuls that measure a
# CPU's peak (~10 CPU-s where the CPU has no bf16 instructions; a dry run's MFU means nothing); report_at_end=false,
# the loss plot and sample that no check reads:
#   GPU_CHECK_ALLOW_CPU=1 TORCH_COMPILE_OVERRIDE_BACKENDS='>=0:aot_eager' TRAIN_STEPS=100 EVAL_EVERY=50 \
#   VAL_BOUND=3.3 FEATURE_STEPS=30 JOBS=2 BUDGET_S=300 OMP_NUM_THREADS=1 PEAK_TFLOPS=0.1 PYTHON=.venv/bin/python \
#   BENCH_ARGS="gpt_config.n_layer=1 gpt_config.n_head=2 gpt_config.n_embd=32 trainer_config.batch_size=4 \
#   data_config.block_size=32" TRAIN_ARGS="gpt_config.n_layer=1 gpt_config.n_head=2 gpt_config.n_embd=32 \
#   trainer_config.batch_size=8 data_config.block_size=32 data_config.truncate=0.05 trainer_config.eval_batches=2 \
#   optimizer_config.learning_rate=3e-3 optimizer_config.warmup_steps=10 trainer_config.report_at_end=false" \
#   bash gpu_check.sh /tmp/gpu_check_dry
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}
OUT=${1:-gpu_check_out}
PEAK_TFLOPS=${PEAK_TFLOPS:-}
MFU_FLOOR=${MFU_FLOOR:-}
TARGET=${TARGET:-1.4697}
TRAIN_STEPS=${TRAIN_STEPS:-1500}
EVAL_EVERY=${EVAL_EVERY:-250}
VAL_BOUND=${VAL_BOUND:-1.7}
FEATURE_STEPS=${FEATURE_STEPS:-100}
JOBS=${JOBS:-}
BUDGET_S=${BUDGET_S:-480}
START=$SECONDS
# Far more steps than a check lets run: at H200 speed (~10 ms a step) a signal after step 100 comes ~49 s early.
LONG_RUN_STEPS=5000
# Hydra overrides as arrays, split on any whitespace (a knob's value may span lines); no globbing.
read -r -d '' -a BENCH_EXTRA <<<"${BENCH_ARGS:-}" || true
read -r -d '' -a TRAIN_EXTRA <<<"${TRAIN_ARGS:-}" || true

# ---------------------------------------------------------------------------------------------- the CUDA gate
probe=$("$PYTHON" -c 'import torch
ok = torch.cuda.is_available()
try:  # FSDP: the project refuses it below this torch; Muon: torch.optim.Muon (torch 2.9)
    from mingpt.compat import FSDP_TORCH, TORCH
    needs = ".".join(map(str, FSDP_TORCH))
    fsdp = f"{int(TORCH >= FSDP_TORCH)} {needs}"
except Exception:
    fsdp = "0 ?"
print(torch.__version__, ok, torch.cuda.device_count() if ok else 0, fsdp, int(hasattr(torch.optim, "Muon")),
      torch.cuda.get_device_name(0) if ok else "cpu")' 2>/dev/null) || probe="?"
read -r TORCH_VERSION CUDA_OK GPUS FSDP_OK FSDP_NEEDS MUON_OK DEVICE_NAME <<<"$probe"
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
    GATE="GPU_CHECK_ALLOW_CPU=1: a developer's dry run on the CPU (torch $TORCH_VERSION): no GPU is checked"
    ON_GPU=0
else
    ON_GPU=1
    unset TORCH_COMPILE_OVERRIDE_BACKENDS  # a debugging switch that would keep inductor out of the compile checks
    GATE="ok: torch $TORCH_VERSION sees $GPUS CUDA device(s): $DEVICE_NAME"
fi
echo "$GATE"

# ----------------------------------------------------------------------------------------- earlier results
LOGS="$OUT/gpu_check"
for used in "$OUT/gpu_check.tar.gz" "$OUT/summary.json" "$LOGS"; do
    if [[ -e "$used" ]]; then
        if [[ "${FORCE:-0}" != 1 ]]; then
            echo "error: $OUT already holds an earlier check ($used): use another OUT_DIR, or FORCE=1 to" \
                "delete its results" >&2
            exit 2
        fi
        echo "FORCE=1: deleting the earlier results in $OUT"
        rm -rf -- "$OUT/gpu_check.tar.gz" "$OUT/summary.json" "$LOGS"
        break
    fi
done
mkdir -p "$LOGS"
: >"$LOGS/results.tsv"  # check<TAB>ok|skipped<TAB>seconds<TAB>its line: summary.json's checks
echo "$GATE" >"$LOGS/gpu_check.log"
# Snapshots (~130 MB each: never in OUT_DIR) and every temporary file of the runs (torchrun's, inductor's cache, the
# wheels installed): one folder, deleted at the end.
SCRATCH=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check_scratch.XXXXXX")
mkdir -p "$SCRATCH/tmp"
export TMPDIR="$SCRATCH/tmp"
FAILED=""

# ----------------------------------------------------------------------------------------------- helpers
say() {  # say WORDS...: one line, to the terminal and to gpu_check.log
    echo "$*"
    echo "$*" >>"$LOGS/gpu_check.log"
}

fail() {  # fail WHAT LOG
    FAILED="FAIL: $1: see ${2#"$OUT/"}"
    echo "$FAILED" >&2
    echo "$FAILED" >>"$LOGS/gpu_check.log"
    exit 1
}

record() {  # record CHECK STATUS SECONDS WORDS...: a result for summary.json, its line (the words) printed
    local said="${*:4}"
    printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$said" >>"$LOGS/results.tsv"
    say "$said"
}

skip() {  # skip CHECK REASON
    record "$1" skipped 0 "skipped: ($1) $2"
}

write_summary() {  # summary.json from results.tsv and the logs, whatever the outcome
    "$PYTHON" - "$OUT" "$LOGS" "$FAILED" "$TORCH_VERSION" "$DEVICE_NAME" "$ON_GPU" "$((SECONDS - START))" \
        "$BUDGET_S" "$TARGET" "$VAL_BOUND" <<'PY'
import json, os, platform, sys
out, logs, failed, torch_version, device, gpu, total, budget, target, bound = sys.argv[1:]
checks = {}
for line in open(f"{logs}/results.tsv"):
    name, status, seconds, said = line.rstrip("\n").split("\t", 3)
    checks[name] = {"status": status, "seconds": int(seconds), "line": said}
summary = {
    "passed": not failed, "failed": failed or None, "dry_run_on_cpu": gpu != "1", "torch": torch_version,
    "python": platform.python_version(), "device": device, "seconds": int(total), "budget_s": int(budget),
    "knobs": {k: os.environ[k] for k in ("BENCH_ARGS", "TRAIN_ARGS", "PEAK_TFLOPS", "MFU_FLOOR", "TRAIN_STEPS",
                                         "EVAL_EVERY", "VAL_BOUND", "FEATURE_STEPS", "JOBS", "BUDGET_S",
                                         "TORCH_COMPILE_OVERRIDE_BACKENDS") if os.environ.get(k)},
    "checks": checks,
}
try:
    bench = json.load(open(f"{logs}/bench/bench.json"))
    summary["bench"] = {k: bench[k] for k in ("device", "precision", "compile", "mfu", "tokens_per_s",
                                              "step_ms_median", "peak_tflops_per_process", "peak_source")}
except (OSError, ValueError, KeyError):
    pass
try:
    rows = [json.loads(line) for line in open(f"{logs}/train/metrics.jsonl")]
    val = [r for r in rows if "val_loss" in r]
    hit = next((r for r in val if r["val_loss"] <= float(target)), None)
    summary["train"] = {"steps": max(r["step"] for r in rows), "elapsed_s": rows[-1]["elapsed_s"],
                        "best_val_loss": min(r["val_loss"] for r in val), "val_bound": float(bound),
                        "target_val_loss": float(target), "target_reached_at_step": hit and hit["step"]}
except (OSError, ValueError, KeyError):
    pass
summary["not_checked_with_one_gpu"] = [
    "NCCL all-reduce between 2+ ranks (DDP gradient averaging, bucket order)",
    "FSDP sharding across 2+ GPUs and its resharded resume",
    "sharded saves of ranks with LOCAL_RANK > 0 (the snapshot writer thread must not create a CUDA context on GPU 0)",
    "--nproc_per_node equal to the device count on a multi-GPU node",
]
with open(f"{out}/summary.json", "w") as f:
    json.dump(summary, f, indent=2)
PY
}

finish() {  # on any exit after the gate: no run of ours left behind, the results packed, the temporary folders gone
    local rc=$? pid waited=0
    trap - EXIT
    for pid in $(jobs -p); do  # a job under `timeout` leads its own process group: the whole group goes
        kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
    done
    while [[ -n "$(jobs -pr)" ]] && ((waited < 50)); do
        sleep 0.2
        waited=$((waited + 1))
    done
    for pid in $(jobs -p); do
        kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null || true  # workers follow their agent
    done
    if ((rc != 0)) && [[ -z "$FAILED" ]]; then
        FAILED="FAIL: gpu_check.sh stopped with exit status $rc before its checks ended: see gpu_check.log"
        echo "$FAILED" | tee -a "$LOGS/gpu_check.log" >&2
    fi
    write_summary || echo "error: summary.json not written" >&2
    cp "$OUT/summary.json" "$LOGS/" 2>/dev/null || true
    tar -czf "$OUT/gpu_check.tar.gz" -C "$OUT" gpu_check && rm -rf -- "$LOGS"
    rm -rf -- "$SCRATCH"  # the installed wheels too
    exit "$rc"
}
trap finish EXIT
trap 'exit 143' TERM  # stopped from outside (a lent machine's time limit): the results are still packed
trap 'exit 130' INT

limit() {  # limit SECONDS: SECONDS, or less where the whole script's budget ends sooner
    local left=$((BUDGET_S - (SECONDS - START)))
    ((left < 1)) && left=1
    echo $(($1 < left ? $1 : left))
}

run_limited() {  # run_limited WHAT LOG SECONDS COMMAND...: run to the end (output to LOG), within its time limit
    local what=$1 log=$2 seconds rc=0
    seconds=$(limit "$3")
    shift 3
    timeout -k 10 "$seconds" "$@" </dev/null >"$log" 2>&1 || rc=$?
    if ((rc == 124 || rc == 137)); then
        fail "$what did not finish within $seconds s (the script's budget: BUDGET_S=$BUDGET_S)" "$log"
    fi
    return "$rc"
}

wait_for_line() {  # wait_for_line REGEX LOG PID SECONDS: until LOG has REGEX (0), or PID ended / time is up (1)
    local deadline=$((SECONDS + $(limit "$4")))
    while ((SECONDS < deadline)); do
        grep -Eqs -- "$1" "$2" && return 0
        kill -0 "$3" 2>/dev/null || { grep -Eqs -- "$1" "$2"; return; }
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

SAID=""
check_py() {  # check_py WHAT LOG ARGS... <<'PY': that Python check's output in SAID, or FAIL with its last line
    local last                                  # (a function, not $(...): FAIL must end this shell, not a subshell)
    if ! SAID=$("$PYTHON" - "${@:3}" 2>&1); then
        last=${SAID##*$'\n'}
        fail "$1 (${last#AssertionError: })" "$2"
    fi
}

# A finished run's evidence: check_run WHAT LOG RUN_DIR STEPS FELL [EVIDENCE...], where FELL (1/0) asks for a last
# logged training loss at least 5% below the first, and EVIDENCE is any of fp16, fsdp, compile, inductor,
# resumed:STEP, muon:SNAPSHOT_DIR. The facts found, for the check's ok: line, in SAID.
check_run() {
    check_py "$1" "$2" "$2" "$3" "$4" "$5" "${@:6}" <<'PY'
import glob, json, math, re, sys
log, run, steps, fell, *evidence = sys.argv[1:]
text = open(log, errors="replace").read()
summary = json.load(open(f"{run}/summary.json"))
assert summary.get("finished") is True, "its summary.json does not say finished"
rows = [json.loads(line) for line in open(f"{run}/metrics.jsonl")]
train = [r for r in rows if "train_loss" in r]
assert train, "no training loss in metrics.jsonl"
assert max(r["step"] for r in rows) == int(steps), f"it ended at step {max(r['step'] for r in rows)}, not {steps}"
losses = [r["train_loss"] for r in train] + [r["val_loss"] for r in rows if "val_loss" in r]
assert all(math.isfinite(x) for x in losses), f"a loss is not finite: {losses}"
first, last = train[0]["train_loss"], train[-1]["train_loss"]
if fell == "1":
    assert last <= 0.95 * first, f"the training loss went from {first:.4f} to {last:.4f}, not 5% down"
plan = re.search(r"training: steps (\d+) -> (\d+) .* on (\w+), (.+), (\w+), [\d,]+ tokens per step", text)
assert plan, "no `training: steps ...` line in its log"
facts = [f"steps {plan[1]}->{plan[2]}", f"loss {first:.3f}->{last:.3f}", f"{plan[3]}, {plan[4]}, {plan[5]}"]
for item in evidence:
    what, _, arg = item.partition(":")
    if what == "fp16":
        assert plan[5] == "float16", f"it trained in {plan[5]}, not float16"
        assert all("loss_scale" in r for r in train), "a metrics row without the gradient scaler's loss_scale"
        facts.append(f"gradient scaler on (loss scale {train[-1]['loss_scale']:g})")
    elif what == "fsdp":
        assert plan[4] == "fsdp", f"its layout is {plan[4]}, not fsdp"
    elif what == "compile":
        backends = re.findall(r"Step 2: calling compiler function (\S+)", text)
        assert backends and "Step 2: done compiler function" in text, "dynamo compiled no graph (TORCH_LOGS lines)"
        facts.append(f"dynamo compiled {len(backends)} graph(s) ({', '.join(sorted(set(backends)))})")
    elif what == "inductor":
        passes = {d: len(re.findall(f"torchinductor done compiling {d} graph", text))
                  for d in ("FORWARDS", "BACKWARDS")}
        assert all(passes.values()), f"inductor compiled {passes} graphs: a forward and a backward wanted"
        facts.append(f"inductor: {passes['FORWARDS']} forward, {passes['BACKWARDS']} backward graph(s)")
    elif what == "resumed":
        assert re.search(rf"resumed from \S+: step {arg},", text), f"no `resumed from ...: step {arg}` line"
    elif what == "muon":
        import torch
        path = sorted(glob.glob(f"{arg}/snapshot-*.pt"))[-1]
        snapshot = torch.load(path, map_location="cpu", weights_only=False)
        state = snapshot["optimizer"]["state"]
        matrices = {n: s for n, s in state.items() if n.startswith("transformer.h.") and n.endswith(".weight")
                    and s.get("momentum_buffer", torch.zeros(())).dim() == 2}
        rest = {n: s for n, s in state.items() if n not in matrices}
        assert snapshot.get("optimizer_name") == "muon", f"the snapshot's optimizer is {snapshot.get('optimizer_name')}"
        assert matrices, "no block matrix has Muon's momentum_buffer in the snapshot"
        assert all("exp_avg" not in s for s in matrices.values()), "a block matrix has AdamW's exp_avg too"
        assert rest and all("exp_avg" in s for s in rest.values()), "a parameter outside Muon has no AdamW exp_avg"
        facts.append(f"Muon state for {len(matrices)} block matrices, AdamW for {len(rest)} other tensors")
print("; ".join(facts))
PY
}

TORCHRUN=("$PYTHON" -m torch.distributed.run --standalone --nproc_per_node=1)
TORCH_LOG_COMPILE="torch._dynamo.output_graph,torch._inductor.compile_fx"  # the step lines of dynamo and inductor
INDUCTOR=inductor  # what the compile checks must show: inductor, unless the dry run swapped the backend out
[[ -z "${TORCH_COMPILE_OVERRIDE_BACKENDS:-}" ]] || INDUCTOR=""

# ------------------------------------------------------------------- Hydra & co. from .gpu-wheels/, if needed
SUPPORTED_HYDRA='import hydra, omegaconf, antlr4
assert hydra.__version__.startswith("1.3.") and omegaconf.__version__.startswith("2.3."), "unsupported versions"
print(f"hydra-core {hydra.__version__}, omegaconf {omegaconf.__version__}")'  # README: Supported versions
if hydra=$("$PYTHON" -c "$SUPPORTED_HYDRA" 2>/dev/null); then
    say "ok: $PYTHON imports $hydra already: nothing installed"
else
    wheels=(.gpu-wheels/*.whl)
    if [[ ! -e "${wheels[0]}" ]]; then
        fail "$PYTHON cannot import hydra and .gpu-wheels/ holds no wheels (\`make gpu-wheels\` makes them)" \
            "$LOGS/gpu_check.log"
    fi
    SITE="$SCRATCH/site"
    {
        if "$PYTHON" -m pip --version >/dev/null 2>&1; then
            "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "${wheels[@]}"
        else  # no pip in that environment: a pure-Python wheel is a zip of what goes onto sys.path
            for wheel in "${wheels[@]}"; do "$PYTHON" -m zipfile -e "$wheel" "$SITE"; done
        fi
    } >"$LOGS/install.log" 2>&1 || fail "installing .gpu-wheels/ into $SITE" "$LOGS/install.log"
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    hydra=$("$PYTHON" -c "$SUPPORTED_HYDRA" 2>>"$LOGS/install.log") \
        || fail "hydra, omegaconf or antlr4 is still not importable after installing .gpu-wheels/" "$LOGS/install.log"
    say "ok: installed the ${#wheels[@]} wheels of .gpu-wheels/ ($hydra) into $SITE (on PYTHONPATH; $PYTHON's own" \
        "packages untouched)"
fi

# ------------------------------------------------------------------------------------------------- (a) bench
t0=$SECONDS
mkdir -p "$LOGS/bench"
TORCH_LOGS=$TORCH_LOG_COMPILE run_limited "bench.py" "$LOGS/bench/bench.log" 240 "$PYTHON" benchmarks/bench.py \
    --steps 20 --warmup 10 ${PEAK_TFLOPS:+--peak-tflops "$PEAK_TFLOPS"} --json "$LOGS/bench/bench.json" \
    gpt_config.n_layer=12 gpt_config.n_head=12 gpt_config.n_embd=768 gpt_config.dropout=0.0 data_config.block_size=256 \
    trainer_config.batch_size=64 trainer_config.mixed_precision=bf16 parallel_config.compile=true "${BENCH_EXTRA[@]}" \
    || fail "bench.py exited with an error" "$LOGS/bench/bench.log"
check_py "bench.py" "$LOGS/bench/bench.log" "$LOGS/bench/bench.json" "$LOGS/bench/bench.log" "$ON_GPU" \
    "$MFU_FLOOR" "$INDUCTOR" <<'PY'
import json, re, sys
b = json.load(open(sys.argv[1]))
log, on_gpu, floor, inductor = open(sys.argv[2], errors="replace").read(), sys.argv[3] == "1", sys.argv[4], sys.argv[5]
assert b["device"] != "cpu" or not on_gpu, "bench.py ran on the CPU"
assert b["precision"] == "bfloat16", f"bench.py trained in {b['precision']}, not bfloat16"
assert b["compile"] is True and "Step 2: done compiler function" in log, "bench.py's model was not compiled by dynamo"
if inductor:
    assert "torchinductor done compiling BACKWARDS graph" in log, "inductor compiled no backward graph for bench.py"
hopper = re.search(r"H100|H200", b["device"]) is not None
floor = float(floor) if floor else 0.2 if hopper else 0.0
assert b["mfu"] > 0 and b["mfu"] >= floor, f"MFU {b['mfu']:.3f} is below the floor {floor}"
print(f"ok: (a) bench.py on {b['device']}, bf16, compiled: MFU {b['mfu']:.3f} (floor {floor}) against "
      f"{b['peak_tflops_per_process']} TFLOP/s ({b['peak_source']}); {b['tokens_per_s']:,.0f} tokens/s, "
      f"{b['step_ms_median']} ms/step")
PY
line=$SAID
record bench ok $((SECONDS - t0)) "$line"

# ----------------------------------------------------------------------------------- (b) the default model
t0=$SECONDS
RUN="$LOGS/train"
mkdir -p "$RUN"
run_limited "the training run" "$RUN/launch.log" 240 "$PYTHON" main.py trainer_config.max_steps="$TRAIN_STEPS" \
    trainer_config.eval_every_steps="$EVAL_EVERY" trainer_config.progress=lines \
    trainer_config.snapshot_path="$SCRATCH/snapshots/train" hydra.run.dir="$RUN" "${TRAIN_EXTRA[@]}" \
    || fail "the training run exited with an error" "$RUN/launch.log"
check_run "the training run" "$RUN/launch.log" "$RUN" "$TRAIN_STEPS" 1
facts=$SAID
check_py "the training run's validation loss is not below VAL_BOUND=$VAL_BOUND" "$RUN/launch.log" \
    "$RUN/metrics.jsonl" "$TRAIN_STEPS" "$VAL_BOUND" "$TARGET" <<'PY'
import json, sys
path, steps, bound, target = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
rows = [json.loads(line) for line in open(path)]
val = [r for r in rows if "val_loss" in r]
best = min(val, key=lambda r: r["val_loss"])
assert best["val_loss"] < bound, f"best validation loss {best['val_loss']:.4f} at step {best['step']}"
hit = next((r for r in val if r["val_loss"] <= target), None)
print(f"ok: (b) {steps} steps of the default model in {rows[-1]['elapsed_s']:.0f} s, best validation loss "
      f"{best['val_loss']:.4f} at step {best['step']} (< {bound}); {target} "
      + (f"first reached at step {hit['step']}" if hit else "not reached"))
PY
line=$SAID
record train ok $((SECONDS - t0)) "$line ($facts)"

# ------------------------------------------------------- (f)-(j) the features: started now, beside (c)-(e)
# Each is one short process with a job function that ends in `exec timeout ...` (its time limit, computed when it
# starts, in $1): the job's pid is then timeout's, which leads its own process group (finish kills the group).
if [[ -z "$JOBS" ]]; then
    JOBS=8  # on a GPU machine all at once, beside (c)-(e): their compile warm-ups overlap on its cores
    if [[ $ON_GPU == 0 ]]; then
        JOBS=2  # a CPU dry run: more at once would only fight over the cores
    elif nvidia-smi --query-gpu=compute_mode --format=csv,noheader 2>/dev/null | grep -qi exclusive; then
        JOBS=1  # an exclusive compute mode lets one process at a time use the GPU
    fi
fi
# Warm-up of 10 steps: the short runs' loss then falls well within their steps.
FEATURE=(main.py trainer_config.max_steps="$FEATURE_STEPS" trainer_config.log_every_steps=10
         trainer_config.eval_every_steps=0 trainer_config.progress=lines optimizer_config.warmup_steps=10)
feature() {  # feature NAME OVERRIDES...: a feature run's main.py arguments in ARGS (TRAIN_ARGS last)
    ARGS=("${FEATURE[@]}" trainer_config.snapshot_path="$SCRATCH/snapshots/$1" hydra.run.dir="$LOGS/$1/run" "${@:2}"
          "${TRAIN_EXTRA[@]}")
}
job_compile-fsdp() {
    feature compile-fsdp parallel_config.strategy=fsdp parallel_config.compile=true
    export TORCH_LOGS=$TORCH_LOG_COMPILE
    exec timeout -k 10 "$1" "${TORCHRUN[@]}" "${ARGS[@]}"
}
job_compile-ddp() {
    feature compile-ddp parallel_config.compile=true
    export TORCH_LOGS=$TORCH_LOG_COMPILE
    exec timeout -k 10 "$1" "${TORCHRUN[@]}" "${ARGS[@]}"
}
job_fp16() {
    feature fp16 trainer_config.mixed_precision=fp16
    exec timeout -k 10 "$1" "$PYTHON" "${ARGS[@]}"
}
job_activation-checkpointing() {
    feature activation-checkpointing parallel_config.activation_checkpointing=blocks
    exec timeout -k 10 "$1" "$PYTHON" "${ARGS[@]}"
}
ac_bench() {  # ac_bench LIMIT blocks|none: the default model's peak memory with activation checkpointing on or off
    exec timeout -k 10 "$1" "$PYTHON" benchmarks/bench.py --steps 3 --warmup 2 --json "$LOGS/ac-bench-$2/bench.json" \
        parallel_config.activation_checkpointing="$2" "${TRAIN_EXTRA[@]}"
}
job_ac-bench-blocks() { ac_bench "$1" blocks; }
job_ac-bench-none() { ac_bench "$1" none; }
job_muon() {
    feature muon optimizer_config.name=muon
    exec timeout -k 10 "$1" "$PYTHON" "${ARGS[@]}"
}
QUEUE=(compile-ddp fp16 activation-checkpointing ac-bench-blocks ac-bench-none)
[[ $FSDP_OK == 1 ]] && QUEUE=(compile-fsdp "${QUEUE[@]}")  # the longest warm-up first
[[ $MUON_OK == 1 ]] && QUEUE+=(muon)
declare -A JOB_PID JOB_RC JOB_LIMIT JOB_START JOB_TOOK
RUNNING=()
pump() {  # without waiting: note the feature jobs that ended, start queued ones while fewer than JOBS run
    local name rc still=()
    for name in "${RUNNING[@]}"; do
        if kill -0 "${JOB_PID[$name]}" 2>/dev/null; then
            still+=("$name")
        else
            rc=0
            wait "${JOB_PID[$name]}" || rc=$?
            JOB_RC[$name]=$rc
            JOB_TOOK[$name]=$((SECONDS - JOB_START[$name]))
        fi
    done
    RUNNING=("${still[@]}")
    while ((${#RUNNING[@]} < JOBS && ${#QUEUE[@]} > 0)); do
        name=${QUEUE[0]}
        QUEUE=("${QUEUE[@]:1}")
        JOB_LIMIT[$name]=$(limit 300)
        JOB_START[$name]=$SECONDS
        mkdir -p "$LOGS/$name"
        # stdin from /dev/null: `timeout` leads a process group of its own, which must never wait for a terminal
        "job_$name" "${JOB_LIMIT[$name]}" </dev/null >"$LOGS/$name/launch.log" 2>&1 &
        JOB_PID[$name]=$!
        RUNNING+=("$name")
    done
}
finished() {  # finished NAME WHAT: FAIL unless the job exited 0 within its time limit
    local rc=${JOB_RC[$1]} log="$LOGS/$1/launch.log"
    if ((rc == 124 || rc == 137)); then
        fail "$2 did not finish within ${JOB_LIMIT[$1]} s (the script's budget: BUDGET_S=$BUDGET_S)" "$log"
    fi
    ((rc == 0)) || fail "$2 exited with status $rc" "$log"
}
OVERLAP=1  # the feature jobs share the GPU with (c)-(e), unless only one process at a time may use it
[[ $ON_GPU == 1 && $JOBS == 1 ]] && OVERLAP=0
[[ $OVERLAP == 0 ]] || pump

# ----------------------------------------------------------------------------- (c) NCCL path, SIGTERM, resume
t0=$SECONDS
RUN="$LOGS/sigterm"
mkdir -p "$RUN"
SIGTERM_RUN=("${TORCHRUN[@]}" main.py trainer_config.progress=lines trainer_config.log_every_steps=10
             trainer_config.eval_every_steps=0 trainer_config.snapshot_path="$SCRATCH/snapshots/sigterm"
             "${TRAIN_EXTRA[@]}")
"${SIGTERM_RUN[@]}" trainer_config.max_steps=$LONG_RUN_STEPS hydra.run.dir="$RUN/first" </dev/null \
    >"$RUN/first.log" 2>&1 &
job=$!
wait_for_line "step 100/" "$RUN/first.log" "$job" 150 || fail "the torchrun run did not reach step 100" "$RUN/first.log"
stop_job "$job" TERM || true
stopped=$(sed -n 's/.*stop requested (SIGTERM) after step \([0-9]*\).*/\1/p' "$RUN/first.log" | head -1)
if [[ -z "$stopped" ]] || ! grep -q "saved (stop requested" "$RUN/first.log"; then
    fail "the torchrun run did not stop with a snapshot after SIGTERM" "$RUN/first.log"
fi
((stopped < LONG_RUN_STEPS)) || fail "the torchrun run ended before the signal could stop it" "$RUN/first.log"
[[ $OVERLAP == 0 ]] || pump
run_limited "the torchrun rerun" "$RUN/second.log" 150 "${SIGTERM_RUN[@]}" trainer_config.max_steps=$((stopped + 50)) \
    hydra.run.dir="$RUN/second" || fail "the torchrun rerun exited with an error" "$RUN/second.log"
check_run "the torchrun rerun" "$RUN/second.log" "$RUN/second" $((stopped + 50)) 0 "resumed:$stopped"
record sigterm ok $((SECONDS - t0)) "ok: (c) torchrun ($([[ $ON_GPU == 1 ]] && echo NCCL || echo gloo), one" \
    "process): SIGTERM after step 100 stopped it at step $stopped of $LONG_RUN_STEPS with a snapshot; the rerun" \
    "resumed from it and finished ($SAID)"

# ------------------------------------------------------------------------- (d) more processes than GPUs
t0=$SECONDS
RUN="$LOGS/nprocs"
mkdir -p "$RUN"
[[ $OVERLAP == 0 ]] || pump
if [[ $ON_GPU == 1 ]]; then
    rc=0
    run_limited "torchrun with $((GPUS + 1)) processes" "$RUN/launch.log" 120 "$PYTHON" -m torch.distributed.run \
        --standalone --nproc_per_node=$((GPUS + 1)) --log-dir "$RUN/workers" --redirects 3 main.py \
        trainer_config.max_steps=5 trainer_config.snapshot_path="$SCRATCH/snapshots/nprocs" hydra.run.dir="$RUN" \
        "${TRAIN_EXTRA[@]}" || rc=$?
    ((rc != 0)) || fail "torchrun with $((GPUS + 1)) processes on $GPUS GPU(s) did not fail" "$RUN/launch.log"
    find "$RUN/workers" -name stderr.log -exec cat {} + >"$RUN/workers-stderr.log"
    matches=$(grep -c "error: .*CUDA device" "$RUN/workers-stderr.log" || true)
    if ((matches != 1)) || grep -q "Traceback" "$RUN/workers-stderr.log"; then
        fail "torchrun with $((GPUS + 1)) processes: $matches 'error: ...CUDA device' lines in the workers' stderr" \
            "(1 wanted), or a traceback" "$RUN/workers-stderr.log"
    fi
    record nprocs ok $((SECONDS - t0)) "ok: (d) torchrun with $((GPUS + 1)) processes on $GPUS GPU(s): exit $rc," \
        "one line: $(grep "error: .*CUDA device" "$RUN/workers-stderr.log" | cut -c1-100)..."
else
    skip nprocs "more processes than GPUs needs a CUDA device"
fi

# ------------------------------------------------------------------------------ (e) FSDP, SIGKILL, resume
t0=$SECONDS
RUN="$LOGS/fsdp-kill"
mkdir -p "$RUN"
[[ $OVERLAP == 0 ]] || pump
if [[ $FSDP_OK == 1 ]]; then
    FSDP_RUN=("${TORCHRUN[@]}" main.py parallel_config.strategy=fsdp trainer_config.save_every_steps=100
              trainer_config.eval_every_steps=0 trainer_config.progress=lines trainer_config.log_every_steps=10
              trainer_config.snapshot_path="$SCRATCH/snapshots/fsdp-kill" "${TRAIN_EXTRA[@]}")
    "${FSDP_RUN[@]}" trainer_config.max_steps=$LONG_RUN_STEPS hydra.run.dir="$RUN/first" </dev/null \
        >"$RUN/first.log" 2>&1 &
    job=$!
    # The snapshot of step 100 is written in the background: the kill waits for the line that says it is complete.
    wait_for_line "snapshot .*snapshot-000000100\.dcp saved" "$RUN/first.log" "$job" 150 \
        || fail "the FSDP run did not save the snapshot of step 100" "$RUN/first.log"
    for worker in $(children_of "$job"); do
        kill -KILL "$worker" 2>/dev/null || true  # the worker, as the OOM killer would
    done
    stop_job "$job" 0 || true  # torchrun sees its worker killed and ends
    logged=$(sed -n 's/.*step \([0-9][0-9]*\)\/.*/\1/p' "$RUN/first.log" | tail -1)
    ((logged < LONG_RUN_STEPS)) || fail "the FSDP run ended before it was killed" "$RUN/first.log"
    # The rerun resumes from the newest complete snapshot: the last the log calls saved, or the next one where the
    # kill came between its commit and its log line. It trains 150 steps past the first, at least 50.
    saved=$(sed -n 's/.*snapshot-0*\([0-9][0-9]*\)\.dcp saved.*/\1/p' "$RUN/first.log" | tail -1)
    [[ $OVERLAP == 0 ]] || pump
    run_limited "the FSDP rerun" "$RUN/second.log" 150 "${FSDP_RUN[@]}" trainer_config.max_steps=$((saved + 150)) \
        hydra.run.dir="$RUN/second" || fail "the FSDP rerun exited with an error" "$RUN/second.log"
    resumed=$(sed -n 's/.*resumed from .*snapshot-0*\([0-9][0-9]*\)\.dcp: step.*/\1/p' "$RUN/second.log" | head -1)
    if [[ "$resumed" != "$saved" && "$resumed" != "$((saved + 100))" ]]; then
        fail "the FSDP rerun did not resume from the sharded snapshot of step $saved (or $((saved + 100)))" \
            "$RUN/second.log"
    fi
    check_run "the FSDP rerun" "$RUN/second.log" "$RUN/second" $((saved + 150)) 0 fsdp "resumed:$resumed"
    record fsdp-kill ok $((SECONDS - t0)) "ok: (e) strategy=fsdp: the worker SIGKILLed at step ~$logged, after" \
        "the step-100 snapshot was saved; the rerun resumed from snapshot-$(printf %09d "$resumed").dcp (shards)" \
        "and finished ($SAID)"
else
    skip fsdp-kill "FSDP needs torch $FSDP_NEEDS, this is $TORCH_VERSION"
fi

# ------------------------------------------------------------------------------ (f)-(j) the features' results
while ((${#RUNNING[@]} + ${#QUEUE[@]} > 0)); do
    pump
    sleep 0.2
done
if [[ $FSDP_OK == 1 ]]; then
    finished compile-fsdp "the compiled FSDP run"
    check_run "the compiled FSDP run" "$LOGS/compile-fsdp/launch.log" "$LOGS/compile-fsdp/run" \
        "$FEATURE_STEPS" 1 fsdp compile ${INDUCTOR:+"$INDUCTOR"}
    record compile-fsdp ok "${JOB_TOOK[compile-fsdp]}" "ok: (g) torch.compile under FSDP ($SAID)"
else
    skip compile-fsdp "FSDP needs torch $FSDP_NEEDS, this is $TORCH_VERSION"
fi
finished compile-ddp "the compiled DDP run"
check_run "the compiled DDP run" "$LOGS/compile-ddp/launch.log" "$LOGS/compile-ddp/run" "$FEATURE_STEPS" 1 \
    compile ${INDUCTOR:+"$INDUCTOR"}
record compile-ddp ok "${JOB_TOOK[compile-ddp]}" "ok: (f) torch.compile under DDP ($SAID)"
finished fp16 "the fp16 run"
check_run "the fp16 run" "$LOGS/fp16/launch.log" "$LOGS/fp16/run" "$FEATURE_STEPS" 1 fp16
record fp16 ok "${JOB_TOOK[fp16]}" "ok: (h) mixed_precision=fp16 ($SAID)"
finished activation-checkpointing "the activation-checkpointing run"
finished ac-bench-blocks "bench.py with activation checkpointing"
finished ac-bench-none "bench.py without activation checkpointing"
check_run "the activation-checkpointing run" "$LOGS/activation-checkpointing/launch.log" \
    "$LOGS/activation-checkpointing/run" "$FEATURE_STEPS" 1
facts=$SAID
check_py "activation checkpointing did not lower the peak CUDA memory" "$LOGS/ac-bench-blocks/launch.log" \
    "$LOGS/ac-bench-blocks/bench.json" "$LOGS/ac-bench-none/bench.json" <<'PY'
import json, sys
on, off = (json.load(open(path)) for path in sys.argv[1:3])
assert (on["activation_checkpointing"], off["activation_checkpointing"]) == ("blocks", "none"), "bench.py's settings"
if on["peak_memory_kind"] == "cuda max allocated":
    ratio = on["peak_memory_bytes"] / off["peak_memory_bytes"]
    assert ratio < 0.8, f"peak CUDA memory {ratio:.2f} x that without it (below 0.8 wanted)"
    print(f"bench.py's peak CUDA memory {on['peak_memory_bytes'] / 2**30:.2f} GiB with it, "
          f"{off['peak_memory_bytes'] / 2**30:.2f} GiB without ({ratio:.2f} x)")
else:
    print(f"memory not compared: bench.py's {on['peak_memory_kind']} counts the whole process")
PY
took=${JOB_TOOK[activation-checkpointing]}
record activation-checkpointing ok "$took" "ok: (i) activation_checkpointing=blocks ($facts; $SAID)"
if [[ $MUON_OK == 1 ]]; then
    finished muon "the Muon run"
    check_run "the Muon run" "$LOGS/muon/launch.log" "$LOGS/muon/run" "$FEATURE_STEPS" 1 \
        "muon:$SCRATCH/snapshots/muon"
    record muon ok "${JOB_TOOK[muon]}" "ok: (j) optimizer_config.name=muon ($SAID)"
else
    skip muon "torch $TORCH_VERSION has no torch.optim.Muon (torch 2.9 and newer have it)"
fi

say "not checked with one GPU: NCCL between 2+ ranks, FSDP sharding across GPUs and its resharded resume, sharded" \
    "saves of ranks other than 0, --nproc_per_node equal to a multi-GPU node's device count"
say "all checks passed in $((SECONDS - START)) s (budget $BUDGET_S s); results in $OUT/gpu_check.tar.gz and" \
    "$OUT/summary.json"
