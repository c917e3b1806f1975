#!/usr/bin/env bash
# What cutting sequences on the step's thread costs under cp_ring with packed documents, and what
# the trainer's look-ahead leaves of it (train/trainer.cpp cut_ahead): a small Qwen3 (2 layers,
# hidden 256, Qwen3's vocabulary) trained 4 steps of 131,072 tokens of short documents (log-normal
# lengths around 1,000 tokens, as doc_attention_bench's "short" mix) over CP ranks of cp_ring, as
# virtual ranks on one GPU (or thread-ranks on the CPU: DEVICE=cpu, far slower), twice: with the
# look-ahead switched off (LCX_CUT_AHEAD=0: each step cuts its sequence on the step's thread) and
# on (each step's sequence was cut by the worker during the step before; the first step's on its
# own thread either way). The data is shuffled, so no step meets the sequence the run's setup cut
# for its plan. Prints each step's time_shard_s (the step's thread in shard()) and step_s
# from metrics.jsonl; the small model keeps the step short, so the layout's host time shows
# against it. Needs data/qwen3/tokenizer.json (scripts/fetch_data.sh).
#   CP=8 TOKENS=131072 scripts/bench/shard_ahead.sh build
set -euo pipefail
build=${1:-build}
out=${OUT:-/tmp/lcx-shard-ahead}
cp=${CP:-8}
tokens=${TOKENS:-131072}
device=${DEVICE:-cuda}
mkdir -p "$out"
python3 - "$out/docs.tokens" "$tokens" <<'PY'
import math, random, struct, sys
path, seq = sys.argv[1], int(sys.argv[2])
rng = random.Random(1)
eos = 151643  # Qwen3's <|endoftext|>: closes each document
with open(path, "wb") as f:
    n = 0
    while n < 5 * seq:
        length = max(2, int(rng.lognormvariate(math.log(1000.0), 1.0)))
        body = [rng.randrange(151643) for _ in range(length - 1)] + [eos]
        f.write(struct.pack(f"<{len(body)}I", *body))
        n += len(body)
PY
cat >"$out/run.toml" <<EOF
[run]
output_dir = "$out/run"
seed = 1
device = "$device"
[model]
module = "qwen3"
init = '{"vocab_size": 151936, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "tie_word_embeddings": false}'
dtype = "$([[ $device == cuda ]] && echo bf16 || echo fp32)"
[data]
tokenizer = "$PWD/data/qwen3/tokenizer.json"
source = "$out/docs.tokens"
seq_len = $tokens
pad_to_multiple_of = $((2 * cp))
drop_last = true
shuffle = true
[train]
lr = 1e-4
max_steps = 4
[distributed]
nproc_per_node = $cp
cp = $cp
virtual_ranks = true
[plugins]
load = ["cp_ring", "loss_chunked"]
EOF
for ahead in 0 1; do
  rm -rf "$out/run"
  LCX_CUT_AHEAD=$ahead "$build/bin/lcx-train" --config "$out/run.toml" >"$out/train_$ahead.log" 2>&1 ||
    { tail -20 "$out/train_$ahead.log"; exit 1; }
  cp "$out/run/metrics.jsonl" "$out/metrics_$ahead.jsonl"
done
python3 - "$out/metrics_0.jsonl" "$out/metrics_1.jsonl" <<'PY'
import json, sys
off = [r for r in map(json.loads, open(sys.argv[1])) if "step_s" in r]  # step rows, not [eval]'s
on = [r for r in map(json.loads, open(sys.argv[2])) if "step_s" in r]
print("| step | time_shard_s, cut on the step's thread | time_shard_s, cut ahead | step_s, on the step's thread | step_s, ahead |")
print("|---|---|---|---|---|")
for a, b in zip(off, on):
    print(f"| {a['step']} | {a['time_shard_s']:.4f} | {b['time_shard_s']:.4f} | {a['step_s']:.3f} | {b['step_s']:.3f} |")
PY
