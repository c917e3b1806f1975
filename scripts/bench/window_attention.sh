#!/usr/bin/env bash
# Sliding-window attention on the GPU in one device call, from the repository root with the bundle
# carried as .bundle: the GPU tests that hold each backend's window to a naive reference
# (GpuWindowAttention.*, tests/gpu/window_attention_gpu_test.cpp), then a windowed layer at 131,072
# tokens (32 query heads, 8 key/value heads of 128; W 128, 1024 and 4096) beside full causal attention of
# the same shape on each backend forced in turn (bench_gpu --window-attention): forward, backward
# and both, with `ratio` = the windowed time over what its T x W (query, key) pairs take at that
# backend's full causal rate (the issue's bar: 1.25). Logs go to $OUT; the table is printed last.
#   OUT=/tmp/window scripts/bench/window_attention.sh
# TESTS=0 leaves the tests out; TOKENS, WINDOWS (comma-separated), BACKENDS (a comma-separated
# subset of cudnn,hopper,mma,reference) and REPS change the measured shape.
set -uo pipefail
out=${OUT:-/tmp/lcx-window-attention}
mkdir -p "$out"
source scripts/gpu_bundle.sh
summary=$out/summary.md
: >"$summary"
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader >>"$summary"

if [[ ${TESTS:-1} != 0 ]]; then
  log=$out/test_gpu.log
  timeout "${TEST_TIMEOUT:-400}" build/tests/test_gpu --gtest_filter='GpuWindowAttention.*' --gtest_color=no >"$log" 2>&1
  echo "test_gpu (GpuWindowAttention.*): rc $? $(grep -cE '^\[       OK \]' "$log") ok, $(grep -cE '^\[  FAILED  \] [A-Za-z].*\(' "$log") failed, $(grep -cE '^\[  SKIPPED \] [A-Za-z].*\(' "$log") skipped" >>"$summary"
  grep -E -A8 'Failure$' "$log" | head -40 >>"$summary"
fi

log=$out/bench_window.log
timeout "${BENCH_TIMEOUT:-500}" build/tests/bench_gpu --window-attention "${TOKENS:-131072}" "${WINDOWS:-128,1024,4096}" \
  "${BACKENDS:-cudnn,hopper,mma}" "${REPS:-3}" >"$log" 2>&1
echo "bench_gpu --window-attention: rc $?" >>"$summary"
{
  echo "| backend | pass | shape | ms | TFLOP/s | ratio to T x W at the full causal rate |"
  echo "|---|---|---|---|---|---|"
  grep -E "^window [a-z]+ +(fwd|bwd|fwd\+bwd) " "$log" |
    sed -E 's/^window ([a-z]+) +([a-z+]+) +\| (.*) +\| +([0-9.]+) ms \| +([0-9.]+) TFLOP\/s \| ratio ([0-9.]+)$/| \1 | \2 | \3 | \4 | \5 | \6 |/'
  grep -E "refused|not loadable|failed" "$log"
} >>"$summary"
cat "$summary"
