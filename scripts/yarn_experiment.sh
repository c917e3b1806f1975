#!/usr/bin/env bash
# The YaRN experiment of docs/yarn_experiment.md, end to end on the CPU (about 20 minutes on 2 cores):
# pretrain a small Qwen3 on the KJV Bible at 256 positions, evaluate it at 8x and 16x that length
# with plain rotary and with rope_yarn, fine-tune it briefly at 2,048 positions with rope_yarn,
# evaluate again, and draw one plot per length.
#
#   scripts/yarn_experiment.sh [BUILD_DIR]      (default: build; run from anywhere)
# Needs data/kjv/kjv.txt and data/qwen3/tokenizer.json (scripts/fetch_data.sh) and a build with
# lcx-train and the qwen3, loss_chunked and rope_yarn plugins. Writes runs/yarn_kjv/ (ignored by
# git) and docs/yarn_experiment_2048.svg, docs/yarn_experiment_4096.svg.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
LCX="$BUILD/bin/lcx-train"
RUNS=runs/yarn_kjv
PRE=configs/yarn_kjv_pretrain.toml
FT=configs/yarn_kjv_finetune.toml
[ -x "$LCX" ] || { echo "no $LCX: build first (cmake -S . -B $BUILD -G Ninja && ninja -C $BUILD)" >&2; exit 1; }
mkdir -p "$RUNS"
rm -rf "$RUNS"/eval_*

# 1. Pretraining at 256 positions.
[ -d "$RUNS/pretrain/checkpoint-300" ] || "$LCX" --config "$PRE" 2>&1 | tee "$RUNS/pretrain.log" | grep -v "it/s\]\|s/it\]" || true
[ -d "$RUNS/pretrain/checkpoint-300" ] || { echo "pretraining did not write checkpoint-300" >&2; exit 1; }
PRE_CKPT="$RUNS/pretrain/checkpoint-300"

# 2. The pretrained model at its own length, and at 8x and 16x with and without YaRN.
# Plain rotary runs take the pretraining manifest (it loads no rope_yarn), the others the fine-tune's.
ev() { "$LCX" eval --bins 64 "$@" 2>>"$RUNS/eval.log"; }
ev --config "$PRE" --model "$PRE_CKPT" --seq-len 256 --max-sequences 32 --out "$RUNS/eval_256" --label pretrain-rope
for N in 2048 4096; do
  K=$((16384 / N))  # the same number of positions at each length
  ev --config "$PRE" --model "$PRE_CKPT" --seq-len $N --max-sequences $K --out "$RUNS/eval_$N" --label pretrain-rope
  ev --config "$FT" --model "$PRE_CKPT" --set rope_yarn.factor=$((N / 256)) --seq-len $N --max-sequences $K --out "$RUNS/eval_$N" \
     --label pretrain-yarn$((N / 256))
done
ev --config "$FT" --model "$PRE_CKPT" --seq-len 2048 --max-sequences 8 --out "$RUNS/eval_2048" --label pretrain-yarn16

# 3. A brief fine-tune at 2,048 positions with YaRN (factor 16), then the same evaluations.
[ -d "$RUNS/finetune/checkpoint-20" ] || "$LCX" --config "$FT" 2>&1 | tee "$RUNS/finetune.log" | grep -v "it/s\]\|s/it\]" || true
[ -d "$RUNS/finetune/checkpoint-20" ] || { echo "fine-tuning did not write checkpoint-20" >&2; exit 1; }
for N in 2048 4096; do
  ev --config "$FT" --model "$RUNS/finetune/checkpoint-20" --seq-len $N --max-sequences $((16384 / N)) --out "$RUNS/eval_$N" \
     --label finetune2048-yarn16
done

# 4. One plot per length.
for N in 2048 4096; do
  "$LCX" eval-plot --out docs/yarn_experiment_$N.svg --mark 256 --mark-label "trained length (256)" \
    --title "Qwen3 (4 layers, hidden 128) trained at 256 positions, evaluated at $N (KJV)" "$RUNS/eval_$N"
done
grep -h '"label"\|mean_loss\|entropy' "$RUNS"/eval_*/*.json
