#!/usr/bin/env bash
# Document-masked attention (issue 23) against full causal attention over the same tokens, on the
# GPU with Qwen3-8B's attention shape: forward and backward per length mix (one document, PG-19-
# like book lengths, many short documents, 4k documents), the rate per useful FLOP (only the score
# entries a query may see) and the wall time. The masked attention runs on cuDNN's padded batches
# of documents read and written in place ("cudnn batches") and, for comparison, on them through
# padded copies of the documents ("cudnn padded copies", the fallback where cuDNN refuses ragged
# plans) and on the own kernels once per document ("own per document"; MASKED_KERNELS=auto leaves
# both out). Writes $OUT/doc_attention.jsonl and .md; a few minutes.
#   TOKENS="131072" MIXES=one,pg19,short,uniform4k MASKED_KERNELS=auto,padded,own scripts/bench/doc_attention.sh build
set -euo pipefail
build=${1:-build}
out=${OUT:-/tmp/lcx-doc-attention}
mkdir -p "$out"
: >"$out/doc_attention.jsonl"
for t in ${TOKENS:-131072}; do
  "$build/tests/doc_attention_bench" --device "${DEVICE:-cuda}" --tokens "$t" --mixes "${MIXES:-one,pg19,short,uniform4k}" \
    --masked-kernels "${MASKED_KERNELS:-auto,padded,own}" \
    ${DOC_ATTENTION_ARGS:-} | tee -a "$out/doc_attention.summary" | grep '^{' >>"$out/doc_attention.jsonl"
done
python3 - "$out/doc_attention.jsonl" >"$out/doc_attention.md" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
print("| tokens | mix | documents | masked on | causal fwd / bwd ms | masked fwd / bwd ms | useful TFLOP/s causal fwd / bwd | masked fwd / bwd | rate masked/causal fwd / bwd | wall causal/masked | masked first call ms (plans built) |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
for m in (r for r in rows if r["kind"] in ("masked", "masked_padded", "masked_own")):
    c = next(r for r in rows if r["kind"] == "causal" and r["mix"] == m["mix"] and r["tokens"] == m["tokens"])
    on = {"masked": "cudnn batches", "masked_padded": "cudnn padded copies",
          "masked_own": "own per document"}[m["kind"]]
    print(f"| {m['tokens']:,} | {m['mix']} | {m['documents']} | {on} | {1e3*c['forward_s']:.1f} / {1e3*c['backward_s']:.1f} | "
          f"{1e3*m['forward_s']:.1f} / {1e3*m['backward_s']:.1f} | {c['useful_tflops_fwd']:.0f} / {c['useful_tflops_bwd']:.0f} | "
          f"{m['useful_tflops_fwd']:.0f} / {m['useful_tflops_bwd']:.0f} | "
          f"{m['useful_tflops_fwd']/c['useful_tflops_fwd']:.2f} / {m['useful_tflops_bwd']/c['useful_tflops_bwd']:.2f} | "
          f"{(c['forward_s']+c['backward_s'])/(m['forward_s']+m['backward_s']):.2f}x | {1e3*m.get('first_call_s', 0):.1f} |")
PY
cat "$out/doc_attention.md"
