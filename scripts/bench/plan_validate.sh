#!/usr/bin/env bash
# lcx's memory plan (lcx-train --plan) against the peak its allocator measured.
#
#   scripts/bench/plan_validate.sh measure BUILD_DIR RESULTS.csv   on the GPU: one short run per case
#   scripts/bench/plan_validate.sh table   BUILD_DIR RESULTS.csv   anywhere: plans each row, prints the table
#
# A case is a model preset x a sequence length x a plugin set. Each measured run trains a
# random-init model of the public shape (LAYERS=4 keeps the layer count small; the plan then uses
# the same count) for two steps on DATA_SOURCE, and records the second step's peak_gpu_bytes from
# metrics.jsonl (the first step's includes one-time allocations). A run that runs out of memory
# records OOM. The table compares that peak with the plan's allocated peak (the allocator does not
# count the reserve: CUDA context, cuBLASLt workspace); an OOM row agrees when the plan's peak with
# the reserve exceeds GPU_MEMORY. Target: |plan - measured| <= max(5% of measured, 1 GiB).
#
# Environment: MODELS, SEQS, PLUGINS (sets joined by '+', "none" for core's defaults), LAYERS,
# MASTER (fp32|bf16), GPU_MEMORY (for the OOM rows), DATA_TOKENIZER, DATA_SOURCE, TIMEOUT_S;
# TIMELINE_DIR keeps each measured run's memory timeline (JSON + SVG) there, to explain a mismatch.
set -euo pipefail

usage() { sed -n '2,4p' "$0" >&2; exit 2; }
[[ $# -eq 3 ]] || usage
mode=$1 build=$2 csv=$3
lcx="$build/bin/lcx-train"
[[ -x $lcx ]] || { echo "no lcx-train at $lcx" >&2; exit 2; }

MODELS=${MODELS:-"qwen3-0.6b qwen3-4b"}
SEQS=${SEQS:-"8192 16384 32768 65536 131072"}
PLUGINS=${PLUGINS:-"none loss_chunked loss_chunked+offload"}
LAYERS=${LAYERS:-}
MASTER=${MASTER:-fp32}
GPU_MEMORY=${GPU_MEMORY:-141GB}
DATA_TOKENIZER=${DATA_TOKENIZER:-$PWD/data/qwen3/tokenizer.json}
DATA_SOURCE=${DATA_SOURCE:-$PWD/data/kjv/kjv.txt}
TIMEOUT_S=${TIMEOUT_S:-900}
work=$(mktemp -d /tmp/lcx-plan-validate.XXXXXX)
trap 'rm -rf "$work"' EXIT

# manifest MODEL LAYERS SEQ PLUGINSET OUTDIR -> path of a manifest for that case
manifest() {
  local model=$1 layers=$2 seq=$3 set=$4 out=$5 init load=""
  if [[ -n $layers ]]; then init="'{\"preset\": \"$model\", \"num_hidden_layers\": $layers}'"; else init="\"$model\""; fi
  if [[ $set != none ]]; then load=$(echo "$set" | tr '+' '\n' | sed 's/.*/"&"/' | paste -sd, -); fi
  local path="$work/${model}_${layers:-all}_${seq}_${set}.toml"
  cat >"$path" <<EOF
[run]
output_dir = "$out"
seed = 0
device = "cuda"
memory_timeline = $timeline
memory_timeline_step = 2

[model]
module = "qwen3"
init = $init
dtype = "bf16"

[data]
tokenizer = "$DATA_TOKENIZER"
source = "$DATA_SOURCE"
seq_len = $seq
drop_last = true  # every step a full sequence: the tail of the text would make a shorter, lighter one

[train]
lr = 1e-5
max_steps = 2
master_dtype = "$MASTER"

[plugins]
load = [$load]
EOF
  echo "$path"
}

timeline=false
[[ -n ${TIMELINE_DIR:-} ]] && timeline=true

gib() { awk -v b="$1" 'BEGIN { printf "%.2f", b / 1073741824 }'; }

case $mode in
  measure)
    [[ -f $csv ]] || echo "model,layers,seq_len,plugins,measured_bytes" >"$csv"
    for model in $MODELS; do for seq in $SEQS; do for set in $PLUGINS; do
      out="$work/run"
      rm -rf "$out"
      m=$(manifest "$model" "$LAYERS" "$seq" "$set" "$out")
      echo "== $model layers=${LAYERS:-all} seq=$seq plugins=$set" >&2
      rc=0
      timeout "$TIMEOUT_S" "$lcx" --config "$m" >"$work/log" 2>&1 || rc=$?
      measured=""
      if [[ -f $out/metrics.jsonl ]]; then
        measured=$(grep '"step_s"' "$out/metrics.jsonl" | tail -n 1 | sed -n 's/.*"peak_gpu_bytes":\([0-9]*\).*/\1/p')
      fi
      if [[ -z $measured ]]; then
        if grep -qi "out of memory" "$work/log"; then measured=OOM; else measured="FAIL(rc=$rc)"; tail -n 5 "$work/log" >&2; fi
      fi
      echo "$model,${LAYERS},$seq,$set,$measured" | tee -a "$csv" >&2
      if [[ -n ${TIMELINE_DIR:-} ]]; then
        mkdir -p "$TIMELINE_DIR/${model}_${LAYERS:-all}_${seq}_${set}"
        cp "$out"/memory_timeline.* "$out"/metrics.jsonl "$TIMELINE_DIR/${model}_${LAYERS:-all}_${seq}_${set}/" 2>/dev/null || true
      fi
      rm -rf "$out"
    done; done; done
    ;;
  table)
    echo "| model | layers | tokens | plugins | plan GiB | measured GiB | diff GiB | diff % | within target |"
    echo "|---|---|---|---|---|---|---|---|---|"
    tail -n +2 "$csv" | while IFS=, read -r model layers seq set measured; do
      m=$(manifest "$model" "$layers" "$seq" "$set" "$work/unused")
      line=$("$lcx" --plan --config "$m" --gpu-memory "$GPU_MEMORY" 2>/dev/null | grep '^  plan: ')
      peak=$(sed -n 's/.*peak_bytes=\([0-9]*\).*/\1/p' <<<"$line")
      alloc=$(sed -n 's/.*allocated_bytes=\([0-9]*\).*/\1/p' <<<"$line")
      gpu=$(awk -v s="$GPU_MEMORY" 'BEGIN { n = s + 0; print n * 1073741824 }')
      if [[ $measured == OOM ]]; then
        ok=$(awk -v p="$peak" -v g="$gpu" 'BEGIN { print (p > g) ? "yes (plan: does not fit)" : "NO (plan: fits)" }')
        echo "| $model | ${layers:-all} | $seq | $set | $(gib "$peak") (with reserve) | OOM | | | $ok |"
      elif [[ $measured =~ ^[0-9]+$ ]]; then
        row=$(awk -v p="$alloc" -v m="$measured" 'BEGIN {
          d = p - m; g = 1073741824; tol = (0.05 * m > g) ? 0.05 * m : g;
          printf "%.2f | %+.2f | %+.1f%% | %s", m / g, d / g, 100 * d / m, (d <= tol && -d <= tol) ? "yes" : "NO" }')
        echo "| $model | ${layers:-all} | $seq | $set | $(gib "$alloc") | $row |"
      else
        echo "| $model | ${layers:-all} | $seq | $set | $(gib "$alloc") | $measured | | | |"
      fi
    done
    ;;
  *) usage ;;
esac
