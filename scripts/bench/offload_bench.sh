#!/usr/bin/env bash
# Step time and peak GPU memory of the Qwen3-4B shape with the checkpointed
# layer inputs on the GPU, offloaded to pinned host memory, and offloaded with the tiled MLP, at
# 64k and 128k tokens, beside transformers + PyTorch (scripts/bench/torch_step.py) on the same GPU.
# Runs ON the GPU machine from the repository root, with a bundle of a build (scripts/bundle.sh)
# and the tokenizer carried:
#
#   scripts/bundle.sh build .bundle          (here)
#   scripts/bench/offload_bench.sh           (there; carry .bundle and data/qwen3)
#
# Each lcx case trains a random-init model of the public shape with LAYERS layers (default 4, so
# the whole table takes about 5 minutes) for 2 steps on random token ids, with the chunked loss
# (as the peer computes its loss), and reads the second step's step_s, peak_gpu_bytes and
# time_memory_wait_s from metrics.jsonl. PyTorch runs the same shape once per length (its own
# offload too when torch_step.py offers --offload). A markdown table goes to stdout and $OUT.
#
# LONG_TOKENS=1048576 adds part 5: offload + tiled MLP at that length with 1 and 2 layers (one
# step each), and the peak extrapolated linearly to the full 36 layers (each layer adds the same
# weights, gradients and optimizer state; the offloaded activations stay on the host). Slow: a
# layer at 1M tokens takes minutes.
#
# MASTER=bf16 (default) keeps AdamW's moments in bf16 without an fp32 master copy, as the peer's
# bf16 model with torch.optim.AdamW does; MASTER=fp32 is lcx's default (16 more bytes a parameter).
#
# Environment: LAYERS, SEQS, LONG_TOKENS, PREFETCH, TILE_ROWS, MASTER, TIMEOUT_S, LCX_BUNDLE, OUT.
set -uo pipefail
bundle=${LCX_BUNDLE:-.bundle}
out=${OUT:-/tmp/lcx-offload-bench}
LAYERS=${LAYERS:-4}
SEQS=${SEQS-"65536 131072"}
LONG_TOKENS=${LONG_TOKENS:-}
PREFETCH=${PREFETCH:-2}
TILE_ROWS=${TILE_ROWS:-0}
MASTER=${MASTER:-bf16}
TIMEOUT_S=${TIMEOUT_S:-240}
tokenizer=$PWD/data/qwen3/tokenizer.json
lcx=$bundle/bin/lcx-train
[[ -x $lcx ]] || { echo "no $lcx: make a bundle with scripts/bundle.sh and carry it" >&2; exit 2; }
[[ -f $tokenizer ]] || { echo "no $tokenizer: carry data/qwen3" >&2; exit 2; }
mkdir -p "$out"
work=$(mktemp -d /tmp/lcx-offload-bench.XXXXXX)
trap 'rm -rf "$work"' EXIT

source "$(dirname "${BASH_SOURCE[0]}")/../gpu_env.sh" "$bundle"

# Random ids below the tokenizer's first special token (no EOS: one long document), enough for
# every step of the longest case.
max_seq=$(echo $SEQS $LONG_TOKENS ${CHECK_TOKENS:-} $(for x in ${EXTRA_RUNS:-}; do echo "$x" | cut -d: -f3; done) | tr ' ' '\n' | sort -n | tail -1)
python3 - "$work/random.tokens" $((3 * max_seq + 1)) <<'PY'
import array, random, sys
rng = random.Random(0)
with open(sys.argv[1], "wb") as f:
    array.array("I", (rng.randrange(151643) for _ in range(int(sys.argv[2])))).tofile(f)
PY

results=$out/offload_bench.jsonl
[[ ${APPEND:-0} == 1 ]] || : >"$results"  # APPEND=1: add to an earlier run's rows in the same $OUT

# write_manifest NAME LAYERS SEQ STEPS PLUGIN... : the run's manifest at $work/m.toml
write_manifest() {
  local name=$1 layers=$2 seq=$3 steps=$4
  shift 4
  local load="" p
  for p in "$@"; do load+="${load:+, }\"$p\""; done
  local dir=$work/run_${name}_${layers}_${seq}
  cat >"$work/m.toml" <<EOF
[run]
output_dir = "$dir"
seed = 0
device = "cuda"

[model]
module = "qwen3"
init = '{"preset": "qwen3-4b", "num_hidden_layers": $layers}'
dtype = "bf16"

[data]
tokenizer = "$tokenizer"
source = "$work/random.tokens"
format = "tokens"
seq_len = $seq

[train]
lr = 1e-5
max_steps = $steps
master_dtype = "$MASTER"

[plugins]
load = [$load]

[offload]
prefetch = $PREFETCH

[tiled_mlp]
tile_rows = $TILE_ROWS
EOF
  # A table for a plugin that is not loaded would be refused as unknown: keep only the loaded ones.
  for p in offload tiled_mlp; do
    [[ " $* " == *" $p "* ]] || python3 - "$work/m.toml" "$p" <<'PY'
import re, sys
path, name = sys.argv[1], sys.argv[2]
text = open(path).read()
open(path, "w").write(re.sub(r"\n\[%s\]\n[^\[]*" % name, "\n", text))
PY
  done
}

# plan_peak LAYERS SEQ PLUGIN... : lcx-train --plan's allocated peak in bytes for that run
plan_peak() {
  local layers=$1 seq=$2
  shift 2
  write_manifest plan "$layers" "$seq" 1 "$@"
  "$lcx" --plan --config "$work/m.toml" --gpu-memory 141GB 2>/dev/null | sed -n 's/.*allocated_bytes=\([0-9]*\).*/\1/p'
}

# run_lcx NAME LAYERS SEQ STEPS PLUGIN... : one training run, one JSON line appended to $results
run_lcx() {
  local name=$1 layers=$2 seq=$3 steps=$4
  write_manifest "$@"
  shift 4
  local dir=$work/run_${name}_${layers}_${seq}
  echo "== lcx $name layers=$layers tokens=$seq" >&2
  local rc=0 start=$SECONDS
  timeout "$TIMEOUT_S" "$lcx" --config "$work/m.toml" >"$out/lcx_${name}_${layers}_${seq}.log" 2>&1 || rc=$?
  python3 - "$dir/metrics.jsonl" "$name" "$layers" "$seq" "$rc" "$((SECONDS - start))" \
      "$out/lcx_${name}_${layers}_${seq}.log" >>"$results" <<'PY'
import json, sys
path, name, layers, seq, rc, wall, log = sys.argv[1:]
row = dict(system="lcx", config=name, layers=int(layers), tokens=int(seq), rc=int(rc), wall_s=int(wall))
try:
    lines = [json.loads(l) for l in open(path) if l.strip()]
    steps = [l for l in lines if "step_s" in l]
    last = steps[-1]
    row.update(step_s=last["step_s"], peak_gib=last.get("peak_gpu_bytes", 0) / 2**30,
               wait_s=last.get("time_memory_wait_s"), loss=last.get("loss"))
    # A plugin that loads but is not wired into the step would measure the default silently.
    if "tiled" in name and "tiled_mlp: " not in open(log, errors="replace").read():
        row["config"] += " (tiled_mlp never ran: the step got no MLP slot)"
except (OSError, IndexError, KeyError, ValueError):
    text = open(log, errors="replace").read()
    row["error"] = "out of memory" if "out of memory" in text.lower() else "failed (rc %s): %s" % (rc, (text.strip().splitlines() or [""])[-1])
print(json.dumps(row), flush=True)
PY
  tail -n 1 "$results" >&2
  rm -rf "$dir"
}

for seq in $SEQS; do
  run_lcx gpu "$LAYERS" "$seq" 2 loss_chunked
  run_lcx offload "$LAYERS" "$seq" 2 loss_chunked offload
  run_lcx offload+tiled "$LAYERS" "$seq" 2 loss_chunked offload tiled_mlp
done

# EXTRA_RUNS="NAME:LAYERS:TOKENS:PLUGIN+PLUGIN ...": more single-step runs, e.g. a full-depth check.
for spec in ${EXTRA_RUNS:-}; do
  IFS=: read -r x_name x_layers x_tokens x_plugins <<<"$spec"
  run_lcx "$x_name" "$x_layers" "$x_tokens" 1 ${x_plugins//+/ }
done

[[ -n $SEQS ]] && echo "== pytorch layers=$LAYERS tokens=$SEQS" >&2
torch_args=(--model qwen3-4b --tokens $SEQS --steps 1 --layers "$LAYERS")
[[ -n $SEQS ]] && timeout $((2 * TIMEOUT_S)) python3 scripts/bench/torch_step.py "${torch_args[@]}" 2>"$out/torch.log" \
  | python3 -c 'import json,sys
for l in sys.stdin:
    r = json.loads(l); r["config"] = "gpu"; print(json.dumps(r), flush=True)' >>"$results"
if [[ -n $SEQS ]] && grep -q -- '--offload' scripts/bench/torch_step.py; then
  timeout $((2 * TIMEOUT_S)) python3 scripts/bench/torch_step.py "${torch_args[@]}" --offload 2>>"$out/torch.log" \
    | python3 -c 'import json,sys
for l in sys.stdin:
    r = json.loads(l); r["config"] = "offload"; print(json.dumps(r), flush=True)' >>"$results"
fi

# Part 5: the long run with LONG_LAYERS layers, extrapolated to the full 36 by the plan's
# difference between 36 layers and LONG_LAYERS (per layer: weights, gradients, optimizer state;
# the offloaded inputs on the GPU stop growing at prefetch + 1 layers). CHECK_TOKENS: the full
# 36-layer model once at that length, against the same extrapolation from LAYERS layers.
LONG_LAYERS=${LONG_LAYERS:-1}
long_plan=""
if [[ -n $LONG_TOKENS ]]; then
  run_lcx offload+tiled "$LONG_LAYERS" "$LONG_TOKENS" 1 loss_chunked offload tiled_mlp
  long_plan="$(plan_peak "$LONG_LAYERS" "$LONG_TOKENS" loss_chunked offload tiled_mlp) $(plan_peak 36 "$LONG_TOKENS" loss_chunked offload tiled_mlp)"
fi
check_plan=""
if [[ -n ${CHECK_TOKENS:-} ]]; then
  run_lcx offload+tiled 36 "$CHECK_TOKENS" 1 loss_chunked offload tiled_mlp
  check_plan="$(plan_peak "$LAYERS" "$CHECK_TOKENS" loss_chunked offload tiled_mlp) $(plan_peak 36 "$CHECK_TOKENS" loss_chunked offload tiled_mlp)"
fi

python3 - "$results" "$LAYERS" "$LONG_TOKENS" "$MASTER" "$LONG_LAYERS" "$long_plan" "${CHECK_TOKENS:-}" "$check_plan" <<'PY' | tee "$out/offload_bench.md"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
layers, long_tokens, master = int(sys.argv[2]), sys.argv[3], sys.argv[4]
def fmt(v, spec):
    return format(v, spec) if isinstance(v, (int, float)) else "-"
base = {(r["system"], r["tokens"]): r for r in rows if r.get("config") == "gpu" and "step_s" in r}
torch_off = {r["tokens"]: r for r in rows if r["system"] == "pytorch" and r.get("config") == "offload" and "peak_gib" in r}
print(f"Qwen3-4B shape, {layers} layers, bf16, chunked loss, one H200; second step; lcx master_dtype {master}.\n")
print("| system | checkpoints | tokens | step s | vs on GPU | peak GiB | compute waited on copies s | peak vs PyTorch offload |")
print("|---|---|---|---|---|---|---|---|")
for r in rows:
    if r.get("layers", layers) != layers or (long_tokens and r["tokens"] == int(long_tokens)):
        continue
    if "error" in r:
        print(f"| {r['system']} | {r['config']} | {r['tokens']} | {r['error']} | | | | |")
        continue
    b = base.get((r["system"], r["tokens"]))
    rel = f"{100 * (r['step_s'] / b['step_s'] - 1):+.1f}%" if b and b is not r else ""
    t = torch_off.get(r["tokens"])
    vs = f"{100 * r['peak_gib'] / t['peak_gib']:.0f}%" if t and r["system"] == "lcx" else ""
    print(f"| {r['system']} | {r['config']} | {r['tokens']} | {fmt(r['step_s'], '.2f')} | {rel} | "
          f"{fmt(r['peak_gib'], '.2f')} | {fmt(r.get('wait_s'), '.3f')} | {vs} |")
GiB = 2**30
long_layers, long_plan, check_tokens, check_plan = int(sys.argv[5]), sys.argv[6].split(), sys.argv[7], sys.argv[8].split()
def extrapolate(measured, plans):
    return measured + (int(plans[1]) - int(plans[0])) / GiB
def find(layers, tokens, config="offload+tiled"):
    return next((r for r in rows if r["system"] == "lcx" and r.get("config") == config and r.get("layers") == layers
                 and r["tokens"] == tokens and "peak_gib" in r), None)
if long_tokens:
    r = find(long_layers, int(long_tokens))
    if r and len(long_plan) == 2:
        full = extrapolate(r["peak_gib"], long_plan)
        print(f"\nLongest sequence (part 5): offload + tiled MLP at {int(long_tokens):,} tokens with {long_layers} layer(s): "
              f"peak {r['peak_gib']:.2f} GiB measured (plan {int(long_plan[0]) / GiB:.2f}), step {r['step_s']:.0f} s; "
              f"extrapolated to 36 layers by the plan's per-layer terms: {full:.1f} GiB "
              f"({'fits' if full < 139 else 'does not fit'} in an H200's 139 GiB usable); pinned host memory for the "
              f"36 checkpoints: {36 * int(long_tokens) * 2560 * 2 / GiB:.1f} GiB.")
    else:
        print(f"\nLongest sequence (part 5): the {long_tokens}-token run did not finish; see offload_bench.jsonl.")
if check_tokens:
    small, full = find(layers, int(check_tokens)), find(36, int(check_tokens))
    if small and full and len(check_plan) == 2:
        pred = extrapolate(small["peak_gib"], check_plan)
        print(f"\nExtrapolation check at {int(check_tokens):,} tokens: {layers} layers measured {small['peak_gib']:.2f} GiB, "
              f"extrapolated to 36 layers {pred:.2f} GiB, the 36-layer run measured {full['peak_gib']:.2f} GiB "
              f"({100 * (pred / full['peak_gib'] - 1):+.1f}%), step {full['step_s']:.1f} s.")
    else:
        print(f"\nExtrapolation check at {check_tokens} tokens: a run did not finish; see offload_bench.jsonl.")
PY
