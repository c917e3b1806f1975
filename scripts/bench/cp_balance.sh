#!/usr/bin/env bash
# Work per rank under cp_ring (issue 12, part 5): each virtual rank's ring schedule timed alone on
# the GPU (tests/bench/cp_balance_bench.cpp says why alone), zigzag beside contiguous sharding,
# Qwen3-8B's attention shape. Writes $OUT/cp_balance.jsonl and $OUT/cp_balance.md; about 30 s.
#   TOKENS="131072 262144" CPS=2,4,8 MIXES="pg19 short" SEEDS="1 2 3" scripts/bench/cp_balance.sh build
# (each mix and seed: the zigzag and the balanced layout under its document masks, side by side)
set -euo pipefail
build=${1:-build}
out=${OUT:-/tmp/lcx-cp-balance}
mkdir -p "$out"
: >"$out/cp_balance.jsonl"
for t in ${TOKENS:-131072 262144}; do
  "$build/tests/cp_balance_bench" --device "${DEVICE:-cuda}" --tokens "$t" --cp "${CPS:-2,4,8}" ${BENCH_ARGS:-} \
    >>"$out/cp_balance.jsonl"
  # Packed documents (issue 23): cp_ring's layout balanced for each length mix's bounds, masked by
  # them, beside the rest.
  for mix in ${MIXES:-}; do
    for seed in ${SEEDS:-1}; do
      "$build/tests/cp_balance_bench" --device "${DEVICE:-cuda}" --tokens "$t" --cp "${CPS:-2,4,8}" --mix "$mix" \
        --seed "$seed" --documents-only ${BENCH_ARGS:-} >>"$out/cp_balance.jsonl"
    done
  done
done
python3 - "$out/cp_balance.jsonl" >"$out/cp_balance.md" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
print("| tokens | cp | sharding | per-rank attention fwd+bwd ms (rank 0, 1, ...) | work units per rank | max / min | spread (max-min)/mean | sent per layer fwd / bwd MiB |")
print("|---|---|---|---|---|---|---|---|")
for s in (r for r in rows if r.get("summary")):
    ranks = [r for r in rows if not r.get("summary") and r["layout"] == s["layout"] and r["cp"] == s["cp"] and r["tokens"] == s["tokens"]]
    ms = ", ".join(f"{r['total_ms']:.1f}" for r in ranks)
    units = sorted({r["work_units"] for r in ranks})
    units = f"{units[0]:g}" if len(units) == 1 else f"{units[0]:g} to {units[-1]:g}"
    layout = s["layout"] + (f", k = {s['k']}, predicted spread {s['predicted_spread_pct']:.1f}%, "
                            f"{max(r['pieces'] for r in ranks)} calls of the attention (pieces, or rounds)" if "k" in s else "")
    print(f"| {s['tokens']:,} | {s['cp']} | {layout} | {ms} | {units} | {s['max_over_min']:.3f} | {s['spread_pct']:.1f}% | "
          f"{s['sent_per_layer_forward_mib']:.0f} / {s['sent_per_layer_backward_mib']:.0f} |")
# The call cost cp_ring's layouts weigh (ring_pieces.h kCallCostPairs), refitted on these runs:
# each masked rank's time against the pairs its rounds compute and its cuDNN calls, least squares
# through the origin.
masked = [r for r in rows if not r.get("summary") and r.get("padded_pairs", 0) > 0]
if len(masked) >= 2:
    p = [r["padded_pairs"] / 1e9 for r in masked]
    c = [float(r["batches"]) for r in masked]
    t = [r["total_ms"] for r in masked]
    spp, scc, spc = sum(x * x for x in p), sum(x * x for x in c), sum(x * y for x, y in zip(p, c))
    spt, sct = sum(x * y for x, y in zip(p, t)), sum(x * y for x, y in zip(c, t))
    det = spp * scc - spc * spc
    if det > 0:
        a, b = (spt * scc - sct * spc) / det, (sct * spp - spt * spc) / det
        err = sorted(abs(a * x + b * y - z) / z for x, y, z in zip(p, c, t))
        print(f"\nFit over {len(masked)} masked rank times: {a:.1f} ms per 1e9 computed pairs + {b:.3f} ms per cuDNN "
              f"call (a call weighs {b / a * 1e9 / 1e6:.2f}M pairs; ring_pieces.h kCallCostPairs); relative error "
              f"median {100 * err[len(err) // 2]:.1f}%, p90 {100 * err[int(0.9 * (len(err) - 1))]:.1f}%, "
              f"most {100 * err[-1]:.1f}%")
PY
cat "$out/cp_balance.md"
