#!/usr/bin/env bash
# Several GPUs of one host sharing one sequence, step time and peak: lcx-train with one NCCL worker per GPU,
# the Qwen3-8B shape (random init), ZeRO-3 sharded parameters, bf16 weights and moments, chunked
# loss, with cp_ring and then sp_ulysses over every visible GPU. Step time is the median of the
# steps after the first; peak is rank 0's GPU peak. Writes $OUT/multi_gpu_bench.md.
#   TOKENS=131072 scripts/bench/multi_gpu_bench.sh build
# Each run's last log lines (steps, progress, errors) are printed after it, so a run cut short by a
# time limit still says how far it got.
set -uo pipefail
build=${1:-build}
out=${OUT:-/tmp/lcx-multi-gpu}
tokens=${TOKENS:-131072}
model=${MODEL:-qwen3-8b}
n=${NGPU:-$(nvidia-smi -L | wc -l)}
mkdir -p "$out"
for kind in ${KINDS:-cp_ring sp_ulysses}; do
  axis=cp
  [[ $kind == sp_ulysses ]] && axis=sp
  tables="[distributed]\nnproc_per_node = $n\n$axis = $n\nshard_parameters = true\n"
  CASES="$model:$tokens" PLUGINS="loss_chunked $kind" MASTER=bf16 STEPS=${STEPS:-2} TORCH=0 TABLES="$tables" \
    LCX_STEP_TIMEOUT=${LCX_STEP_TIMEOUT:-240} OUT="$out/$kind" "$(dirname "$0")/step_bench.sh" "$build" >"$out/$kind.out" 2>&1
  row=$(grep "^| $model" "$out/$kind/step_bench.md" | head -1 | cut -d'|' -f2-7)
  echo "| $kind $axis=$n |$row" >>"$out/rows.md"
  # The run's own account: per-step lines, and the error when it failed.
  tail -c 4000 "$out/$kind/$model-$tokens/lcx.log" | tr '\r' '\n' | grep -v '^$' | tail -12 | sed "s/^/  $kind: /" >&2
done
{
  echo "| strategy | model | tokens | step s | tokens/s | MFU | peak GiB (rank 0) |"
  echo "|---|---|---|---|---|---|---|"
  cat "$out/rows.md"
} >"$out/multi_gpu_bench.md"
cat "$out/multi_gpu_bench.md"
