#!/usr/bin/env bash
# Every GPU check of the project in one call of the GPU machine, from the repository root with the
# bundle (scripts/bundle.sh) carried as .bundle and data/qwen3 carried: the GPU test binaries
# (scripts/gpu_check.sh), the quickstart trained on the GPU, then the benchmarks beside PyTorch.
# Logs go to $OUT; the tables are printed last.
#   STEP_CASES="qwen3-4b:65536" OFFLOAD=1 DOC_ATTENTION=1 CP_BALANCE=1 scripts/gpu_all.sh
#   REHEARSE_CASES="qwen3-4b:1048576" TESTS=0 scripts/gpu_all.sh
set -uo pipefail
root=$PWD
# Everything is written under a work folder; $OUT (when set) receives one tarball of it and the
# summary, since the GPU machine returns only a few files.
result=${OUT:-}
out=$(mktemp -d /tmp/lcx-gpu-all.XXXXXX)
source scripts/gpu_bundle.sh

[[ ${TESTS:-1} != 0 ]] && LCX_MEMCHECK=${LCX_MEMCHECK:-0} LCX_BENCH=${LCX_BENCH:-0} \
  LCX_GPU_TESTS=${LCX_GPU_TESTS:-"test_parity test_dist_gpu test_cp_ring_gpu test_sp_ulysses_gpu test_offload test_tiled_mlp test_core test_e2e_dist_train test_multi_gpu test_loss_chunked_gpu test_lora test_qwen3"} \
  OUT=$out/tests scripts/gpu_check.sh >"$out/gpu_check.out" 2>&1

# The quickstart on the GPU: same manifest, the device picked automatically.
start=$(date +%s)
build/bin/lcx-train --config configs/quickstart.toml --set run.output_dir="$out/quickstart" >"$out/quickstart.log" 2>&1
qs_rc=$?
qs_s=$(($(date +%s) - start))
qs_first=$(grep -o "{'loss': [0-9.]*" "$out/quickstart.log" | head -1 | cut -d' ' -f2)
qs_last=$(grep -o "{'loss': [0-9.]*" "$out/quickstart.log" | tail -1 | cut -d' ' -f2)

if [[ -n ${STEP_CASES:-} ]]; then
  CASES=$STEP_CASES OUT=$out/step scripts/bench/step_bench.sh build >"$out/step_bench.out" 2>&1
fi
if [[ ${LOSS:-0} != 0 ]]; then
  OUT=$out/loss timeout 240 scripts/bench/loss_bench.sh build >"$out/loss_bench.out" 2>&1
fi
# Packed documents: masked attention against full causal (DOC_ATTENTION=1).
if [[ ${DOC_ATTENTION:-0} != 0 ]]; then
  OUT=$out/doc_attention timeout "${DOC_ATTENTION_TIMEOUT:-480}" scripts/bench/doc_attention.sh build \
    >"$out/doc_attention.out" 2>&1
fi
# cp_ring's work per rank, zigzag and with packed documents of both length mixes (CP_BALANCE=1).
if [[ ${CP_BALANCE:-0} != 0 ]]; then
  OUT=$out/cp_balance TOKENS=${CP_BALANCE_TOKENS:-131072} MIXES=${CP_BALANCE_MIXES:-"pg19 short"} \
    timeout "${CP_BALANCE_TIMEOUT:-360}" scripts/bench/cp_balance.sh build >"$out/cp_balance.out" 2>&1
fi
# Several GPUs: cp_ring and sp_ulysses over NCCL workers, one per GPU.
if [[ ${MULTI:-0} != 0 ]] && (($(nvidia-smi -L | wc -l) > 1)); then
  OUT=$out/multi timeout "${MULTI_TIMEOUT:-300}" scripts/bench/multi_gpu_bench.sh build >"$out/multi_gpu_bench.out" 2>&1
fi
# This GPU's rates row (lcx-train calibrate) beside the shipped one (CALIBRATE=1).
if [[ ${CALIBRATE:-0} != 0 ]]; then
  timeout "${CALIBRATE_TIMEOUT:-300}" build/bin/lcx-train calibrate --out "$out/calibrated_rates.toml" \
    >"$out/calibrate.out" 2>&1
fi
# A Qwen3-8B folder to its first step, cold and warm, beside transformers (STARTUP=1; writes 16 GB).
if [[ ${STARTUP:-0} != 0 ]]; then
  OUT=$out/startup TOKENIZER=data/qwen3/tokenizer.json timeout "${STARTUP_TIMEOUT:-420}" \
    scripts/bench/startup_bench.sh .bundle >"$out/startup.out" 2>&1
fi
# Timed: alone on the GPU. Full depth beside PyTorch, each variant's recipe, one step traced.
if [[ -n ${FULL_CASES:-} ]]; then
  CASES=$FULL_CASES VARIANTS=${FULL_VARIANTS:-"offload:loss_chunked+offload"} OUT=$out/full \
    scripts/bench/full_depth.sh build >"$out/full_depth.out" 2>&1
fi
# Timed too: a full-depth recipe rehearsed (lcx-train --rehearse) and one layer's real step at the
# same length, the full step by arithmetic; about 4 minutes a case at 1M tokens.
if [[ -n ${REHEARSE_CASES:-} ]]; then
  CASES=$REHEARSE_CASES ARGS=${REHEARSE_ARGS:-} OUT=$out/rehearse scripts/bench/rehearse.sh build >"$out/rehearse.out" 2>&1
fi
# The run folder's TensorBoard events read back by tensorboard's own reader, across a resume.
if [[ ${TB:-0} != 0 ]]; then
  tb=$out/tb-check
  {
    build/bin/lcx-train --config configs/quickstart.toml --set run.output_dir="$tb" --set train.save_steps=3 \
      --set train.max_steps=6 && rm -rf "$tb/checkpoint-6" &&
      build/bin/lcx-train --config configs/quickstart.toml --set run.output_dir="$tb" --set train.save_steps=3 \
        --set train.max_steps=8 --resume latest && python3 scripts/check_tensorboard.py "$tb"
    echo "rc $?"
  } >"$out/tensorboard.out" 2>&1
fi
if [[ ${OFFLOAD:-0} != 0 ]]; then
  LONG_TOKENS= CHECK_TOKENS= OUT=$out/offload scripts/bench/offload_bench.sh build >"$out/offload_bench.out" 2>&1
fi
# Memory only from here: these runs share the GPU, each peak is its own process's allocator's, and
# their times are not comparable.
if [[ -n ${LONG_TOKENS:-} ]]; then
  LONG_TOKENS=$LONG_TOKENS CHECK_TOKENS=${CHECK_TOKENS:-} APPEND=1 SEQS= LAYERS=4 OUT=$out/offload \
    timeout "${LONG_TIMEOUT:-400}" scripts/bench/offload_bench.sh build >"$out/offload_long.out" 2>&1 &
fi
if [[ -n ${VALIDATE_MODELS:-} ]]; then
  MODELS=$VALIDATE_MODELS SEQS=${VALIDATE_SEQS:-"32768 131072"} PLUGINS=${VALIDATE_PLUGINS:-"loss_chunked loss_chunked+offload+tiled_mlp"} \
    LAYERS= MASTER=bf16 TIMEOUT_S=120 timeout "${VALIDATE_TIMEOUT:-260}" \
    scripts/bench/plan_validate.sh measure build "$out/plan_validate.csv" >"$out/plan_validate.out" 2>&1 &
fi
if [[ ${LONGEST:-0} != 0 ]]; then
  LAYERS="2 4" CHECK_TOKENS=32768 BUDGET_S=${LONGEST_BUDGET_S:-280} OUT=$out/longest timeout "${LONGEST_TIMEOUT:-420}" scripts/bench/longest_seq.sh build \
    >"$out/longest_seq.out" 2>&1
fi
wait
echo "== GPU tests"
sed -n '/== GPU tests/,/memcheck/p' "$out/gpu_check.out" | tail -n +2
for f in "$out"/tests/test_*.log; do
  grep -q '^\[  FAILED  \]' "$f" || continue
  echo "-- failures in $(basename "$f" .log):"
  grep -E -B2 -A6 'Failure$' "$f" | head -60
done
echo "== quickstart on the GPU: rc $qs_rc, ${qs_s} s, loss $qs_first -> $qs_last"
[[ -f $out/step/step_bench.md ]] && { echo "== step benchmark"; cat "$out/step/step_bench.md"; }
[[ -f $out/full_depth.out ]] && { echo "== full depth beside PyTorch"; cat "$out/full_depth.out"; }
[[ -f $out/calibrate.out ]] && { echo "== calibrate"; tail -25 "$out/calibrate.out"; }
[[ -f $out/startup.out ]] && { echo "== start-up"; tail -15 "$out/startup.out"; }
[[ -f $out/rehearse.out ]] && { echo "== rehearsal and one layer's step"; cat "$out/rehearse.out"; }
[[ -f $out/tensorboard.out ]] && { echo "== tensorboard reader"; tail -25 "$out/tensorboard.out"; }
[[ -f $out/loss_bench.out ]] && { echo "== loss"; cat "$out/loss/loss_bench.md" 2>/dev/null || tail -20 "$out/loss_bench.out"; }
[[ -f $out/longest_seq.out ]] && { echo "== longest sequence"; cat "$out/longest/longest_seq.md" 2>/dev/null || tail -20 "$out/longest_seq.out"; }
[[ -f $out/doc_attention.out ]] && { echo "== document-masked attention"; cat "$out/doc_attention/doc_attention.md" 2>/dev/null || tail -20 "$out/doc_attention.out"; }
[[ -f $out/cp_balance.out ]] && { echo "== cp_ring work per rank"; cat "$out/cp_balance/cp_balance.md" 2>/dev/null || tail -20 "$out/cp_balance.out"; }
[[ -f $out/multi_gpu_bench.out ]] && { echo "== several GPUs"; tail -30 "$out/multi_gpu_bench.out"; }
[[ -f $out/offload/offload_bench.md ]] && { echo "== offload benchmark"; cat "$out/offload/offload_bench.md"; }
[[ -f $out/plan_validate.csv ]] && { echo "== plan validation (measured)"; cat "$out/plan_validate.csv"; }
if [[ -n $result ]]; then
  # The tables and measured rows as plain files too, in case the tarball is too big to come back.
  find "$out" -maxdepth 2 -type f \( -name '*.md' -o -name '*.csv' -o -name '*.jsonl' \) -size -512k \
    -exec sh -c 'for f; do cp "$f" "$0/$(basename "$(dirname "$f")")_$(basename "$f")"; done' "$result" {} +
  # Logs and tables only: checkpoints and token files stay behind.
  tar czf "$result/gpu_all_logs.tgz" -C "$out" --exclude='*.safetensors' --exclude='*.tokens' --exclude='*.bin' \
    --exclude='*.pt' . 2>/dev/null
fi
exit 0
