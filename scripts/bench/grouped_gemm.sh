#!/usr/bin/env bash
# The experts' grouped GEMMs on the GPU in one device call, from the repository root with the bundle
# carried as .bundle: lcx's Hopper kernels against the CPU twin and cuBLAS
# (GpuOps.HopperGroupedGemmMatchesTheCpuTwin), then each design timed in its own process (a kernel fault ends
# that process only) beside cuBLAS's grouped GEMM and a dense GEMM of the same work (bench_gpu
# --grouped; a design that fails runs again small under compute-sanitizer), and PyTorch's
# torch._grouped_mm on the same shapes (grouped_torch.py).
#   OUT=/tmp/grouped TOKENS=32768 scripts/bench/grouped_gemm.sh
set -uo pipefail
out=${OUT:-/tmp/lcx-grouped}
tokens=${TOKENS:-32768}
mkdir -p "$out"
source scripts/gpu_bundle.sh
summary=$out/summary.md
: >"$summary"
timeout 120 build/tests/test_gpu --gtest_filter='*HopperGrouped*' >"$out/hopper_test.log" 2>&1
echo "GpuOps.HopperGroupedGemm*: rc $? $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$out/hopper_test.log" | tr '\n' ' ')" >>"$summary"
grep -E 'Failure|relative L2' "$out/hopper_test.log" | head -8 >>"$summary"
for design in coop ping; do
  timeout 120 build/tests/bench_gpu --grouped "$tokens" "${REPS:-10}" "$design" >"$out/bench_$design.log" 2>&1
  rc=$?
  echo "bench_gpu --grouped $tokens ($design): rc $rc" >>"$summary"
  grep -E '^(grouped|gate|down|bench)' "$out/bench_$design.log" >>"$summary"
  if [[ $rc != 0 ]]; then  # where it faults, at a size compute-sanitizer gets through
    timeout 150 compute-sanitizer --print-limit 4 build/tests/bench_gpu --grouped 2048 1 "$design" \
      >"$out/sanitizer_$design.log" 2>&1
    grep -E -m 12 'Invalid|Error|at 0x|by thread|Address|^gate|^down' "$out/sanitizer_$design.log" >>"$summary"
  fi
done
timeout 120 python3 scripts/bench/grouped_torch.py --tokens "$tokens" >"$out/torch.log" 2>&1
echo "grouped_torch.py: rc $?" >>"$summary"
cat "$out/torch.log" >>"$summary"
cat "$summary"
