#!/usr/bin/env bash
# The GPU checks of the speed issue, as one script for a machine with one NVIDIA GPU (written for an H200).
#
#   bash gpu_check.sh [OUT_DIR]          # default OUT_DIR: gpu_check_out
#
# 1. bench.py: 12 layers x 768 wide, block 256, bf16, torch.compile; MFU against the H200's dense bf16 peak
#    (989 TFLOP/s per GPU; override with PEAK_TFLOPS=...).
# 2. The default gpt2_train_cfg.yaml model on the one GPU, evaluated every 250 steps: the elapsed training time at
#    which the validation loss first reaches nanoGPT's best tiny-shakespeare result, 1.4697 (TARGET=...).
# Everything lands in OUT_DIR (bench.json, run/, summary.json). BENCH_ARGS / TRAIN_ARGS add overrides, e.g. a tiny
# model to try the script on a CPU: BENCH_ARGS="gpt_config.n_layer=2 gpt_config.n_embd=64 gpt_config.n_head=2
# trainer_config.compile=false trainer_config.mixed_precision=fp32 trainer_config.batch_size=4" TRAIN_ARGS=...
set -euo pipefail
cd "$(dirname "$0")"
OUT=${1:-gpu_check_out}
PEAK_TFLOPS=${PEAK_TFLOPS:-989}
TARGET=${TARGET:-1.4697}
PYTHON=${PYTHON:-python}
mkdir -p "$OUT"
"$PYTHON" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')"

"$PYTHON" bench.py --steps 30 --warmup 10 --peak-tflops "$PEAK_TFLOPS" --json "$OUT/bench.json" \
    gpt_config.n_layer=12 gpt_config.n_head=12 gpt_config.n_embd=768 gpt_config.dropout=0.0 data_config.block_size=256 \
    trainer_config.batch_size=64 trainer_config.mixed_precision=bf16 trainer_config.compile=true ${BENCH_ARGS:-}

"$PYTHON" main.py trainer_config.max_steps=5000 trainer_config.eval_every_steps=250 trainer_config.progress=lines \
    trainer_config.snapshot_path="$OUT/snapshots" hydra.run.dir="$OUT/run" ${TRAIN_ARGS:-}

"$PYTHON" - "$OUT" "$TARGET" <<'PY'
import json, sys
out, target = sys.argv[1], float(sys.argv[2])
rows = [json.loads(line) for line in open(f"{out}/run/metrics.jsonl")]
val = [r for r in rows if "val_loss" in r]
hit = next((r for r in val if r["val_loss"] <= target), None)
bench = json.load(open(f"{out}/bench.json"))
summary = {
    "bench_mfu": bench["mfu"], "bench_tokens_per_s": bench["tokens_per_s"], "bench_step_ms": bench["step_ms_median"],
    "target_val_loss": target, "best_val_loss": min(r["val_loss"] for r in val),
    "reached_at_step": hit and hit["step"], "reached_after_s": hit and hit["elapsed_s"],
}
json.dump(summary, open(f"{out}/summary.json", "w"), indent=2)
print(json.dumps(summary, indent=2))
PY
