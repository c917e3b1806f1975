#!/usr/bin/env bash
# Where a context-parallel step's time goes, on one GPU: the Qwen3-8B shape (LAYERS layers) at
# TOKENS, one rank beside cp_ring / sp_ulysses over 2 virtual ranks (threads sharing the GPU),
# with and without ZeRO-3 sharding (on by default, so sp2 is sharded). Each run is killed at LIMIT_S; its last metrics line (time
# split) or its last log lines are printed. Virtual ranks serialize on the one GPU, so a cp = 2
# step should take about one rank's step plus the ring's copies.
#   LAYERS=2 TOKENS=32768 scripts/bench/cp_virtual.sh build
set -uo pipefail
build=${1:-build}
out=${OUT:-/tmp/lcx-cp-virtual}
layers=${LAYERS:-2} tokens=${TOKENS:-32768} limit=${LIMIT_S:-90}
init=${INIT:-"{\"preset\": \"qwen3-8b\", \"num_hidden_layers\": $layers}"}
mkdir -p "$out"
run() {  # NAME PLUGINS TABLES
  local dir="$out/$1"
  rm -rf "$dir" && mkdir -p "$dir"
  printf '[run]\noutput_dir = "%s"\ndevice = "%s"\n[model]\nmodule = "qwen3"\ninit = %s\ndtype = "bf16"\n[data]\ntokenizer = "'"$PWD"'/data/qwen3/tokenizer.json"\nsource = "'"$PWD"'/data/kjv/kjv.txt"\nseq_len = %s\ndrop_last = true\nshuffle = false\nattend_across_documents = true\n[train]\nmax_steps = 3\nmaster_dtype = "bf16"\nsave_final = false\n[plugins]\nload = [%s]\n%b' \
    "$dir/out" "${DEVICE:-cuda}" "'$init'" "$tokens" "$2" "$3" >"$dir/run.toml"
  local start=$(date +%s)
  timeout -s KILL "$limit" "$build/bin/lcx-train" --config "$dir/run.toml" >"$dir/log" 2>&1
  local rc=$?
  echo "== $1: rc $rc, $(($(date +%s) - start)) s"
  if [[ -s $dir/out/metrics.jsonl ]]; then
    python3 - "$dir/out/metrics.jsonl" <<'PY'
import json, sys
for l in open(sys.argv[1]):
    m = json.loads(l)
    if "step_s" not in m:
        continue  # an [eval] row
    print("  step %d: %.2f s (forward %.2f, backward %.2f, communication %.3f, optimizer %.2f), peak %.1f GiB" % (
        m["step"], m["step_s"], m["time_forward_s"], m["time_backward_s"], m["time_communication_s"],
        m["time_optimizer_s"], m.get("peak_gpu_bytes", 0) / 2**30))
PY
  else
    tail -c 2000 "$dir/log" | tr '\r' '\n' | grep -v '^$' | tail -4 | sed 's/^/  /'
  fi
}
ring=$'[distributed]\nnproc_per_node = 2\ncp = 2\nvirtual_ranks = true\n'
uly=$'[distributed]\nnproc_per_node = 2\nsp = 2\nvirtual_ranks = true\n'
for what in ${CASES:-one cp2 cp2-zero3 sp2}; do
  case $what in
    one) run one '"loss_chunked"' "" ;;
    cp2) run cp2 '"loss_chunked","cp_ring"' "${ring}shard_parameters = false\n" ;;
    cp2-zero3) run cp2-zero3 '"loss_chunked","cp_ring"' "${ring}shard_parameters = true\n" ;;
    sp2) run sp2 '"loss_chunked","sp_ulysses"' "$uly" ;;
  esac
done
