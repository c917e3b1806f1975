#!/usr/bin/env bash
# Runs on the GPU machine, from the repository root, with a bundle made by scripts/bundle.sh
# carried (default .bundle): every GPU test binary, then compute-sanitizer memcheck over the GPU
# tests once (less the two that fill the device), then the GPU micro-benchmarks. Logs go to $OUT
# (default /tmp/lcx-gpu-check); a short table is printed last.
#   scripts/gpu_check.sh                  tests, memcheck, benchmarks
#   LCX_MEMCHECK=0 scripts/gpu_check.sh   skip memcheck
#   LCX_BENCH=quick|0                     shorter benchmarks, or none
#   LCX_GPU_TESTS="test_x test_y"         more test binaries of the bundle to run (test_gpu* and
#                                         test_pinned always run)
set -uo pipefail
bundle=${LCX_BUNDLE:-.bundle}
out=${OUT:-/tmp/lcx-gpu-check}
mkdir -p "$out"
log=$out/gpu_check.log
: >"$log"

source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh" "$bundle"

{
  echo "== machine"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv 2>&1
  echo "== unresolved libraries (should be none)"
  for f in "$bundle"/lib/liblcx_core.so "$bundle"/tests/*; do [[ -f $f ]] && ldd "$f" | grep 'not found'; done
} >>"$log" 2>&1

rows=()
extra=()
for name in ${LCX_GPU_TESTS:-}; do extra+=("$bundle/tests/$name"); done
for t in "$bundle"/tests/test_gpu* "$bundle"/tests/test_pinned "${extra[@]}"; do
  [[ -x $t ]] || continue
  name=$(basename "$t")
  start=$(date +%s)
  "$t" --gtest_color=no >"$out/$name.log" 2>&1
  rc=$?
  secs=$(($(date +%s) - start))
  passed=$(grep -c '^\[       OK \]' "$out/$name.log")
  failed=$(grep -c '^\[  FAILED  \] [A-Za-z].*(' "$out/$name.log")
  skipped=$(grep -c '^\[  SKIPPED \] [A-Za-z].*(' "$out/$name.log")
  rows+=("$(printf '%-22s | %6s | %6s | %7s | %4s s | rc %s' "$name" "$passed" "$failed" "$skipped" "$secs" "$rc")")
  grep -E '^\[  FAILED  \]|Failure|relative L2|error' "$out/$name.log" | head -40 >>"$log"
done

memcheck="not run"
if [[ ${LCX_MEMCHECK:-1} != 0 ]] && command -v compute-sanitizer >/dev/null; then
  compute-sanitizer --tool memcheck --error-exitcode 99 --print-limit 20 "$bundle/tests/test_gpu" --gtest_color=no \
    --gtest_filter=-GpuAllocator.LargeTensorFitsDespiteFragmentedCache:GpuAllocator.OutOfMemory* \
    >"$out/memcheck.log" 2>&1
  rc=$?
  summary=$(grep -E 'ERROR SUMMARY' "$out/memcheck.log" | tail -1)
  memcheck="rc $rc, ${summary:-no summary}"
fi

bench="not run"
if [[ ${LCX_BENCH:-1} != 0 && -x $bundle/tests/bench_gpu ]]; then
  arg=""
  [[ ${LCX_BENCH:-1} == quick ]] && arg=--quick
  "$bundle/tests/bench_gpu" $arg >"$out/bench.log" 2>&1
  bench="rc $?"
  # The same attention shapes through PyTorch, for the side-by-side.
  if [[ -z $arg ]] && python3 -c 'import torch' 2>/dev/null; then
    python3 scripts/bench/attention_torch.py --tokens 4096 16384 32768 >>"$out/bench.log" 2>&1 || bench+=", torch failed"
  fi
fi

{
  echo
  echo "== GPU tests"
  printf '%-22s | %6s | %6s | %7s | %6s | %s\n' binary passed failed skipped time status
  printf '%s\n' "${rows[@]}"
  echo "memcheck: $memcheck"
  echo "== benchmarks ($bench)"
  [[ -f $out/bench.log ]] && cat "$out/bench.log"
} | tee -a "$log"
