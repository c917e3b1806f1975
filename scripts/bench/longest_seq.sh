#!/usr/bin/env bash
# The longest sequence one GPU trains, Qwen3-4B's shape, with the loss as the only
# lever: core's plain loss against loss_chunked, checkpointing on (the default memory strategy),
# no offload, bf16 weights and moments (master_dtype bf16), one step on random token ids.
#
# A full step at the limit takes minutes, so the peak is measured on the same shape with fewer
# layers (LAYERS, default 2 and 4) at two lengths per loss, fitted as
#   peak(L, T) = a + b*L + c*T + d*L*T
# (weights and optimizer state grow with L; saved layer inputs with L*T; the loss's and one
# layer's recompute transients with T), and solved for the longest T at 36 layers under the GPU's
# memory (this H200's, from nvidia-smi) and under 80 GB, less RESERVE_GIB for what the allocator
# does not count (CUDA context, library workspaces). The fit is checked once with all 36 layers
# at CHECK_TOKENS (predicted against measured peak), and lcx-train --plan's own longest sequence
# is printed beside it. The PyTorch peer (scripts/bench/torch_step.py: chunked loss, gradient
# checkpointing, no offload) runs the same layer counts and lengths and is fitted the same way.
#
# Runs on the GPU machine from the repository root with the bundle as BUILD and
# data/qwen3/tokenizer.json present. Every run is under `timeout`; one that fails, runs out of
# memory or would pass the time budget leaves a row saying so. About 4.5 minutes on an H200
# (BUDGET_S, default 280, stops starting runs after that; the last may take RUN_TIMEOUT or
# TORCH_TIMEOUT more). Lengths: PLAIN_LENGTHS, CHUNKED_LENGTHS (PyTorch runs the chunked ones). Writes $OUT/longest_seq.md, the
# measured peaks as $OUT/longest_seq.csv, and each run's log.
#   OUT=/tmp/longest scripts/bench/longest_seq.sh build
#   FIT_ONLY=peaks.csv scripts/bench/longest_seq.sh build   (no runs: fits a CSV of the same columns)
set -uo pipefail
build=${1:-build}
out=${OUT:-/tmp/lcx-longest-seq}
layers=${LAYERS:-"2 4"}
plain_lengths=${PLAIN_LENGTHS:-"32768 49152"}
chunked_lengths=${CHUNKED_LENGTHS:-"131072 196608"}
full_layers=${FULL_LAYERS:-36}
check_tokens=${CHECK_TOKENS:-32768}
check_losses=${CHECK:-chunked}
torch=${TORCH:-1}
budget_s=${BUDGET_S:-280}
reserve_gib=${RESERVE_GIB:-2}
run_timeout=${RUN_TIMEOUT:-100}
torch_timeout=${TORCH_TIMEOUT:-150}
fit_only=${FIT_ONLY:-}
torch_step=${TORCH_STEP:-scripts/bench/torch_step.py}
mkdir -p "$out"
csv=$out/longest_seq.csv
[[ -f scripts/gpu_env.sh && -z $fit_only ]] && source scripts/gpu_env.sh "$build"

# The GPU's memory in bytes (nvidia-smi reports MiB); an H200's 143,771 MiB when it cannot be asked.
gpu_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1 | tr -dc 0-9)
gpu_bytes=$(( ${gpu_mib:-143771} * 1048576 ))
h100_bytes=$(( 81559 * 1048576 ))  # an 80 GB H100's total, as nvidia-smi reports it

# manifest LOSS LAYERS TOKENS DIR: a run.toml for one step of the Qwen3-4B shape.
manifest() {
  local loss=$1 nl=$2 tokens=$3 dir=$4 load=""
  [[ $loss == chunked ]] && load='"loss_chunked"'
  cat >"$dir/run.toml" <<TOML
[run]
output_dir = "$dir/out"
device = "cuda"
seed = 0
[model]
module = "qwen3"
init = '{"preset": "qwen3-4b", "num_hidden_layers": $nl}'
dtype = "bf16"
[data]
tokenizer = "$PWD/data/qwen3/tokenizer.json"
source = "$out/ids.tokens"
seq_len = $tokens
drop_last = true
shuffle = false
[train]
lr = 1e-5
max_steps = 1
save_final = false
master_dtype = "bf16"
[plugins]
load = [$load]
TOML
}

# run_lcx LOSS LAYERS TOKENS: one step; appends "lcx,LOSS,LAYERS,TOKENS,PEAK_BYTES,STATUS,SECONDS".
run_lcx() {
  local loss=$1 nl=$2 tokens=$3 dir="$out/lcx-$1-$2-$3"
  if ((SECONDS > budget_s)); then
    echo "lcx,$loss,$nl,$tokens,,skipped (time budget),0" >>"$csv"
    return
  fi
  rm -rf "$dir" && mkdir -p "$dir"
  manifest "$loss" "$nl" "$tokens" "$dir"
  local start=$SECONDS
  timeout "$run_timeout" "$build/bin/lcx-train" --config "$dir/run.toml" >"$dir/lcx.log" 2>&1
  local rc=$? took=$((SECONDS - start)) peak="" status=ok
  peak=$(python3 -c "
import json, sys
try:
    print(max(json.loads(l).get('peak_gpu_bytes', 0) for l in open(sys.argv[1]) if l.strip()))
except (OSError, ValueError):
    pass" "$dir/out/metrics.jsonl")
  if [[ -z $peak || $peak == 0 ]]; then
    peak=""
    if [[ $rc -eq 124 ]]; then status="timed out after ${run_timeout} s"
    elif grep -qi "out of memory" "$dir/lcx.log"; then status="out of memory"
    else status="failed (rc $rc)"; fi
  fi
  echo "lcx,$loss,$nl,$tokens,$peak,$status,$took" >>"$csv"
  echo "lcx $loss layers=$nl tokens=$tokens: ${peak:-no peak} ($status, ${took} s)" >&2
}

# lcx_point LOSS LAYERS TOKENS: a point of the fit; a length that runs out of memory is tried once
# more at three quarters (the fit takes any two lengths per layer count).
lcx_point() {
  run_lcx "$@"
  if tail -1 "$csv" | grep -q ",out of memory,"; then run_lcx "$1" "$2" $(($3 * 3 / 4 / 1024 * 1024)); fi
}

# run_torch LAYERS TOKENS...: torch_step.py, one process for the lengths of one layer count.
run_torch() {
  local nl=$1
  shift
  if ((SECONDS > budget_s)); then
    for t in "$@"; do echo "pytorch,chunked,$nl,$t,,skipped (time budget),0" >>"$csv"; done
    return
  fi
  local log="$out/torch-$nl.log" start=$SECONDS
  # --steps 1: one warm-up step and one timed; the peak covers both.
  PYTHONUNBUFFERED=1 timeout "$torch_timeout" python3 "$torch_step" --model qwen3-4b --layers "$nl" \
    --tokens "$@" --steps 1 >"$log.json" 2>"$log"
  local rc=$? took=$((SECONDS - start))
  python3 - "$log.json" "$nl" "$rc" "$took" "$@" >>"$csv" <<'PY'
import json, sys
path, nl, rc, took, lengths = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5:]
got = {}
for line in open(path):
    try:
        r = json.loads(line)
    except ValueError:
        continue
    got[str(r.get("tokens"))] = r
for t in lengths:
    r = got.get(t)
    if r and "peak_gib" in r:
        print(f"pytorch,chunked,{nl},{t},{int(r['peak_gib'] * 2**30)},ok,{took}")
    else:
        why = r["error"] if r and "error" in r else ("timed out" if rc == 124 else f"failed (rc {rc})")
        print(f"pytorch,chunked,{nl},{t},,{why},{took}")
PY
  echo "pytorch layers=$nl tokens=$*: rc $rc, ${took} s" >&2
}

# plan_longest LOSS GPU_BYTES: lcx-train --plan's longest sequence for the 36-layer manifest.
plan_longest() {
  local dir="$out/plan-$1"
  mkdir -p "$dir"
  manifest "$1" "$full_layers" "$check_tokens" "$dir"
  timeout 60 "$build/bin/lcx-train" --plan --config "$dir/run.toml" --gpu-memory "$2" 2>&1 |
    sed -n 's/.*longest sequence: \([0-9,]*\) tokens.*/\1/p' | tr -d , | head -1
}

if [[ -n $fit_only ]]; then
  csv=$fit_only
else
  echo "system,loss,layers,tokens,peak_bytes,status,seconds" >"$csv"
  longest=0
  for t in $plain_lengths $chunked_lengths $check_tokens; do ((t > longest)) && longest=$t; done
  # Random ids, enough for one sequence of the longest length (drop_last needs a whole one).
  python3 -c "
import array, random, sys
r = random.Random(0)
array.array('I', (r.randrange(151643) for _ in range(int(sys.argv[1])))).tofile(open(sys.argv[2], 'wb'))" \
    $((longest + 1)) "$out/ids.tokens"
  for nl in $layers; do
    for t in $plain_lengths; do lcx_point plain "$nl" "$t"; done
    for t in $chunked_lengths; do lcx_point chunked "$nl" "$t"; done
  done
  for loss in $check_losses; do run_lcx "$loss" "$full_layers" "$check_tokens"; done
  if [[ $torch != 0 ]]; then
    for nl in $layers; do
      run_torch "$nl" $chunked_lengths
      # Lengths that ran out of memory, once more at three quarters.
      short=$(awk -F, -v nl="$nl" '$1 == "pytorch" && $3 == nl && $6 == "out of memory" { print int($4 * 3 / 4 / 1024) * 1024 }' "$csv")
      [[ -n $short ]] && run_torch "$nl" $short
    done
  fi
fi

plan_chunked_gpu=$(plan_longest chunked "$gpu_bytes") plan_chunked_80=$(plan_longest chunked "$h100_bytes")
plan_plain_gpu=$(plan_longest plain "$gpu_bytes") plan_plain_80=$(plan_longest plain "$h100_bytes")

python3 - "$csv" "$full_layers" "$check_tokens" "$gpu_bytes" "$h100_bytes" "$reserve_gib" \
  "${plan_plain_gpu:-}" "${plan_plain_80:-}" "${plan_chunked_gpu:-}" "${plan_chunked_80:-}" \
  >"$out/longest_seq.md" <<'PY'
import csv, sys
path, full_layers, check_t = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
gpu_bytes, h100_bytes, reserve = int(sys.argv[4]), int(sys.argv[5]), float(sys.argv[6]) * 2**30
plans = {("lcx", "plain"): sys.argv[7:9], ("lcx", "chunked"): sys.argv[9:11]}
GiB = 2**30
rows = list(csv.DictReader(open(path)))


def solve(m, v):
    """Gaussian elimination with partial pivoting; None when singular."""
    n = len(v)
    a = [row[:] + [v[i]] for i, row in enumerate(m)]
    for col in range(n):
        p = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[p][col]) < 1e-12:
            return None
        a[col], a[p] = a[p], a[col]
        for r in range(n):
            if r != col:
                f = a[r][col] / a[col][col]
                for k in range(col, n + 1):
                    a[r][k] -= f * a[col][k]
    return [a[i][n] / a[i][i] for i in range(n)]


def fit(points):
    """Least squares of peak = a + b L + c T + d L T over (L, T, peak) with L, T, peak scaled to
    order one (T in 64k tokens, peak in GiB); returns the coefficients in bytes and tokens."""
    if len(points) < 4 or len({p[0] for p in points}) < 2 or len({p[1] for p in points}) < 2:
        return None
    X = [[1.0, L, T / 65536, L * T / 65536] for L, T, _ in points]
    y = [P / GiB for _, _, P in points]
    XtX = [[sum(r[i] * r[j] for r in X) for j in range(4)] for i in range(4)]
    Xty = [sum(r[i] * yi for r, yi in zip(X, y)) for i in range(4)]
    s = solve(XtX, Xty)
    if s is None:
        return None
    a, b, c, d = s
    return a * GiB, b * GiB, c * GiB / 65536, d * GiB / 65536


def predict(f, L, T):
    a, b, c, d = f
    return a + b * L + c * T + d * L * T


def longest(f, L, budget):
    a, b, c, d = f
    per_token = c + d * L
    if per_token <= 0:
        return None
    return int((budget - a - b * L) / per_token)


def tok(n):
    return "-" if n is None else f"{n:,}" if n > 0 else "none"


print(f"Longest sequence on one GPU, Qwen3-4B shape (H 2560, I 9728, 32/8 heads, V 151,936, tied), bf16 weights and "
      f"AdamW moments, checkpointing on, no offload, one step on random ids. Budgets: this GPU's "
      f"{gpu_bytes / GiB:.1f} GiB and an 80 GB H100's {h100_bytes / GiB:.1f} GiB, each less {reserve / GiB:.1f} GiB "
      f"for what the allocator does not count.\n")
print("Measured peaks (allocator peak over the step; PyTorch: torch.cuda.max_memory_allocated):\n")
print("| system | loss | layers | tokens | peak GiB | run s | status |")
print("|---|---|---|---|---|---|---|")
for r in rows:
    peak = f"{int(r['peak_bytes']) / GiB:.2f}" if r["peak_bytes"] else "-"
    print(f"| {r['system']} | {r['loss']} | {r['layers']} | {int(r['tokens']):,} | {peak} | {r['seconds']} | {r['status']} |")

groups = {}
for r in rows:
    if r["status"] == "ok" and r["peak_bytes"] and int(r["layers"]) != full_layers:
        groups.setdefault((r["system"], r["loss"]), []).append((int(r["layers"]), int(r["tokens"]), int(r["peak_bytes"])))

print(f"\nFit peak(L, T) = a + b L + c T + d L T over the shorter models, solved at {full_layers} layers:\n")
print(f"| system | loss | fixed at {full_layers} layers GiB | per token at {full_layers} layers KB | "
      f"longest, {gpu_bytes / GiB:.0f} GiB GPU | longest, 80 GB GPU | lcx-train --plan (same two) |")
print("|---|---|---|---|---|---|---|")
fits = {}
for key in [("lcx", "plain"), ("lcx", "chunked"), ("pytorch", "chunked")]:
    pts = groups.get(key, [])
    f = fit(pts)
    plan = plans.get(key)
    plan_cell = " / ".join(tok(int(p)) if p else "-" for p in plan) if plan else "-"
    if f is None:
        print(f"| {key[0]} | {key[1]} | - | - | not enough runs ({len(pts)} of 4) | - | {plan_cell} |")
        continue
    fits[key] = f
    a, b, c, d = f
    fixed, per_token = a + b * full_layers, c + d * full_layers
    print(f"| {key[0]} | {key[1]} | {fixed / GiB:.1f} | {per_token / 1e3:.0f} | {tok(longest(f, full_layers, gpu_bytes - reserve))} | "
          f"{tok(longest(f, full_layers, h100_bytes - reserve))} | {plan_cell} |")

checks = [r for r in rows if int(r["layers"]) == full_layers]
if checks:
    print(f"\nCheck of the extrapolation with all {full_layers} layers:\n")
    print("| system | loss | tokens | predicted GiB | measured GiB | error |")
    print("|---|---|---|---|---|---|")
    for r in checks:
        f = fits.get((r["system"], r["loss"]))
        pred = predict(f, full_layers, int(r["tokens"])) if f else None
        meas = int(r["peak_bytes"]) if r["peak_bytes"] else None
        err = f"{(pred - meas) / meas * 100:+.1f}%" if pred and meas else "-"
        cell = lambda b: f"{b / GiB:.2f}" if b else "-"
        print(f"| {r['system']} | {r['loss']} | {int(r['tokens']):,} | {cell(pred)} | {cell(meas)} | "
              f"{err if meas else r['status']} |")
print("\nThe guide's figures for the peer: 32k -> 160k tokens on an 80 GB GPU with the chunked loss; about 310k on an "
      "H200 without offload.")
PY
cat "$out/longest_seq.md"
