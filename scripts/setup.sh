#!/usr/bin/env bash
# Installs what is missing (Debian packages; a no-op when all is there), fetches the data the
# quickstart and tests use, then configures and builds into build/.
#   scripts/setup.sh            install, fetch, build
#   LCX_BUILD_DIR=dir scripts/setup.sh   build elsewhere
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(cmake ninja-build g++ pkg-config ccache git
          libboost-dev libboost-program-options-dev libtomlplusplus-dev libspdlog-dev libfmt-dev
          nlohmann-json3-dev libgtest-dev libopenblas-dev libutf8proc-dev libpcre2-dev zlib1g-dev libzstd-dev
          bible-kjv npm)
missing=()
for p in "${packages[@]}"; do
  if [ "$p" = npm ] && command -v npm >/dev/null 2>&1; then continue; fi
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
fi

if [ -x scripts/fetch_data.sh ]; then
  scripts/fetch_data.sh
fi

build=${LCX_BUILD_DIR:-build}
jobs=$(nproc)
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=${CMAKE_BUILD_TYPE:-RelWithDebInfo} >/dev/null
ninja -C "$build" -j"$jobs"
echo "setup: built into $build/ (bin/lcx-train, lib/lcx/plugins/)"
