#!/usr/bin/env bash
# The host time of cp_ring's layout of packed documents (balance.h balanced_layout, run in
# shard() once per sequence): the book and short-document length mixes, seeds 1-3, on 2, 4 and 8 ranks, at
# 131,072 and 1,048,576 tokens, on one core of this machine (no GPU: cp_balance_bench
# --layouts-only costs the layouts and runs nothing). Prints one row per case and the slowest.
#   TOKENS="131072 1048576" scripts/bench/layout_host_time.sh build
set -euo pipefail
build=${1:-build}
rows=$(mktemp)
trap 'rm -f "$rows"' EXIT
for t in ${TOKENS:-131072 1048576}; do
  for mix in ${MIXES:-pg19 short}; do
    for seed in ${SEEDS:-1 2 3}; do
      # One head of 8: nothing runs, and the layout does not depend on the attention's shape.
      taskset -c 0 "$build/tests/cp_balance_bench" --device cpu --tokens "$t" --cp "${CPS:-2,4,8}" --mix "$mix" \
        --seed "$seed" --documents-only --layouts-only --heads 1 --kv-heads 1 --head-dim 8 | grep '"layout_host_s"' >>"$rows"
    done
  done
done
python3 - "$rows" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
print("| tokens | cp | documents | k | bounds moved | predicted spread | layout host s |")
print("|---|---|---|---|---|---|---|")
for r in rows:
    docs = r["layout"].split("+", 1)[1]
    print(f"| {r['tokens']:,} | {r['cp']} | {docs} | {r['k']} | {r['bounds_moved']} | "
          f"{r['predicted_spread_pct']:.1f}% | {r['layout_host_s']:.3f} |")
for t in sorted({r["tokens"] for r in rows}):
    print(f"slowest at {t:,} tokens: {max(r['layout_host_s'] for r in rows if r['tokens'] == t):.3f} s")
PY
