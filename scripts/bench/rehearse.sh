#!/usr/bin/env bash
# A recipe proved in minutes where its real step takes most of an hour: for each model:tokens of
# CASES, on the GPU machine from the repository root with a build (or bundle) folder,
#  (a) lcx-train --rehearse of the full-depth model at that length with the recipe the plan chooses
#      (one step's exact allocations, GPU and pinned host, with the attention math cut): its
#      measured peaks against the plan's (rehearsal.json);
#  (b) one real step of the same model cut to CUT_LAYERS layers (default 1; 2 for a model whose
#      layers alternate windowed and full attention, so the cut holds one of each) at that length,
#      with the rehearsal's attention choices (keep_attention, head groups; other choices are its
#      own plan's), traced (--profile, step 1): the layer's forward and backward from the trace;
#  (c) the table: rehearsal peaks vs plan, the layer's time and the full step by arithmetic,
#        full step = L / n x (cut's forward + backward)                        [n-layer trace]
#                  + (1-layer step - layer forward - layer backward - its optimizer)
#                                     [embedding, final norm, head + loss, host gaps: once per step]
#                  + the full-depth optimizer                    [measured by the rehearsal, real]
# Both runs take random-init weights (bf16, master_dtype MASTER), random token ids and the plugins
# of PLUGINS; ARGS adds lcx-train flags to both (e.g. --set run.host_memory=125GB); ONE_LAYER=0 skips (b). About 4 minutes
# a case for Qwen3-4B at 1M tokens on one H200 (rehearsal ~1.5 min, the layer's step ~70 s).
#   CASES="qwen3-4b:1048576 qwen3-8b:1048576" OUT=/tmp/rh scripts/bench/rehearse.sh build
# With CONFIG, a shipped manifest is rehearsed as users run it: its module, plugins and tables, the
# checkpoint's path replaced by the case's preset, the data by random ids (PLUGINS, MASTER unused):
#   CONFIG=configs/llama31_8b_lora_1m_80gb.toml CASES="llama-3.1-8b:1048576" scripts/bench/rehearse.sh build
# REHEARSAL=0 skips (a) where its peaks were measured before: (b) then takes SAME (the --set flags
# of the plan's choices, from lcx-train --plan), and the arithmetic LAYERS and CHECKPOINT_EVERY
# from the environment and the full depth's optimizer as L / n times the cut's.
set -uo pipefail
build=${1:-build}
out=${OUT:-/tmp/lcx-rehearse}
cases=${CASES:-"qwen3-4b:1048576"}
plugins=${PLUGINS:-"loss_chunked offload"}
master=${MASTER:-bf16}
limit=${REHEARSE_TIMEOUT:-300}  # seconds per run; a device call has 600 for all of it
mkdir -p "$out"
load=$(printf '"%s",' $plugins)

# The case's module, tokenizer and ordinary-token bound, by the preset's family.
family() {
  case $1 in
    llama-*) module=llama tokenizer=data/llama3_1/tokenizer.json top=128000 ;;
    gpt-oss-*) module=gpt_oss tokenizer=data/gptoss/tokenizer.json top=199998 ;;
    mistral-*) module=mistral tokenizer=data/llama2/tokenizer.json top=32000 ;;
    qwen2*) module=qwen2 tokenizer=data/qwen3/tokenizer.json top=151643 ;;
    *) module=qwen3 tokenizer=data/qwen3/tokenizer.json top=151643 ;;
  esac
}

# manifest <folder> <init JSON> <tokens>
manifest() {
  python3 -c "import numpy as np; np.random.default_rng(0).integers(0, $top, size=$3, dtype=np.uint32).tofile('$1/ids.tokens')"
  if [[ -n ${CONFIG:-} ]]; then
    python3 - "$CONFIG" "$1" "$2" "$3" "$PWD/$tokenizer" <<'PY'
import sys
config, folder, init, tokens, tokenizer = sys.argv[1:]
lines = []
for line in open(config).read().splitlines():
    key = line.split("=")[0].strip() if "=" in line and not line.lstrip().startswith("#") else ""
    lines.append({"path": f"init = '{init}'", "init": f"init = '{init}'", "tokenizer": f'tokenizer = "{tokenizer}"',
                  "source": f'source = "{folder}/ids.tokens"', "output_dir": f'output_dir = "{folder}/out"',
                  "seq_len": f"seq_len = {tokens}", "epochs": "max_steps = 1", "max_steps": "max_steps = 1",
                  "save_steps": "save_final = false"}.get(key, line))
open(f"{folder}/run.toml", "w").write("\n".join(lines) + "\n")
PY
    return
  fi
  cat >"$1/run.toml" <<TOML
[run]
output_dir = "$1/out"
device = "cuda"
seed = 0
[model]
module = "$module"
init = '$2'
dtype = "bf16"
[data]
tokenizer = "$PWD/$tokenizer"
source = "$1/ids.tokens"
seq_len = $3
drop_last = true
shuffle = false
attend_across_documents = true  # random ids are one text; masked plans bound the padded batches instead
[train]
lr = 1e-5
max_steps = 1
save_final = false
master_dtype = "$master"
[plugins]
load = [${load%,}]
TOML
}

for c in $cases; do
  model=${c%%:*}
  tokens=${c##*:}
  family "$model"
  full=$out/$model-$tokens/rehearsal
  one=$out/$model-$tokens/one-layer
  rm -rf "$full" "$one" && mkdir -p "$full" "$one"
  manifest "$full" "{\"preset\": \"$model\"}" "$tokens"
  manifest "$one" "{\"preset\": \"$model\", \"num_hidden_layers\": ${CUT_LAYERS:-1}}" "$tokens"
  same=${SAME:-}
  if [[ ${REHEARSAL:-1} != 0 ]]; then
  start=$(date +%s)
  timeout "$limit" "$build/bin/lcx-train" --config "$full/run.toml" --rehearse ${ARGS:-} >"$full/lcx.log" 2>&1
  echo "$c rehearsal: rc $? in $(($(date +%s) - start)) s"
  # The layer runs the full depth's choices (the model's keys win over its own plan's).
  same=$(python3 - "$full/out/rehearsal.json" <<'PY'
import json, sys
try:
    c = json.load(open(sys.argv[1]))["recipe_choices"]
except (OSError, ValueError, KeyError):
    sys.exit()
# Every choice by <provider>.<knob>, but the spacing and the memory strategy's, which follow the depth.
print(" ".join(f"--set {k}={str(v).lower()}" for k, v in c.items()
               if not k.startswith(("train.", "offload.")) and not (isinstance(v, int) and not isinstance(v, bool) and v <= 0)))
PY
)
  fi
  [[ ${ONE_LAYER:-1} == 0 ]] && continue  # the rehearsal alone (the layer was timed before)
  start=$(date +%s)
  timeout "$limit" "$build/bin/lcx-train" --config "$one/run.toml" --profile --set run.profile_step=1 $same ${ARGS:-} \
    >"$one/lcx.log" 2>&1
  echo "$c one layer: rc $? in $(($(date +%s) - start)) s"
done

python3 - "$out" $cases <<'PY'
import json, os, sys
sys.path.insert(0, "scripts/bench")
from bench_lib import layer_seconds, step_rows
out, cases = sys.argv[1], sys.argv[2:]
G = 2**30
print("| case | recipe (plan's) | GPU peak measured / plan GiB | diff B | pinned host measured / plan GiB | diff B | rehearsal |"
      " 1 layer fwd + bwd s | rest s | optimizer s (full depth) | predicted full step s |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
for c in cases:
    model, tokens = c.split(":")
    base = f"{out}/{model}-{tokens}"
    row = [f"{model}, {int(tokens):,} tokens"]
    try:
        if os.environ.get("REHEARSAL") == "0":  # the layer alone: the depth and choices from the environment
            r = {"layers": int(os.environ["LAYERS"]), "recipe": "(not rehearsed)", "agree": True, "optimizer_s": None,
                 "recipe_choices": {"train.checkpoint_every": int(os.environ.get("CHECKPOINT_EVERY", "1"))},
                 "judged": [{"measured_bytes": 0, "plan_bytes": 0, "difference_bytes": 0}] * 2}
        else:
            r = json.load(open(f"{base}/rehearsal/out/rehearsal.json"))
    except (OSError, ValueError):
        log = open(f"{base}/rehearsal/lcx.log", errors="replace").read().strip().splitlines() if os.path.exists(f"{base}/rehearsal/lcx.log") else []
        print(f"| {row[0]} | rehearsal failed: {log[-1][:160] if log else 'no log'} | | | | | | | | | |")
        continue
    L = r["layers"]
    gpu, host = r["judged"][0], r["judged"][1]
    row += [r["recipe"], f"{gpu['measured_bytes'] / G:.2f} / {gpu['plan_bytes'] / G:.2f}", f"{gpu['difference_bytes']:+,}",
            f"{host['measured_bytes'] / G:.2f} / {host['plan_bytes'] / G:.2f}", f"{host['difference_bytes']:+,}",
            "agrees" if r["agree"] else "DIFFERS"]
    try:
        m = step_rows(f"{base}/one-layer/out/metrics.jsonl")[0]
        span = layer_seconds(f"{base}/one-layer/out/trace-step1.json")
        rest = m["step_s"] - span["forward"] - span["backward"] - m["time_optimizer_s"]
        n = int(os.environ.get("CUT_LAYERS", "1"))  # the cut's layers: one layer's time is their mean
        span = {p: s / n for p, s in span.items()}
        if r["optimizer_s"] is None:
            r["optimizer_s"] = m["time_optimizer_s"] * L / n
        layer = span["forward"] + span["backward"]
        # checkpoint_every = k: the backward runs the forward of each unsaved layer once more.
        k = max(1, r["recipe_choices"].get("train.checkpoint_every", 1))
        rebuilt = L - (L + k - 1) // k
        predicted = L * layer + rebuilt * span["forward"] + rest + r["optimizer_s"]
        again = f" + {rebuilt} x {span['forward']:.2f}" if rebuilt else ""
        row += [f"{span['forward']:.2f} + {span['backward']:.2f} (a layer of {L}, mean of {n})", f"{rest:.2f}", f"{r['optimizer_s']:.2f}",
                f"{L} x {layer:.2f}{again} + {rest:.2f} + {r['optimizer_s']:.2f} = {predicted:.1f}"]
    except (OSError, ValueError, IndexError, KeyError) as e:
        row += [f"1-layer step failed ({type(e).__name__}: {e})", "", "", ""]
    print("| " + " | ".join(row) + " |")
print()
print("A rehearsal cuts the attention math (its loss means nothing); its peaks are the real step's. The 1-layer step is "
      "real and traced (lcx-train --profile, step 1); rest = that step's time outside its layer and its optimizer; "
      "with checkpoint_every = k the layers between checkpoints run their forward once more.")
PY
