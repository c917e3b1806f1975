#!/usr/bin/env bash
# Makes a relocatable bundle of a build folder for a machine that has the CUDA driver and
# libraries but not this machine's other shared libraries (the GPU machine: no toml++, spdlog,
# utf8proc, OpenBLAS...). Layout, as the install tree: bin/, lib/ (liblcx_core.so and the
# non-system libraries ldd finds), lib/lcx/plugins/, share/lcx/ (the rates table), tests/ (test and benchmark binaries, whose
# RPATH $ORIGIN/../lib finds lib/). CUDA, cuDNN and NCCL libraries are left out: the GPU machine
# has its own. Everything is stripped to stay well under the 64 MiB a device call carries.
#   scripts/bundle.sh [build folder, default build] [bundle folder, default .bundle]
set -euo pipefail
build=${1:-build}
out=${2:-.bundle}
[[ -f $build/lib/liblcx_core.so ]] || { echo "bundle: $build/lib/liblcx_core.so not found; build first" >&2; exit 1; }

rm -rf "$out"
mkdir -p "$out/bin" "$out/lib/lcx/plugins" "$out/share/lcx" "$out/tests"
cp -a "$build"/share/lcx/. "$out/share/lcx/"
cp -a "$build"/bin/. "$out/bin/" 2>/dev/null || true
cp -L "$build"/lib/*.so* "$out/lib/"
[[ -d $build/lib/lcx/plugins ]] && cp -a "$build"/lib/lcx/plugins/. "$out/lib/lcx/plugins/"
if [[ -d $build/tests ]]; then
  find "$build/tests" -maxdepth 1 -type f -perm -u+x -exec cp {} "$out/tests/" \;
  if compgen -G "$build/tests/plugins/*.so" >/dev/null; then
    mkdir -p "$out/tests/plugins"
    cp -a "$build"/tests/plugins/*.so "$out/tests/plugins/"
  fi
fi

# The libraries to carry along: those the GPU machine's image lacks (its system has glibc, libstdc++,
# OpenBLAS and the CUDA stack). LCX_BUNDLE_BLAS=1 carries OpenBLAS too (36 MB) for machines without it.
carry='libtomlplusplus|libboost_program_options|libspdlog|libfmt|libutf8proc|libgtest|libgmock'
[[ ${LCX_BUNDLE_BLAS:-0} != 0 ]] && carry+='|libopenblas|libgfortran|libquadmath'
mapfile -t elves < <(find "$out" -type f \( -name '*.so*' -o -perm -u+x \) -exec sh -c 'head -c4 "$1" | grep -q ELF && echo "$1"' _ {} \;)
for f in "${elves[@]}"; do
  ldd "$f" 2>/dev/null | awk '/=>/ && $3 ~ /^\// {print $1, $3}' | while read -r name path; do
    if [[ $name =~ ^($carry) && ! -e $out/lib/$name ]]; then cp -L "$path" "$out/lib/$name"; fi
  done
done
for f in "${elves[@]}" "$out"/lib/*.so*; do strip --strip-unneeded "$f" 2>/dev/null || true; done

missing=$(for f in "${elves[@]}"; do LD_LIBRARY_PATH=$out/lib ldd "$f" 2>/dev/null | grep 'not found' || true; done | sort -u)
[[ -z $missing ]] || { echo "bundle: unresolved libraries:" >&2; echo "$missing" >&2; exit 1; }
# Test binaries name fixtures by the source and build folders they were built at; record them so
# the GPU machine can put links there (scripts/gpu_all.sh).
sed -n 's/^CMAKE_HOME_DIRECTORY:INTERNAL=//p' "$build/CMakeCache.txt" >"$out/source_dir"
(cd "$build" && pwd) >"$out/build_dir"
echo "bundle: $out, $(du -sh "$out" | cut -f1)"
