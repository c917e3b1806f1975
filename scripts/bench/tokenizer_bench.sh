#!/usr/bin/env bash
# Builds lcx_tokenizer_bench as one static binary (it runs on machines without lcx's libraries,
# such as the GPU machine) into BUILD_DIR/bench/, then, when python's `tokenizers` is importable,
# runs tokenizer_bench.py on the KJV text.
#   scripts/bench/tokenizer_bench.sh [BUILD_DIR]        (default: build)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
build="${1:-$root/build}"
bin="$build/bench/lcx_tokenizer_bench"
if [[ ! -x "$bin" || -n "$(find "$root/core/src/data" "$root/scripts/bench/tokenizer_bench.cpp" -newer "$bin" 2>/dev/null)" ]]; then
  mkdir -p "$build/bench"
  g++ -O2 -std=c++20 -static -pthread -I"$root/core/src" -I"$root/core/include" \
    "$root/scripts/bench/tokenizer_bench.cpp" "$root"/core/src/data/{tokenizer,bpe,pre_tokenizer,utf8}.cpp \
    "$root/core/src/util/sha256.cpp" -l:libutf8proc.a -o "$bin"
fi
if python3 -c "import tokenizers" 2>/dev/null; then
  python3 "$root/scripts/bench/tokenizer_bench.py" --lcx "$bin" --tokenizer "$root/data/qwen3/tokenizer.json" \
    --text "$root/data/kjv/kjv.txt"
else
  "$bin" "$root/data/qwen3/tokenizer.json" "$root/data/kjv/kjv.txt"
fi
