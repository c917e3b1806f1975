#!/usr/bin/env bash
# Document-masked attention (packed documents, each attending to itself) against full causal attention over the same tokens, on the
# GPU with Qwen3-8B's attention shape: forward and backward per length mix (one document, PG-19-
# like book lengths, many short documents, 4k documents), the rate per useful FLOP (only the score
# entries a query may see) and the wall time. The masked attention runs on cuDNN's padded batches
# of documents read and written in place ("cudnn batches") and, for comparison, on them through
# padded copies of the documents ("cudnn padded copies", the fallback where cuDNN refuses ragged
# plans) and on the own kernels once per document ("own per document"; MASKED_KERNELS=auto leaves
# both out). PEER=1 (the default where python3 imports torch) times PyTorch's two ways of masking
# documents on the same documents (scripts/bench/doc_attention_torch.py: varlen_attn, flash
# attention over cumulative lengths; compiled flex_attention with a document block mask), each
# against its own full causal call. Writes $OUT/doc_attention.jsonl, doc_attention_torch.jsonl and
# doc_attention.md; a few minutes (the peer about three more at 131,072 tokens).
#   TOKENS="131072" MIXES=one,pg19,short,uniform4k MASKED_KERNELS=auto,padded,own PEER=0 scripts/bench/doc_attention.sh build
set -euo pipefail
build=${1:-build}
out=${OUT:-/tmp/lcx-doc-attention}
mkdir -p "$out"
: >"$out/doc_attention.jsonl"
: >"$out/doc_attention_torch.jsonl"
peer=${PEER:-$(python3 -c 'import torch' 2>/dev/null && echo 1 || echo 0)}
for t in ${TOKENS:-131072}; do
  "$build/tests/doc_attention_bench" --device "${DEVICE:-cuda}" --tokens "$t" --mixes "${MIXES:-one,pg19,short,uniform4k}" \
    --masked-kernels "${MASKED_KERNELS:-auto,padded,own}" \
    ${DOC_ATTENTION_ARGS:-} | tee -a "$out/doc_attention.summary" | grep '^{' >>"$out/doc_attention.jsonl"
  if [[ $peer == 1 ]]; then
    "$build/tests/doc_attention_bench" --bounds --tokens "$t" --mixes "${MIXES:-one,pg19,short,uniform4k}" \
      ${DOC_ATTENTION_ARGS:-} >"$out/bounds_$t.jsonl"
    python3 "$(dirname "$0")/doc_attention_torch.py" --bounds "$out/bounds_$t.jsonl" \
      2>>"$out/doc_attention_torch.err" >>"$out/doc_attention_torch.jsonl" || echo "the PyTorch peer failed: see doc_attention_torch.err"
  fi
done
python3 - "$out/doc_attention.jsonl" "$out/doc_attention_torch.jsonl" >"$out/doc_attention.md" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
peers = [json.loads(l) for l in open(sys.argv[2]) if l.strip()]
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
if peers:
    print()
    print("PyTorch on the same documents, each masked call against the same peer's full causal call:")
    print()
    print("| tokens | mix | documents | peer | causal fwd / bwd ms | masked fwd / bwd ms | useful TFLOP/s causal fwd / bwd | masked fwd / bwd | rate masked/causal fwd / bwd | lcx masked fwd+bwd faster |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for m in (p for p in peers if p.get("kind") == "masked" and "error" not in p):
        c = next((p for p in peers if p.get("kind") == "causal" and p["mix"] == m["mix"] and p["peer"] == m["peer"]
                  and p.get("tokens") == m["tokens"] and "error" not in p), None)
        mine = next((r for r in rows if r["kind"] == "masked" and r["mix"] == m["mix"] and r["tokens"] == m["tokens"]), None)
        if not c:
            continue
        faster = f"{(m['forward_s']+m['backward_s'])/(mine['forward_s']+mine['backward_s']):.2f}x" if mine else "-"
        print(f"| {m['tokens']:,} | {m['mix']} | {m['documents']} | torch {m['torch']} {m['peer']} ({m.get('heads', 'gqa')}) | "
              f"{1e3*c['forward_s']:.1f} / {1e3*c['backward_s']:.1f} | {1e3*m['forward_s']:.1f} / {1e3*m['backward_s']:.1f} | "
              f"{c['useful_tflops_fwd']:.0f} / {c['useful_tflops_bwd']:.0f} | {m['useful_tflops_fwd']:.0f} / {m['useful_tflops_bwd']:.0f} | "
              f"{m['useful_tflops_fwd']/c['useful_tflops_fwd']:.2f} / {m['useful_tflops_bwd']/c['useful_tflops_bwd']:.2f} | {faster} |")
    for p in peers:
        if "error" in p:
            print(f"\n{p['peer']} ({p['mix']}, {p['kind']}) did not run: {p['error']}")
PY
cat "$out/doc_attention.md"
