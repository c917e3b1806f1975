#!/usr/bin/env bash
# The own Hopper attention kernels in one device call, from the repository root with the bundle
# carried as .bundle: the GPU tests that hold them to the CPU twin and to cuDNN, the forward in
# isolation beside cuDNN's, and the backward (bench_gpu --attention) and beside PyTorch's SDPA (cuDNN and
# flash backends) at 16k-128k tokens, 32/8 heads of 128, then ncu's sections on one launch at 32k.
# Logs go to $OUT; the table is printed last.
#   OUT=/tmp/attn scripts/bench/attention_kernel.sh
# BENCH=0, TORCH=0, NCU=0 leave those parts out; STEP_CASES adds full-depth steps (below). EXTRA_TESTS="test_lora:LoraGpu*" runs more GPU test binaries (name:gtest filter) first.
set -uo pipefail
out=${OUT:-/tmp/lcx-attention-kernel}
mkdir -p "$out"
source scripts/gpu_bundle.sh
summary=$out/summary.md
: >"$summary"
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader >>"$summary"

for spec in "test_gpu:GpuOps.Attention*" ${EXTRA_TESTS:-}; do
  bin=${spec%%:*}
  filter=${spec#*:}
  timeout "${TEST_TIMEOUT:-240}" build/tests/"$bin" --gtest_filter="$filter" --gtest_color=no >"$out/$bin.log" 2>&1
  echo "$bin ($filter): rc $? $(grep -cE '^\[       OK \]' "$out/$bin.log") ok, $(grep -cE '^\[  FAILED  \] [A-Za-z].*\(' "$out/$bin.log") failed, $(grep -cE '^\[  SKIPPED \] [A-Za-z].*\(' "$out/$bin.log") skipped" >>"$summary"
  grep -E -A8 'Failure$' "$out/$bin.log" | head -40 >>"$summary"
done

if [[ ${BENCH:-1} != 0 ]]; then
  timeout 400 build/tests/bench_gpu --attention >"$out/bench_forward.log" 2>&1
  echo "bench_gpu --attention: rc $?" >>"$summary"
fi
if [[ ${TORCH:-1} != 0 ]]; then
  timeout 240 python3 scripts/bench/attention_torch.py --tokens 16384 32768 65536 131072 --fwd-only --reps 10 \
    >"$out/torch_forward.log" 2>&1
  echo "attention_torch.py: rc $?" >>"$summary"
fi

if [[ ${NCU:-1} != 0 ]] && command -v ncu >/dev/null; then
  timeout 300 ncu --kernel-name regex:attn_fwd_hopper --launch-skip 1 --launch-count 1 \
    --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
    --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats \
    --section InstructionStats --metrics smsp__pcsamp_warps_issue_stalled_barrier,smsp__pcsamp_warps_issue_stalled_long_scoreboard \
    build/tests/bench_gpu --attention-forward 32768 causal >"$out/ncu.log" 2>&1
  echo "ncu: rc $?" >>"$summary"
  timeout 300 ncu --kernel-name regex:attn_bwd_hopper --launch-skip 1 --launch-count 1 \
    --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats --section LaunchStats \
    --section Occupancy build/tests/bench_gpu --attention 32768 causal 2 >"$out/ncu_bwd.log" 2>&1
  echo "ncu (backward): rc $?" >>"$summary"
fi

# The full-depth step under each attention choice of STEP_CHOICES (default "cudnn auto"; "own" is
# what a machine without cuDNN runs) for each case of STEP_CASES="qwen3-4b:65536", each with its
# second step traced; STEP_TORCH=1 adds transformers + PyTorch's step beside the first choice.
for c in ${STEP_CASES:-}; do
  first=1
  for choice in ${STEP_CHOICES:-cudnn auto}; do
    torch=0
    [[ $first == 1 ]] && torch=${STEP_TORCH:-0}
    first=0
    CASES=$c VARIANTS="offload:loss_chunked+offload:--set,run.attention=$choice" TORCH=$torch STEPS=${STEPS:-2} \
      PROFILE=1 OUT=$out/step-$choice scripts/bench/full_depth.sh build >"$out/step-$choice.out" 2>&1
    echo "step $c, run.attention=$choice:" >>"$summary"
    grep -E "^\| [a-z0-9]" "$out/step-$choice.out" | head -3 >>"$summary"
    grep -iE "attention|total" "$out/step-$choice.out" | head -12 >>"$summary"
  done
done

if [[ -f $out/bench_forward.log ]]; then
  echo "| kernel | shape | ms | TFLOP/s |"
  grep -hE "^attention|^torch" "$out/bench_forward.log" "$out/torch_forward.log" 2>/dev/null | awk -F'|' '{gsub(/ +$/,"",$1); print "| " $1 " | " $2 " | " $3 " | " $4 " |"}'
fi >>"$summary"
if [[ -f $out/ncu.log ]]; then
  grep -E "Duration|Compute \(SM\) Throughput|Memory Throughput|Registers Per|Achieved Occupancy|Issue Slots Busy|Issued Warp Per|No Eligible|Warp Cycles Per Issued|Shared Memory Configuration|Dynamic Shared|Block Limit|L1/TEX Hit|L2 Hit|DRAM Throughput|Executed Ipc|Bank" "$out/ncu.log" | head -40 >>"$summary"
fi
cat "$summary"
