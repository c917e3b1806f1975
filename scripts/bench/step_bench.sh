#!/usr/bin/env bash
# One training step of lcx beside transformers + PyTorch on the same GPU in the same run.
# Runs on the GPU machine from the repository root, with a build (or bundle) folder holding
# bin/lcx-train and data/qwen3/tokenizer.json present. For each model shape and length: lcx-train
# on random token ids (random-init weights, bf16, checkpointed layers, the plugins named in
# PLUGINS), then scripts/bench/torch_step.py (bf16, gradient checkpointing, SDPA, fused AdamW,
# chunked loss). Step time is the median of the steps after the first (STEPS=1: the one step, its
# warm-up included; run the peer alone then, it needs two). Prints a markdown table.
#   CASES="qwen3-0.6b:8192 qwen3-4b:65536" PLUGINS="loss_chunked" scripts/bench/step_bench.sh .bundle
# TABLES adds TOML tables to the manifest (e.g. a [distributed] mesh); LCX_ARGS adds lcx-train
# flags (e.g. --profile, --set qwen3.keep_attention=false); TORCH=0 skips the peer; TORCH_ARGS adds
# torch_step.py flags (--offload: its checkpointed activations in pinned host memory).
# DOCS=short (a length mix of doc_attention_bench: short, pg19, uniform4k) packs documents of that
# mix into every sequence, each closed by <|endoftext|>: lcx masks them ([data]
# attend_across_documents = false) and the peer gets their bounds (torch_step.py --documents:
# positions restarting per document, transformers' packed-sequence mask, flex attention); ACROSS=1
# keeps the same tokens but attends across documents on both sides (full causal), for the ablation.
set -uo pipefail
build=${1:-build}
out=${OUT:-/tmp/lcx-bench}
cases=${CASES:-"qwen3-0.6b:8192 qwen3-0.6b:32768 qwen3-4b:32768 qwen3-4b:65536"}
plugins=${PLUGINS:-loss_chunked}
steps=${STEPS:-3}
master=${MASTER:-fp32}  # bf16: no fp32 master copy, bf16 moments (the peer's optimizer state)
limit=${LCX_STEP_TIMEOUT:-240}
mkdir -p "$out"
table="$out/step_bench.md"
echo "| model | tokens | lcx step s | lcx tokens/s | lcx MFU | lcx peak GiB | PyTorch step s | PyTorch tokens/s | PyTorch peak GiB | lcx / PyTorch time |" >"$table"
echo "|---|---|---|---|---|---|---|---|---|---|" >>"$table"
load=$(printf '"%s",' $plugins)
for c in $cases; do
  model=${c%%:*}
  tokens=${c##*:}
  layers=${LAYERS:-}
  run=$out/$model-$tokens
  rm -rf "$run" && mkdir -p "$run"
  docs=${DOCS:+$run/bounds.jsonl}
  across=true
  peer_docs=()  # the peer masks the documents too, or neither does
  if [[ -n $docs ]]; then
    "$build/tests/doc_attention_bench" --device cpu --tokens "$tokens" --mixes "$DOCS" --bounds >"$docs" || exit 1
    [[ ${ACROSS:-0} == 0 ]] && { across=false; peer_docs=(--documents "$docs"); }
  fi
  # The model module, its tokenizer and its end-of-text id, by the preset's family.
  case $model in
    llama-*) module=llama tokenizer=data/llama3_1/tokenizer.json top=128000 eos=128001 ;;
    mistral-*) module=mistral tokenizer=data/llama2/tokenizer.json top=32000 eos=2 ;;
    qwen2*) module=qwen2 tokenizer=data/qwen3/tokenizer.json top=151643 eos=151643 ;;
    *) module=qwen3 tokenizer=data/qwen3/tokenizer.json top=151643 eos=151643 ;;
  esac
  # Random ids of ordinary tokens (below `top`); with DOCS, each document's last token is `eos`.
  python3 - "$run/ids.tokens" "$tokens" "$((steps + 1))" "$docs" "$top" "$eos" <<'PY'
import json, sys
import numpy as np
path, tokens, seqs, docs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
top, eos = int(sys.argv[5]), int(sys.argv[6])
ids = np.random.default_rng(0).integers(0, top, size=(seqs, tokens), dtype=np.uint32)
if docs:
    ends = np.array(json.loads(open(docs).readline())["bounds"][1:]) - 1
    ids[:, ends] = eos
ids.tofile(path)
PY
  init="{\"preset\": \"$model\"${layers:+, \"num_hidden_layers\": $layers}}"
  cat >"$run/run.toml" <<TOML
[run]
output_dir = "$run/out"
device = "cuda"
seed = 0
[model]
module = "$module"
init = '$init'
dtype = "bf16"
[data]
tokenizer = "$PWD/$tokenizer"
source = "$run/ids.tokens"
seq_len = $tokens
drop_last = true
shuffle = false
attend_across_documents = $across
[train]
lr = 1e-5
max_steps = $steps
save_final = false
master_dtype = "$master"
[plugins]
load = [${load%,}]
TOML
  printf '%b' "${TABLES:-}" >>"$run/run.toml"
  timeout "$limit" "$build/bin/lcx-train" --config "$run/run.toml" ${LCX_ARGS:-} >"$run/lcx.log" 2>&1
  rc=$?
  lcx=$(python3 - "$run/out/metrics.jsonl" "$rc" <<'PY'
import json, statistics, sys
try:
    rows = [r for r in map(json.loads, open(sys.argv[1])) if "step_s" in r]  # step rows, not [eval]'s
except OSError:
    rows = []
if not rows:
    print(f"failed (rc {sys.argv[2]})|-|-|-")
else:
    timed = rows[1:] or rows  # STEPS=1: the only step, warm-up included
    t = statistics.median(r["step_s"] for r in timed)
    peak = max(r.get("peak_gpu_bytes", 0) for r in rows) / 2**30
    mfu = statistics.median(r.get("mfu", 0) for r in timed)
    tokens = rows[0]["num_tokens"]  # one step's tokens
    print(f"{t:.3f}|{tokens / t:,.0f}|{mfu*100:.1f}%|{peak:.1f}|{t}")
PY
)
  torch='{"error": "not run"}'
  [[ ${TORCH:-1} != 0 ]] && torch=$(PYTHONUNBUFFERED=1 timeout "$limit" python3 scripts/bench/torch_step.py --model "$model" --tokens "$tokens" \
          --steps $((steps - 1)) ${layers:+--layers $layers} "${peer_docs[@]}" ${TORCH_ARGS:-} 2>"$run/torch.err" | tee "$run/torch.all" | tail -1)
  echo "$torch" >"$run/torch.json"
  label=$model
  if [[ -n $docs ]]; then
    n=$(python3 -c "import json, sys; print(len(json.loads(open(sys.argv[1]).readline())['bounds']) - 1)" "$docs")
    label+=", $n $DOCS documents $([[ $across == false ]] && echo masked || echo "attended across")"
  fi
  row=$(python3 - "$lcx" "$torch" "$label" "$tokens" <<'PY'
import json, sys
l = sys.argv[1].split("|")
try:
    t = json.loads(sys.argv[2])
except ValueError:
    t = {"error": "no result"}
if "step_s" in t:
    ts, ttps, tpk = f"{t['step_s']:.3f}", f"{t['tokens_per_s']:,.0f}", f"{t['peak_gib']:.1f}"
else:
    ts, ttps, tpk = t.get("error", "failed"), "-", "-"
ratio = f"{float(l[4]) / t['step_s']:.2f}" if len(l) > 4 and "step_s" in t else "-"
print(f"| {sys.argv[3]} | {int(sys.argv[4]):,} | {l[0]} | {l[1]} | {l[2]} | {l[3]} | {ts} | {ttps} | {tpk} | {ratio} |")
PY
)
  echo "$row" | tee -a "$table"
  if ! grep -q step_s "$run/torch.json"; then echo "PyTorch failed:"; tail -5 "$run/torch.err"; fi
  if [[ ! -s $run/out/metrics.jsonl ]]; then echo "lcx failed:"; tail -5 "$run/lcx.log"; fi
done
echo
cat "$table"
