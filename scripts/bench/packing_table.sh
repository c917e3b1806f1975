#!/usr/bin/env bash
# How each packing mode fills sequences, read from the data line a run logs at its start (CPU only):
# the chat quickstart's 64 conversations at its seq_len, then generated agent transcripts
# (scripts/gen_agent_transcripts.py, 80 conversations) at 3,072 tokens under each mode and overlong
# policy. Prints a markdown table: sequences, how full they are, conversations cut, truncated, dropped.
#   scripts/bench/packing_table.sh [build folder, default build]
set -uo pipefail
build=${1:-build}
w=$(mktemp -d)
trap 'rm -rf "$w"' EXIT
python3 scripts/gen_agent_transcripts.py --out "$w/agent.jsonl" --conversations 80 --tokens 2700 --seed 0 >/dev/null
echo "| data | seq_len | packing | overlong | sequences | tokens fill | conversations cut, truncated or dropped |"
echo "|---|---|---|---|---|---|---|"
row() {  # data label, seq_len, packing, overlong, --set arguments...
  local label=$1 len=$2 packing=$3 overlong=$4
  shift 4
  local line
  line=$(timeout 300 "$build/bin/lcx-train" --config configs/quickstart_chat.toml --overwrite \
    --set run.output_dir="$w/run" --set train.max_steps=1 --set data.seq_len="$len" \
    --set data.packing="$packing" --set data.overlong="$overlong" "$@" 2>&1 | grep -m1 '\] data: ' | sed 's/.*\] data: //')
  local seqs tokens gone fill cut
  seqs=$(grep -o -- '-> [0-9]* sequences' <<<"$line" | grep -o '[0-9]*')
  tokens=$(grep -o -- '[0-9]* tokens ->' <<<"$line" | grep -o '[0-9]*')
  # Tokens a policy removed: "(N tokens cut" (truncate) or "dropped (N tokens" (drop).
  gone=$(grep -oE '\(([0-9]+) tokens cut|dropped \(([0-9]+) tokens' <<<"$line" | grep -oE '[0-9]+' | head -1)
  fill=$(grep -oE 'tokens fill [0-9.]+%' <<<"$line" | grep -oE '[0-9.]+%')
  [[ -z $fill && -n $seqs && -n $tokens ]] &&
    fill=$(python3 -c "print(f'{100 * ($tokens - ${gone:-0}) / ($seqs * $len):.1f}%')")
  cut=$(grep -oE '[0-9]+ conversations? (continues? into the next sequence|longer than data.seq_len (truncated|dropped))' <<<"$line" |
    sed -E 's/ conversations? continues? into the next sequence/ cut/; s/ conversations? longer than data.seq_len / /' | paste -sd, - | sed 's/,/, /g')
  echo "| $label | $len | $packing | $overlong | ${seqs:-failed: ${line:-no data line}} | ${fill:--} | ${cut:-0} |"
}
for p in stream bfd; do row "chat quickstart (64 conversations)" 1024 "$p" continue; done
for p in stream bfd; do
  for o in continue truncate drop; do
    row "agent transcripts (80 conversations)" 3072 "$p" "$o" --set data.source="$w/agent.jsonl" --set data.cache_dir="$w/cache"
  done
done
