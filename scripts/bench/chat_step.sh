#!/usr/bin/env bash
# An agent transcript trained at a long length on one GPU, beside the same tokens as plain text:
# on the GPU machine from the repository root with a build (or bundle) folder and data/qwen3
# (tokenizer.json, tokenizer_config.json).
#  (a) scripts/gen_agent_transcripts.py writes one conversation of about TOKENS tokens (tool calls,
#      tool results with long file contents, reasoning); lcx-train tokenize --chat --mask gives its
#      ids and mask, and the same ids become a pre-tokenized .tokens file (the plain-text twin);
#  (b) one real step of MODEL cut to LAYERS layers on each, traced (--profile, step 1): the chat run
#      trains only the assistant's tokens, the plain one every token; their step times side by side;
# The masks do not change what the step holds: a full-depth rehearsal of that length is
# scripts/bench/rehearse.sh's.
#   PLUGINS="loss_chunked offload tiled_mlp" TOKENS=1048576 MODEL=qwen3-4b LAYERS=1 OUT=/tmp/chat scripts/bench/chat_step.sh .bundle
set -uo pipefail
build=${1:-build}
out=${OUT:-/tmp/lcx-chat-step}
tokens=${TOKENS:-1048576}
model=${MODEL:-qwen3-4b}
layers=${LAYERS:-1}
plugins=${PLUGINS:-"loss_chunked offload"}
limit=${CHAT_TIMEOUT:-300}
mkdir -p "$out"
load=$(printf '"%s",' $plugins)
tok=$PWD/data/qwen3/tokenizer.json

# About 3.6 characters a token in generated transcripts; generate a little more than needed and
# let the sequence cut it (drop_last: one whole sequence of `tokens`).
python3 scripts/gen_agent_transcripts.py --out "$out/transcript.jsonl" --conversations 1 \
  --tokens $((tokens + tokens / 8)) --seed 0 || exit 1
"$build/bin/lcx-train" tokenize --chat "$out/transcript.jsonl" --tokenizer "$tok" --mask >"$out/ids_mask.txt" || exit 1
python3 - "$out" "$tokens" <<'PY'
import sys
import numpy as np
out, tokens = sys.argv[1], int(sys.argv[2])
ids_line, mask_line = open(f"{out}/ids_mask.txt").read().split("\n")[:2]
ids = np.array(ids_line.split(), dtype=np.uint32)
mask = np.array(mask_line.split(), dtype=np.uint8)
assert len(ids) == len(mask) and len(ids) >= tokens, (len(ids), len(mask), tokens)
ids.tofile(f"{out}/plain.tokens")
print(f"transcript: {len(ids):,} tokens, {int(mask.sum()):,} trained ({mask.mean():.1%}); first sequence "
      f"{int(mask[1:tokens].sum()):,} trained targets")
PY

# manifest <folder> <source> <layers or empty for full depth>
manifest() {
  local init="{\"preset\": \"$model\"}"
  [[ -n $3 ]] && init="{\"preset\": \"$model\", \"num_hidden_layers\": $3}"
  cat >"$1/run.toml" <<TOML
[run]
output_dir = "$1/out"
device = "cuda"
seed = 0
[model]
module = "qwen3"
init = '$init'
dtype = "bf16"
[data]
tokenizer = "$tok"
source = "$2"
seq_len = $tokens
drop_last = true
shuffle = false
[train]
lr = 1e-5
max_steps = 1
save_final = false
master_dtype = "bf16"
[plugins]
load = [${load%,}]
TOML
}

for kind in chat plain; do
  src=$out/transcript.jsonl
  [[ $kind == plain ]] && src=$out/plain.tokens
  run=$out/$kind
  rm -rf "$run" && mkdir -p "$run"
  manifest "$run" "$src" "$layers"
  start=$(date +%s)
  timeout "$limit" "$build/bin/lcx-train" --config "$run/run.toml" --profile --set run.profile_step=1 >"$run/lcx.log" 2>&1
  echo "$kind: rc $? in $(($(date +%s) - start)) s"
done

python3 - "$out" "$model" "$layers" "$tokens" <<'PY'
import json, os, sys
sys.path.insert(0, "scripts/bench")
from bench_lib import layer_seconds, step_rows
out, model, layers, tokens = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
print(f"| data | {model}, {layers} layer(s), {tokens:,} tokens | step s | layer fwd + bwd s | trained targets | loss |")
print("|---|---|---|---|---|---|")
steps = {}
for kind in ("chat", "plain"):
    try:
        m = step_rows(f"{out}/{kind}/out/metrics.jsonl")[0]
        span = layer_seconds(f"{out}/{kind}/out/trace-step1.json")
        steps[kind] = m["step_s"]
        print(f"| {kind} | | {m['step_s']:.2f} | {span['forward']:.2f} + {span['backward']:.2f} | "
              f"{m.get('valid_targets', '')} | {m['loss']:.4f} |")
    except (OSError, ValueError, IndexError, KeyError) as e:
        log = open(f"{out}/{kind}/lcx.log", errors="replace").read().strip().splitlines() if os.path.exists(f"{out}/{kind}/lcx.log") else []
        print(f"| {kind} | failed ({type(e).__name__}: {e}); {log[-1][:160] if log else 'no log'} | | | | |")
if len(steps) == 2:
    print(f"\nchat / plain step time: {steps['chat'] / steps['plain']:.4f}")
PY
