#!/usr/bin/env bash
# Work per rank under cp_ring, the ring's balance: each virtual rank's ring schedule timed alone on
# the GPU (tests/bench/cp_balance_bench.cpp says why alone), zigzag beside contiguous sharding,
# Qwen3-8B's attention shape. Writes $OUT/cp_balance.jsonl and $OUT/cp_balance.md; about 30 s without
# MIXES, about 4 minutes at 131,072 tokens with MIXES="pg19 short" SEEDS="1 2 3" (9 repetitions).
#   TOKENS="131072 262144" CPS=2,4,8 MIXES="pg19 short" SEEDS="1 2 3" scripts/bench/cp_balance.sh build
#   TOKENS=1048576 CPS=8 UNMASKED=0 MIXES="pg19 short" SEEDS="1 2 3" CP_BALANCE_ARGS="--reps 3" ...   (a million tokens)
# (each mix and seed: the zigzag and the balanced layout under its document masks, side by side)
set -euo pipefail
build=${1:-build}
out=${OUT:-/tmp/lcx-cp-balance}
mkdir -p "$out"
: >"$out/cp_balance.jsonl"
for t in ${TOKENS:-131072 262144}; do
  # The unmasked zigzag and contiguous layouts (UNMASKED=0 skips them: at a million tokens each rank
  # runs a full causal ring, about a minute a layout and repetition).
  if [[ ${UNMASKED:-1} != 0 ]]; then
    "$build/tests/cp_balance_bench" --device "${DEVICE:-cuda}" --tokens "$t" --cp "${CPS:-2,4,8}" ${CP_BALANCE_ARGS:-} \
      >>"$out/cp_balance.jsonl"
  fi
  # Packed documents: cp_ring's layout balanced for each length mix's bounds, masked by
  # them, beside the rest.
  for mix in ${MIXES:-}; do
    for seed in ${SEEDS:-1}; do
      "$build/tests/cp_balance_bench" --device "${DEVICE:-cuda}" --tokens "$t" --cp "${CPS:-2,4,8}" --mix "$mix" \
        --seed "$seed" --documents-only ${CP_BALANCE_ARGS:-} >>"$out/cp_balance.jsonl"
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
# The costs cp_ring's layouts weigh (cost.h RingCosts: call_pairs, octave_calls, query_tile_pairs),
# refitted on these runs: each masked rank's time against the pairs its rounds compute, its cuDNN
# calls, their key octaves and its query tiles (lcx/attention_cost.h AttentionWork), least squares
# of the relative errors (a rank of 5 ms counts as much as one of 300) through the origin.
masked = [r for r in rows if not r.get("summary") and r.get("padded_pairs", 0) > 0 and "query_tiles" in r]
terms = 4
if len(masked) > terms:
    X = [[r["padded_pairs"] / 1e9, float(r["batches"]), float(r["call_octaves"]), r["query_tiles"] / 1e3] for r in masked]
    t = [r["total_ms"] for r in masked]
    W = [[v / z for v in x] for x, z in zip(X, t)]  # each row over its time: relative errors
    M = [[sum(w[i] * w[j] for w in W) for j in range(terms)] + [sum(w[i] for w in W)] for i in range(terms)]
    for i in range(terms):  # Gauss-Jordan on the normal equations
        M[i] = [v / M[i][i] for v in M[i]]
        for j in range(terms):
            if j != i:
                M[j] = [a - M[j][i] * b for a, b in zip(M[j], M[i])]
    a, b, o, q = (M[i][terms] for i in range(terms))
    err = sorted(abs(a * x[0] + b * x[1] + o * x[2] + q * x[3] - z) / z for x, z in zip(X, t))
    print(f"\nFit over {len(masked)} masked rank times: {a:.1f} ms per 1e9 computed pairs + {b:.3f} ms per cuDNN call "
          f"+ {o:.3f} ms per call octave + {q:.2f} ms per 1000 query tiles (cost.h RingCosts call_pairs "
          f"{b / a * 1e9 / 1e6:.2f}M pairs, octave_calls {o / b:.2f}, query_tile_pairs {q / a * 1e6 / 1e3:.1f}k pairs); "
          f"relative error median {100 * err[len(err) // 2]:.1f}%, p90 {100 * err[int(0.9 * (len(err) - 1))]:.1f}%, "
          f"most {100 * err[-1]:.1f}%")
PY
cat "$out/cp_balance.md"
