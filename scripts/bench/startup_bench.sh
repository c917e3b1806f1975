#!/usr/bin/env bash
# Start-up: a Qwen3 safetensors folder to the end of its first training step, lcx beside
# transformers, in one call of the GPU machine (root, to drop the page cache). Writes a random-init
# folder with transformers (bf16, save_pretrained in shards of SHARD), measures the disk's own read
# rate of those files (cat, one file after another and all at once, page cache dropped), then times
# each process from its launch to the end of its first step of TOKENS tokens: lcx-train (max_steps
# = 1, finite check on, as by default) and scripts/bench/startup_torch.py (from_pretrained to the
# GPU, one step), each cold (page cache dropped) and warm. Logs go to $OUT; a table is printed last.
# With a bundle, source scripts/gpu_env.sh BUNDLE first.
#   OUT=/tmp/startup scripts/bench/startup_bench.sh .bundle
#   MODEL=qwen3-8b TOKENS=8192 SHARD=4GB TOKENIZER=data/qwen3/tokenizer.json WORK=/tmp/lcx-startup
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
build=${1:-build}
model=${MODEL:-qwen3-8b}
tokens=${TOKENS:-8192}
shard=${SHARD:-4GB}
tok=${TOKENIZER:-data/qwen3/tokenizer.json}
work=${WORK:-/tmp/lcx-startup}
out=${OUT:-$work/out}
limit=${LIMIT:-150}
mkdir -p "$work" "$out"
dir=$work/$model
table=$out/startup.md

now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }
cold_ok=1
drop_cache() {
  sync
  echo 3 >/proc/sys/vm/drop_caches 2>/dev/null || { echo "startup_bench: cannot drop the page cache (not root?): 'cold' is warm" >&2; cold_ok=0; }
}

if [[ ! -f $dir/config.json ]]; then
  start=$(now)
  python3 "$here/startup_torch.py" write "$dir" --model "$model" --shard "$shard" >"$out/write.log" 2>&1 ||
    { echo "startup_bench: writing the folder failed:"; tail -5 "$out/write.log"; exit 1; }
  echo "wrote $dir in $(since "$start") s: $(tail -1 "$out/write.log")"
fi
files=("$dir"/*.safetensors)
bytes=$(stat -c %s "${files[@]}" | awk '{ s += $1 } END { print s }')
gb=$(awk -v b="$bytes" 'BEGIN { printf "%.2f", b / 1e9 }')
rate() { awk -v b="$bytes" -v s="$1" 'BEGIN { printf "%.2f", b / 1e9 / s }'; }

# The disk's own rate for these files: one after another, then all at once.
drop_cache
start=$(now)
cat "${files[@]}" >/dev/null
disk_seq=$(since "$start")
drop_cache
start=$(now)
for f in "${files[@]}"; do cat "$f" >/dev/null & done
wait
disk_par=$(since "$start")
echo "disk: ${#files[@]} files, $gb GB: cat one by one $disk_seq s ($(rate "$disk_seq") GB/s), all at once $disk_par s ($(rate "$disk_par") GB/s)"

# Token ids for lcx: two sequences of random ids below <|endoftext|>.
python3 - "$work/ids.tokens" "$tokens" <<'PY'
import sys
import numpy as np
np.random.default_rng(0).integers(0, 151643, size=(2, int(sys.argv[2])), dtype=np.uint32).tofile(sys.argv[1])
PY

lcx_run() {  # $1: cold or warm
  local run=$work/lcx-$1
  rm -rf "$run" && mkdir -p "$run"
  cat >"$run/run.toml" <<TOML
[run]
output_dir = "$run/out"
device = "cuda"
seed = 0
[model]
module = "qwen3"
path = "$dir"
dtype = "bf16"
[data]
tokenizer = "$(realpath "$tok")"
source = "$work/ids.tokens"
seq_len = $tokens
drop_last = true
shuffle = false
[train]
lr = 1e-5
max_steps = 1
save_final = false
master_dtype = "bf16"
[plugins]
load = ["loss_chunked"]
TOML
  [[ $1 == cold ]] && drop_cache
  local start
  start=$(now)
  timeout "$limit" "$build/bin/lcx-train" --config "$run/run.toml" ${LCX_ARGS:-} >"$out/lcx-$1.log" 2>&1
  local rc=$? wall
  wall=$(since "$start")
  [[ $rc == 0 ]] || { { echo "lcx $1 failed (rc $rc):"; tail -5 "$out/lcx-$1.log"; } >&2; wall="failed (rc $rc)"; }
  local load step
  load=$(grep -o 'loaded weights: [0-9.]* GB in [0-9.]* s, [0-9.]* GB/s' "$out/lcx-$1.log" | tail -1 | sed 's/loaded weights: //')
  step=$(python3 -c "import json,sys; print(round(next(r for r in map(json.loads, open(sys.argv[1])) if 'step_s' in r)['step_s'], 2))" "$run/out/metrics.jsonl" 2>/dev/null)
  echo "$wall|${load:--}|${step:--}"
}

torch_run() {  # $1: cold or warm
  [[ $1 == cold ]] && drop_cache
  local start
  start=$(now)
  PYTHONUNBUFFERED=1 timeout "$limit" python3 "$here/startup_torch.py" step "$dir" --tokens "$tokens" >"$out/torch-$1.log" 2>&1
  local rc=$? wall
  wall=$(since "$start")
  [[ $rc == 0 ]] || { { echo "transformers $1 failed (rc $rc):"; tail -5 "$out/torch-$1.log"; } >&2; wall="failed (rc $rc)"; }
  local detail
  detail=$(python3 - "$bytes" "$out/torch-$1.log" 2>/dev/null <<'PY'
import json, sys
r = json.loads([l for l in open(sys.argv[2]) if l.startswith("{")][-1])
gb = int(sys.argv[1]) / 1e9
print(f"from_pretrained {r['load_s']:.1f} s, {gb / r['load_s']:.2f} GB/s (import {r['import_s']:.1f} s)|{r['step_s']:.2f}")
PY
)
  echo "$wall|${detail:--|-}"
}

lcx_cold=$(lcx_run cold)
lcx_warm=$(lcx_run warm)
torch_cold=$(torch_run cold)
torch_warm=$(torch_run warm)

{
  echo "$(date -u +%F), $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $model ($gb GB in ${#files[@]} files, bf16), $tokens tokens, page cache dropped for cold$([[ $cold_ok == 0 ]] && echo " (FAILED: cold is warm)")"
  echo
  echo "| run | to the end of step 1, s | weights | step 1 s |"
  echo "|---|---|---|---|"
  row() { IFS='|' read -r w l s <<<"$2"; echo "| $1 | $w | $l | $s |"; }
  row "lcx cold" "$lcx_cold"
  row "lcx warm" "$lcx_warm"
  row "transformers cold" "$torch_cold"
  row "transformers warm" "$torch_warm"
  echo "| disk: cat one by one | $disk_seq | $(rate "$disk_seq") GB/s | |"
  echo "| disk: cat all at once | $disk_par | $(rate "$disk_par") GB/s | |"
} >"$table"
echo
cat "$table"
