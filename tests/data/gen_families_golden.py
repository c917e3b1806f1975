#!/usr/bin/env python3
"""Reference ids for the tokenizers of the families lcx reads (Llama 3.1, Gemma 3, GPT-OSS, Llama 2,
Qwen3) and for their chat templates, for tests/data/tokenizer_families_test.cpp.

Runs where `tokenizers` and `transformers` are installed (the GPU machine, CPU only, no network):
    python3 tests/data/gen_families_golden.py --tokenizers DIR --out tests/data/fixtures/families
DIR holds one folder per family (llama3_1, gemma3, gptoss, llama2, qwen3) with tokenizer.json (or
tokenizer.json.gz) and tokenizer_config.json, as scripts/fetch_data.sh puts them in data/. Writes
  <family>_golden.json  {"tokenizers_version", "tokenizer_sha256", "cases": [{"text",
                         "add_special_tokens", "ids", "decoded"}], "transformers": [{"text", "ids"}]}
                        ids from Tokenizer.from_file(...).encode(text, add_special_tokens=...),
                        decoded from its decode(ids, skip_special_tokens=False); "transformers" holds
                        AutoTokenizer(folder)(text)["input_ids"] (the BOS transformers adds).
  chat_golden.jsonl     per conversation of chat_conversations.jsonl: the text and ids of
                        AutoTokenizer(folder).apply_chat_template(..., tokenize=True) with the
                        template of fixtures/chat/templates/<template>.jinja, or the error it raised.
Nothing here knows what lcx produces.
"""
import argparse
import gzip
import hashlib
import json
import os
import shutil
import sys
import tempfile

import tokenizers
from tokenizers import Tokenizer

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from gen_golden import CASES  # noqa: E402  the Qwen3 fixture's strings: every class boundary of the regexes

FAMILIES = ["llama3_1", "gemma3", "gptoss", "llama2", "qwen3"]
EXTRA = [
    "<s>", " <s> x", "Hello <s> world</s>", "<bos>hi", "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>", "<|startoftext|>x<|return|>",
    "▁already▁metaspace", "a  b   c    d", " x", "x ", "\u2581", "<0x41>", "<unk>", "1234567 3.14159 12345678901",
    "don't DON'T Don't", "\t\tindented\n    four\n", "ﬁ", "\ufffd", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
]


def materialize(src, dst):
    os.makedirs(dst, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if os.path.exists(os.path.join(src, name)):
            shutil.copy(os.path.join(src, name), os.path.join(dst, name))
        elif os.path.exists(os.path.join(src, name + ".gz")):
            with gzip.open(os.path.join(src, name + ".gz"), "rb") as f, open(os.path.join(dst, name), "wb") as g:
                shutil.copyfileobj(f, g)
    return dst


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizers", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    fixtures = os.path.join(HERE, "fixtures")
    with open(os.path.join(fixtures, "families", "multilingual.txt"), encoding="utf-8") as f:
        multilingual = f.read()
    texts = [multilingual] + EXTRA + CASES
    tmp = tempfile.mkdtemp()
    folders = {}
    import transformers
    from transformers import AutoTokenizer
    for fam in FAMILIES:
        folder = materialize(os.path.join(args.tokenizers, fam), os.path.join(tmp, fam))
        folders[fam] = folder
        path = os.path.join(folder, "tokenizer.json")
        tok = Tokenizer.from_file(path)
        cases = []
        for t in texts:
            for special in (False, True):
                ids = tok.encode(t, add_special_tokens=special).ids
                cases.append({"text": t, "add_special_tokens": special, "ids": ids,
                              "decoded": tok.decode(ids, skip_special_tokens=False)})
        hf = []
        try:
            auto = AutoTokenizer.from_pretrained(folder)
            for t in [multilingual, "Hello world", " leading", "<s>x"]:
                hf.append({"text": t, "ids": list(auto(t)["input_ids"])})
        except Exception as e:
            hf.append({"error": f"{type(e).__name__}: {e}"})
        with open(path, "rb") as f:
            sha = hashlib.sha256(f.read()).hexdigest()
        out = {"tokenizers_version": tokenizers.__version__, "transformers_version": transformers.__version__,
               "tokenizer_sha256": sha, "cases": cases, "transformers": hf}
        with open(os.path.join(args.out, f"{fam}_golden.json"), "w", encoding="utf-8") as f:
            json.dump(out, f, ensure_ascii=False, separators=(",", ":"))
        print(fam, len(cases), "cases", file=sys.stderr)

    rows = []
    autos = {}
    for line in open(os.path.join(fixtures, "families", "chat_conversations.jsonl"), encoding="utf-8"):
        c = json.loads(line)
        with open(os.path.join(fixtures, "chat", "templates", c["template"] + ".jinja"), encoding="utf-8") as f:
            template = f.read()
        if c["tokenizer"] not in autos:
            autos[c["tokenizer"]] = AutoTokenizer.from_pretrained(folders[c["tokenizer"]])
        tok = autos[c["tokenizer"]]
        row = {"name": c["name"], "engine": f"transformers {transformers.__version__}",
               "special_tokens": {k: v for k, v in tok.special_tokens_map.items() if isinstance(v, str)}}
        common = dict(tools=c.get("tools"), chat_template=template, add_generation_prompt=c["add_generation_prompt"],
                      **c.get("kwargs", {}))
        try:
            row["text"] = tok.apply_chat_template(c["messages"], tokenize=False, **common)
            out = tok.apply_chat_template(c["messages"], tokenize=True, return_dict=True, **common)
            ids = out["input_ids"]
            row["ids"] = list(ids[0] if ids and isinstance(ids[0], list) else ids)
        except Exception as e:
            row.pop("text", None)
            row["error"] = f"{type(e).__name__}: {e}"
        rows.append(row)
    with open(os.path.join(args.out, "chat_golden.jsonl"), "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    print(len(rows), "conversations", file=sys.stderr)


if __name__ == "__main__":
    main()
