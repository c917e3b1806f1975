#!/usr/bin/env bash
# On the GPU machine, from the repository root, with the folder scripts/pack_gpu_suites.sh made:
#  1. the release archive unpacked as on a bare machine (lcx-env.sh, no build tree): its version,
#     its GPU code (cuobjdump where present), the quickstart trained;
#  2. the GPU suite (test_gpu whole, in 4 shards, its allocator tests alone; the GPU cases of the
#     other binaries, 4 at a time) (a) as built for every architecture;
#  3. Qwen3-4B full depth at 65,536 tokens with [run] attention = "sm80" beside PyTorch;
#  4. the suite (b) with --attention=sm80 (cuDNN, else the sm_80 kernels: no Hopper path) and (c) on
#     the compute_80-only core library, which the driver compiles for this GPU.
# Logs in $OUT/b.tgz and $OUT/summary.txt; LIMIT (seconds, default 570) bounds the whole.
#   bash scripts/gpu_suites.sh .gpu-suites
set -u
P=${1:-.gpu-suites}
T0=$(date +%s)
left() { echo $((${LIMIT:-570} - ($(date +%s) - T0))); }
o=/tmp/b; mkdir -p $o
finish() { tar czf $OUT/b.tgz --exclude='*.tokens' --exclude='*.safetensors' -C /tmp b 2>/dev/null; cp $o/summary.txt $OUT/ 2>/dev/null; }
trap finish EXIT
mkdir -p data/qwen3 data/kjv
gunzip -c $P/data/qwen3/tokenizer.json.gz > data/qwen3/tokenizer.json; cp $P/data/qwen3/tokenizer_config.json data/qwen3/
gunzip -c $P/data/kjv.txt.gz > data/kjv/kjv.txt
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; nproc; } > $o/machine.txt 2>&1
# 1. The release archive: unpack, lcx-env.sh, its GPUs, the quickstart.
rel=/tmp/rel; mkdir -p $rel; tar xzf $P/lcx-*-linux-x86_64.tar.gz -C $rel; R=$(ls -d $rel/lcx-*)
( cd $R && source lcx-env.sh $PWD && bin/lcx-train --version && echo "unresolved: $(ldd lib/liblcx_core.so | grep -c 'not found')"
  cu=$(command -v cuobjdump || ls /usr/local/cuda*/bin/cuobjdump 2>/dev/null | head -1)
  [ -n "$cu" ] && { $cu --list-elf lib/liblcx_core.so | grep -o 'sm_[0-9]*a\?' | sort | uniq -c; $cu --list-ptx lib/liblcx_core.so | grep -o 'sm_[0-9]*' | sort | uniq -c;
                    echo "compute_80 build:"; $cu --list-elf $OLDPWD/$P/compute80/liblcx_core.so | wc -l; $cu --list-ptx $OLDPWD/$P/compute80/liblcx_core.so | grep -o 'sm_[0-9]*' | sort | uniq -c; } ) > $o/release.log 2>&1
( source $R/lcx-env.sh $R && timeout 120 $R/bin/lcx-train --config configs/quickstart.toml --set run.output_dir=/tmp/qs ) > $o/quickstart.log 2>&1
echo "quickstart rc $? at $(( $(date +%s) - T0 )) s: $(wc -l < /tmp/qs/metrics.jsonl 2>/dev/null) metrics rows; last $(tail -1 /tmp/qs/metrics.jsonl 2>/dev/null | cut -c1-140)" | tee $o/summary.txt
# 2. Test binaries beside each tree's libraries (RPATH $ORIGIN/../lib).
mkdir -p $R/tests; cp $P/tests/* $R/tests/; cp $P/source_dir $P/build_dir $R/
R80=$rel/compute80; cp -a $R $R80; cp $P/compute80/liblcx_core.so $R80/lib/; cp $P/compute80/lcx_cp_ring.so $R80/lib/lcx/plugins/
ln -sfn $R .bundle; source scripts/gpu_bundle.sh
suite() {  # suite <name> <tree> [flag]: test_gpu in 4 shards (its allocator tests alone), the others' GPU cases
  local name=$1 T=$2 flag=${3:-} s=$(date +%s); mkdir -p $o/$name
  ln -sfn $T .bundle
  for i in 0 1 2 3; do GTEST_TOTAL_SHARDS=4 GTEST_SHARD_INDEX=$i timeout 150 $T/tests/test_gpu --gtest_color=no --gtest_filter='-GpuAllocator*' $flag > $o/$name/test_gpu_$i.log 2>&1 & done; wait
  timeout 60 $T/tests/test_gpu --gtest_color=no --gtest_filter='GpuAllocator*' $flag > $o/$name/test_gpu_alloc.log 2>&1
  ls $T/tests | grep -v -x -e test_gpu -e dist_worker | xargs -P 4 -I{} sh -c \
    "timeout 120 $T/tests/{} --gtest_color=no --gtest_filter='*Gpu*:*GPU*:*Cuda*:*cuda*:*Bf16*:*bf16*:*Pinned*:*Nccl*:*CommVirtualRanks*' $flag > $o/$name/{}.log 2>&1"
  local ok=$(cat $o/$name/*.log | grep -c '^\[       OK') failed=$(cat $o/$name/*.log | grep -c '^\[  FAILED  \] [A-Za-z].*(') \
    skipped=$(cat $o/$name/*.log | grep -c '^\[  SKIPPED \] [A-Za-z].*(')
  echo "suite $name: $ok ok, $failed failed, $skipped skipped in $(( $(date +%s) - s )) s" | tee -a $o/summary.txt
  grep -h '^\[  FAILED  \] [A-Za-z].*(' $o/$name/*.log | head -8 | tee -a $o/summary.txt
  grep -h -B3 '^\[  SKIPPED \] [A-Za-z].*(' $o/$name/*.log | head -40 > $o/$name.skipped
}
suite all_archs $R
if (( $(left) > 260 )); then
  ln -sfn $R .bundle
  OUT=$o/step LCX_STEP_TIMEOUT=100 MASTER=bf16 CASES="qwen3-4b:65536" PLUGINS="loss_chunked" \
    LCX_ARGS="--set run.attention=sm80" scripts/bench/step_bench.sh .bundle > $o/step.log 2>&1
  cat $o/step/step_bench.md >> $o/summary.txt; echo "step done at $(( $(date +%s) - T0 )) s" >> $o/summary.txt
fi
(( $(left) > 100 )) && suite sm80 $R --attention=sm80
(( $(left) > 100 )) && suite compute80 $R80
cat $o/summary.txt
