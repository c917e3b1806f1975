#!/usr/bin/env bash
# Makes the release archive lcx-<version>-linux-x86_64.tar.gz from a build configured with
# LCX_CUDA_ARCHS=all (machine code for sm_80, sm_86, sm_89, sm_90a and sm_100, compute_100 PTX for
# later GPUs; cmake/lcx_cuda_archs.cmake): scripts/bundle.sh's relocatable tree (RPATH $ORIGIN,
# the non-system libraries beside the binaries, OpenBLAS too), the plugins and the rates table,
# without the test binaries, with lcx-env.sh (scripts/gpu_env.sh: the CUDA toolkit's and the
# PyTorch wheels' libraries on the library path) and INSTALL. The build folder is configured
# (Release, no tests) where it does not exist yet; a full build for every target takes long.
#   scripts/release.sh [build folder, default build-release] [output folder, default .]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build-release}
dest=${2:-.}
version=$(sed -n 's/^project(lcx VERSION \([0-9.]*\).*/\1/p' CMakeLists.txt)
name=lcx-$version-linux-x86_64

if [[ ! -f $build/CMakeCache.txt ]]; then
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DLCX_CUDA_ARCHS=all -DLCX_TESTS=OFF >/dev/null
fi
archs=$(sed -n 's/^LCX_CUDA_ARCHS:STRING=//p' "$build/CMakeCache.txt")
[[ $archs == all ]] || { echo "release: $build was configured with LCX_CUDA_ARCHS=$archs; a release needs all" >&2; exit 1; }
cmake --build "$build"

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
LCX_BUNDLE_BLAS=1 scripts/bundle.sh "$build" "$stage/$name" >/dev/null
rm -rf "$stage/$name/tests" "$stage/$name/source_dir" "$stage/$name/build_dir"
cp scripts/gpu_env.sh "$stage/$name/lcx-env.sh"

# The GPUs the library carries code for, checked rather than assumed.
if command -v cuobjdump >/dev/null || [[ -x /usr/local/cuda/bin/cuobjdump ]]; then
  objdump_bin=$(command -v cuobjdump || echo /usr/local/cuda/bin/cuobjdump)
  elves=$("$objdump_bin" --list-elf "$stage/$name/lib/liblcx_core.so" | grep -o 'sm_[0-9]*a\?' | sort -u | tr '\n' ' ')
  for sm in sm_80 sm_86 sm_89 sm_90a sm_100; do
    [[ " $elves" == *" $sm "* ]] || { echo "release: liblcx_core.so has no $sm code (it has: $elves)" >&2; exit 1; }
  done
  "$objdump_bin" --list-ptx "$stage/$name/lib/liblcx_core.so" | grep -q 'sm_100' ||
    { echo "release: liblcx_core.so has no compute_100 PTX for later GPUs" >&2; exit 1; }
fi

cat >"$stage/$name/INSTALL" <<NOTES
lcx $version for Linux x86-64 and NVIDIA GPUs from sm_80 (A100, A10/A40, RTX 30xx/40xx, L4, L40S,
RTX 6000 Ada, H100, H200, B200; later GPUs through compute_100 PTX, compiled by the driver at the
first start). Older GPUs (V100, T4) are refused by name at the start.

Needs: an NVIDIA driver for CUDA 13 (580 or newer); the CUDA 13 runtime libraries (libcudart.so.13,
libcublas.so.13, libcublasLt.so.13); NCCL 2 (libnccl.so.2); cuDNN 9 (libcudnn.so.9) for attention
on GPUs other than the H100 and H200 (lcx's own kernels there run at a seventh of its rate, so a run
without cuDNN stops at the start unless [run] attention = "own"; on Hopper lcx's own kernels serve). Either from the CUDA toolkit and NVIDIA's packages,
or from the PyTorch (cu130) wheels' nvidia-* packages, which lcx-env.sh finds.

  tar xzf $name.tar.gz
  cd $name
  source lcx-env.sh \$PWD          # /usr/local/cuda's libraries and the wheels' nvidia/*/lib
  bin/lcx-train --version
  bin/lcx-train --plan --config my_run.toml
  bin/lcx-train --config my_run.toml

The folder can live anywhere: the binaries find lib/, lib/lcx/plugins/ and share/lcx/rates.toml
beside themselves. share/lcx/rates.toml holds a row per GPU lcx knows (measured where it says
source = "calibrate"); \`bin/lcx-train calibrate\` measures this GPU's row into ~/.config/lcx/rates.toml.
NOTES

mkdir -p "$dest"
tar -C "$stage" -czf "$dest/$name.tar.gz" "$name"
echo "release: $dest/$name.tar.gz, $(du -h "$dest/$name.tar.gz" | cut -f1)"
