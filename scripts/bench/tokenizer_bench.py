#!/usr/bin/env python3
"""Tokenizer throughput: lcx against Hugging Face `tokenizers` on one text, same machine, same run.

    python3 scripts/bench/tokenizer_bench.py --lcx BIN --tokenizer data/qwen3/tokenizer.json \
        --text data/kjv/kjv.txt [--json OUT]
BIN is the static lcx_tokenizer_bench that scripts/bench/tokenizer_bench.sh builds. lcx encodes
the whole text (it cuts it where the cut cannot change a token and encodes the parts on every
core); `tokenizers` gets the same text as a batch of chunks cut at line starts (encode_batch runs
them on every core) and its ids are checked equal to encoding the text whole. Each side: one
warm-up pass, then the best of three. Per-core figures come from runs limited to one thread
(RAYON_NUM_THREADS=1 for tokenizers).
"""
import argparse
import json
import os
import re
import subprocess
import sys
import time


def tokenizers_run(tokenizer, text, threads):
    code = r"""
import json, re, sys, time
from tokenizers import Tokenizer
tok = Tokenizer.from_file(sys.argv[1])
text = open(sys.argv[2], encoding="utf-8").read()
# Chunks of about 16 KB cut before a line that starts with a letter: such a cut changes no token.
cuts = [m.start() for m in re.finditer(r"(?<=\n)(?=[A-Za-z])", text)]
chunks, at = [], 0
for c in cuts:
    if c - at >= 16384:
        chunks.append(text[at:c]); at = c
chunks.append(text[at:])
whole = tok.encode(text).ids
batch = tok.encode_batch(chunks)
assert [i for e in batch for i in e.ids] == whole, "chunked ids differ from whole-text ids"
best = 1e30
for r in range(3):
    t = time.perf_counter(); tok.encode_batch(chunks); best = min(best, time.perf_counter() - t)
t = time.perf_counter(); tok.encode(text); single = time.perf_counter() - t
print(json.dumps({"tokens": len(whole), "chunks": len(chunks), "best_s": best, "encode_whole_s": single}))
"""
    env = dict(os.environ)
    if threads:
        env["RAYON_NUM_THREADS"] = str(threads)
    out = subprocess.run([sys.executable, "-c", code, tokenizer, text], env=env, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def lcx_run(binary, tokenizer, text, threads):
    out = subprocess.run([binary, tokenizer, text, "--threads", str(threads), "--repeat", "3"], check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lcx", required=True)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--text", required=True)
    ap.add_argument("--json")
    a = ap.parse_args()
    import tokenizers
    cores = len(os.sched_getaffinity(0))
    mb = os.path.getsize(a.text) / 1e6
    rows = []
    for threads in (cores, 1):
        t = tokenizers_run(a.tokenizer, a.text, threads)
        rows.append({"impl": "tokenizers %s encode_batch" % tokenizers.__version__, "threads": threads,
                     "tokens": t["tokens"], "seconds": t["best_s"], "mb_s": mb / t["best_s"],
                     "mb_s_per_core": mb / t["best_s"] / threads, "encode_whole_s": t["encode_whole_s"]})
    for threads in sorted({cores, 1, 2, 4, 8} - {c for c in (2, 4, 8) if c >= cores}, reverse=True):
        l = lcx_run(a.lcx, a.tokenizer, a.text, threads)
        rows.append({"impl": "lcx Tokenizer::encode", "threads": threads, "tokens": l["tokens"],
                     "seconds": l["best_s"], "mb_s": mb / l["best_s"], "mb_s_per_core": mb / l["best_s"] / threads})
    print("| implementation | threads | tokens | seconds | MB/s | MB/s per core |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print("| %s | %d | %d | %.4f | %.1f | %.1f |" % (r["impl"], r["threads"], r["tokens"], r["seconds"], r["mb_s"],
                                                     r["mb_s_per_core"]))
    for threads in (cores, 1):
        lib = next(r for r in rows if r["threads"] == threads and r["impl"].startswith("tokenizers"))
        me = next(r for r in rows if r["threads"] == threads and r["impl"].startswith("lcx"))
        print("threads %d: lcx / tokenizers throughput = %.2fx" % (threads, me["mb_s"] / lib["mb_s"]))
    if a.json:
        json.dump({"text_mb": mb, "cores": cores, "rows": rows}, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
