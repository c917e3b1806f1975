#!/usr/bin/env bash
# LoRA's GPU checks and benchmarks in one device call, from the repository root with the bundle
# carried as .bundle (and data/qwen3): PyTorch's LoRA fixture generated and held to the CPU twin,
# the lora suite on the GPU (bf16 against fp32), `lcx-train merge` loaded by transformers, then
# Qwen3-8B at full depth (36 layers), r = 16 on every linear projection: lcx's LoRA step beside
# lcx's full fine-tuning and beside transformers + PyTorch with the same hand-written LoRA
# (scripts/bench/torch_step.py --lora), with the plan's peaks beside the measured ones.
#   OUT=/tmp/lora CASES="qwen3-8b:8192 qwen3-8b:65536" scripts/bench/lora_gpu.sh
# MERGE=0 leaves out check_peft_merge.py. REHEARSE="qwen3-8b:966784" adds the rehearsal of that length within GPU_MEMORY (80GB) and a
# one-layer step at it (LAYER=1).
set -uo pipefail
root=$PWD
result=${OUT:-/tmp/lcx-lora}
out=$result  # written in place: a call cut off at its limit still brings back what finished
mkdir -p "$out"
source scripts/gpu_bundle.sh
summary=$out/summary.md
: >"$summary"

if [[ ${TESTS:-1} != 0 ]]; then
  python3 tests/plugins/gen_lora_fixture.py --out tests/plugins/fixtures/lora >"$out/fixture.log" 2>&1
  echo "fixture: $(tail -1 "$out/fixture.log")" >>"$summary"
  cp -r tests/plugins/fixtures/lora "$out/lora_fixture"
  build/tests/test_lora >"$out/test_lora.log" 2>&1
  echo "test_lora: rc $? $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$out/test_lora.log" | tr '\n' ' ')" >>"$summary"
  grep -E "lora (vs|GPU)" "$out/test_lora.log" >>"$summary"
  if [[ ${MERGE:-1} != 0 ]]; then
    timeout 300 python3 tests/io/check_peft_merge.py --lcx-train build/bin/lcx-train --work "$out/merge" >"$out/merge.log" 2>&1
    echo "check_peft_merge: rc $? $(tail -1 "$out/merge.log")" >>"$summary"
  fi
fi

if [[ -n ${CASES:-} ]]; then
  CASES=$CASES VARIANTS="lora:lora+loss_chunked+offload:--set,lora.r=16,--set,lora.alpha=32 full:loss_chunked+offload" \
    TORCH_ARGS="--lora 16" PROFILE=${PROFILE:-0} OUT=$out/steps LCX_STEP_TIMEOUT=${LCX_STEP_TIMEOUT:-300} \
    scripts/bench/full_depth.sh build >"$out/steps.out" 2>&1
  grep -E "^\|" "$out/steps.out" >>"$summary"
  # LoRA again within the peer's own peak as its GPU budget (the plan picking the recipe that fits):
  # "below both at matching budgets".
  for c in $CASES; do
    peak=$(python3 -c "import json,sys; print(round(json.load(open(sys.argv[1]))['peak_gib'], 2))" "$out/steps/lora/${c/:/-}/torch.json" 2>/dev/null) || continue
    CASES=$c VARIANTS="lora_at_peer_peak:lora+loss_chunked+offload+tiled_mlp:--set,lora.r=16,--set,lora.alpha=32,--set,run.gpu_memory=${peak}GiB" \
      TORCH=0 PROFILE=0 OUT=$out/budget-$c LCX_STEP_TIMEOUT=${LCX_STEP_TIMEOUT:-300} \
      scripts/bench/full_depth.sh build >"$out/budget-$c.out" 2>&1
    echo "budget $c = ${peak}GiB (PyTorch's peak):" >>"$summary"
    grep -E "^\| ${c/:/-}" "$out/budget-$c.out" >>"$summary"
  done
fi

if [[ -n ${REHEARSE:-} ]]; then
  for c in $REHEARSE; do
    model=${c%%:*}
    tokens=${c##*:}
    d=$out/rehearse-$tokens
    mkdir -p "$d"
    sed "s|init = \"qwen3-8b\"|init = '{\"preset\": \"$model\"}'|; s|seq_len = 1048576|seq_len = $tokens|" configs/qwen3_8b_lora_1m_80gb.toml |
      sed "s|path = \"../models/Qwen3-8B\"|init = '{\"preset\": \"$model\"}'|; s|tokenizer = \".*\"|tokenizer = \"$root/data/qwen3/tokenizer.json\"|; s|source = \".*\"|source = \"$d/ids.tokens\"|; s|output_dir = \".*\"|output_dir = \"$d/out\"|; s|gpu_memory = \".*\"|gpu_memory = \"${GPU_MEMORY:-80GB}\"|" >"$d/run.toml"
    python3 -c "import numpy as np,sys; np.random.default_rng(0).integers(0,151643,size=(2,$tokens),dtype=np.uint32).tofile(sys.argv[1])" "$d/ids.tokens"
    timeout 420 build/bin/lcx-train --config "$d/run.toml" --rehearse >"$d/rehearse.log" 2>&1
    echo "rehearse $c: rc $? $(grep -E 'rehears|peak' "$d/rehearse.log" | tail -4 | tr '\n' ' ')" >>"$summary"
    if [[ ${LAYER:-1} != 0 ]]; then
      sed "s|{\"preset\": \"$model\"}|{\"preset\": \"$model\", \"num_hidden_layers\": 1}|; s|epochs = 3|max_steps = 2|" "$d/run.toml" >"$d/layer.toml"
      timeout 300 build/bin/lcx-train --config "$d/layer.toml" --set run.output_dir="$d/layer" >"$d/layer.log" 2>&1
      echo "one layer of $c: rc $? $(python3 -c "import json,sys; r=[json.loads(l) for l in open(sys.argv[1]) if 'step_s' in l]; print([round(x['step_s'],2) for x in r], [round(x.get('peak_gpu_bytes',0)/2**30,2) for x in r])" "$d/layer/metrics.jsonl" 2>&1)" >>"$summary"
    fi
  done
fi

cat "$summary"
