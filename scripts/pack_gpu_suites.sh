#!/usr/bin/env bash
# Packs, on the CPU machine, what scripts/gpu_suites.sh runs on the GPU machine (issue 54's checks):
# the release archive of an every-architecture build (scripts/release.sh), the test binaries that
# hold GPU cases (stripped; they run beside the archive's libraries), a core library and cp_ring
# plugin built with compute_80 PTX alone (LCX_CUDA_ARCHS=80-virtual), and the quickstart's data.
#   scripts/pack_gpu_suites.sh [every-arch build, default build] [compute_80 build, default build-80] [out, default .gpu-suites]
# Then, with the device tool: carry [".gpu-suites"], command "bash scripts/gpu_suites.sh .gpu-suites".
# The folder stays under the 64 MiB a call carries beside the tracked files (about 45 MB).
set -euo pipefail
cd "$(dirname "$0")/.."
all=${1:-build}
sm80=${2:-build-80}
out=${3:-.gpu-suites}
[[ $(sed -n 's/^LCX_CUDA_ARCHS:STRING=//p' "$all/CMakeCache.txt") == all ]] || { echo "pack: $all is not LCX_CUDA_ARCHS=all" >&2; exit 1; }
[[ -f $sm80/lib/liblcx_core.so ]] || { echo "pack: $sm80/lib/liblcx_core.so missing (cmake -B $sm80 -DLCX_CUDA_ARCHS=80-virtual)" >&2; exit 1; }
rm -rf "$out" && mkdir -p "$out/tests" "$out/compute80" "$out/data"
scripts/release.sh "$all" "$out" >/dev/null
# The binaries with GPU cases: those listing a test named for the GPU (they skip it here).
for t in "$all"/tests/test_* "$all"/tests/dist_worker; do
  [[ -x $t && -f $t ]] || continue
  listed=$("$t" --gtest_list_tests 2>/dev/null || true)
  if [[ $(basename "$t") == dist_worker ]] || grep -q -E 'Gpu|GPU|Cuda|cuda|Nccl|Pinned' <<<"$listed"; then
    strip --strip-unneeded -o "$out/tests/$(basename "$t")" "$t"
  fi
done
sed -n 's/^CMAKE_HOME_DIRECTORY:INTERNAL=//p' "$all/CMakeCache.txt" >"$out/source_dir"
(cd "$all" && pwd) >"$out/build_dir"
strip --strip-unneeded -o "$out/compute80/liblcx_core.so" "$sm80/lib/liblcx_core.so"
strip --strip-unneeded -o "$out/compute80/lcx_cp_ring.so" "$sm80/lib/lcx/plugins/lcx_cp_ring.so"
mkdir -p "$out/data/qwen3"
gzip -9c data/qwen3/tokenizer.json >"$out/data/qwen3/tokenizer.json.gz"
cp data/qwen3/tokenizer_config.json "$out/data/qwen3/"
gzip -9c data/kjv/kjv.txt >"$out/data/kjv.txt.gz"
echo "pack: $out, $(du -sh "$out" | cut -f1), $(ls "$out/tests" | wc -l) test binaries"
