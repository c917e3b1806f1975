#!/usr/bin/env bash
# Qwen3-MoE's GPU checks and benchmarks in one device call, from the repository root with the bundle
# carried as .bundle (and data/qwen3): the MoE ops and grouped GEMMs of the op table against their
# CPU twins, the transformers fixtures on the GPU in bf16 (tests/models/qwen3_moe_test.cpp), then
# Qwen3-30B-A3B at full depth (48 layers) with LoRA r = 16 on the linear projections: lcx's step
# beside transformers + PyTorch with the same hand-written LoRA, each of transformers' experts
# implementations timed (scripts/bench/torch_step.py --experts).
#   OUT=/tmp/moe CASES="qwen3-30b-a3b:32768" scripts/bench/moe_gpu.sh
# EXPERTS names the implementations (default: eager grouped_mm batched_mm; those the image lacks say so).
set -uo pipefail
out=${OUT:-/tmp/lcx-moe}
mkdir -p "$out"
source scripts/gpu_bundle.sh
summary=$out/summary.md
: >"$summary"

if [[ ${TESTS:-1} != 0 ]]; then
  build/tests/test_gpu --gtest_filter='*moe*:*rouped*' >"$out/ops.log" 2>&1
  echo "op table (moe, grouped GEMMs): rc $? $(grep -E '^\[  (PASSED|FAILED) ' "$out/ops.log" | tr '\n' ' ')" >>"$summary"
  build/tests/test_qwen3 --gtest_filter='*Moe*' >"$out/moe_test.log" 2>&1
  echo "test_qwen3 *Moe*: rc $? $(grep -E '^\[  (PASSED|FAILED) ' "$out/moe_test.log" | tr '\n' ' ')" >>"$summary"
  grep -E "^moe_.*(cpu|cuda)" "$out/moe_test.log" >>"$summary"
fi

if [[ -n ${CASES:-} ]]; then
  CASES=$CASES VARIANTS="lora:lora+loss_chunked+offload:--set,lora.r=16,--set,lora.alpha=32" \
    TORCH_ARGS="--lora 16 --experts ${EXPERTS:-eager grouped_mm batched_mm}" PROFILE=${PROFILE:-0} OUT=$out/steps \
    LCX_STEP_TIMEOUT=${LCX_STEP_TIMEOUT:-300} scripts/bench/full_depth.sh build >"$out/steps.out" 2>&1
  grep -E "^\|" "$out/steps.out" >>"$summary"
  cat "$out"/steps/*/*/torch.all >>"$summary" 2>/dev/null
fi
cat "$summary"
