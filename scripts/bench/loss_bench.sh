#!/usr/bin/env bash
# The loss alone on one GPU (time and memory added), Qwen3-4B's head (H 2560, V 151,936, bf16) at 32k and
# 128k tokens. lcx's chunked loss (tests/loss_bench, through the plugin loader) and core's plain
# full-logits loss, then PyTorch's chunked loss as TRL computes it (scripts/bench/loss_torch.py:
# checkpointed 256-row chunks, fp32 upcast) in the same run; and a sweep of chunk_rows. Time is
# forward + backward (median of 3 after a warm-up); memory is what the loss adds over its inputs
# and the gradients' own buffers (hidden, grad_hidden, head, head gradient).
# Runs on the GPU machine from the repository root; writes $OUT/loss_bench.md and the raw JSON
# lines beside it. About a minute and a half on an H200; every part is under a timeout (3 minutes
# in all), and a part that fails or times out leaves a row that says so.
#   OUT=/tmp/loss scripts/bench/loss_bench.sh build
#   DEVICE=cpu DTYPE=bf16 TOKENS="1024 2048" HIDDEN=64 VOCAB=1001 TORCH=0 scripts/bench/loss_bench.sh build-loss   (smoke run)
set -uo pipefail
build=${1:-build}
out=${OUT:-/tmp/lcx-loss-bench}
device=${DEVICE:-cuda}
tokens=${TOKENS:-"32768 131072"}
hidden=${HIDDEN:-2560}
vocab=${VOCAB:-151936}
sweep=${SWEEP:-64,128,256,512,1024,2048,4096}
torch=${TORCH:-1}
dtype=${DTYPE:-}  # of hidden and head; loss_bench's default: bf16 on cuda, fp32 on cpu
mkdir -p "$out"
raw=$out/loss_bench.jsonl
: >"$raw"
[[ -f scripts/gpu_env.sh && $device == cuda ]] && source scripts/gpu_env.sh "$build"

bench=$build/tests/loss_bench
for t in $tokens; do
  # 128k is four times the GEMM work of 32k; the sweep's smallest chunks are the slowest.
  limit=$((t > 65536 ? 80 : 40))
  timeout "$limit" "$bench" --device "$device" --tokens "$t" --hidden "$hidden" --vocab "$vocab" --sweep "$sweep" \
    ${dtype:+--dtype "$dtype"} --plugin-dir "$build/lib/lcx/plugins" >>"$raw" 2>"$out/loss_bench_$t.err"
  rc=$?
  if [[ $rc -ne 0 ]]; then
    why="loss_bench rc $rc$([[ $rc -eq 124 ]] && echo ', timed out')"
    for loss in chunked plain; do echo "{\"loss\": \"$loss\", \"tokens\": $t, \"error\": \"$why\"}" >>"$raw"; done
    tail -3 "$out/loss_bench_$t.err" >&2
  fi
done
if [[ $torch != 0 ]]; then
  PYTHONUNBUFFERED=1 timeout 60 python3 scripts/bench/loss_torch.py --tokens $tokens --hidden "$hidden" --vocab "$vocab" \
    >>"$raw" 2>"$out/loss_torch.err"
  rc=$?
  [[ $rc -ne 0 ]] && { echo "{\"system\": \"pytorch\", \"error\": \"loss_torch.py rc $rc\"}" >>"$raw"; tail -3 "$out/loss_torch.err" >&2; }
fi

python3 - "$raw" "$hidden" "$vocab" "$device" >"$out/loss_bench.md" <<'PY'
import json, sys
raw, H, V, device = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
rows = []
for line in open(raw):
    line = line.strip()
    if line.startswith("{"):
        try:
            rows.append(json.loads(line))
        except ValueError:
            pass

def gb(b):
    return f"{b / 1e9:.2f} GB" if b >= 1e9 else f"{b / 1e6:.0f} MB"

def find(**kw):
    """The row with these fields, else the error row its process left for that length (or for all)."""
    for r in rows:
        if all(r.get(k) == v for k, v in kw.items()):
            return r
    who = {k: v for k, v in kw.items() if k in ("loss", "system")}
    for r in rows:
        if "error" in r and all(r.get(k) == v for k, v in who.items()) and r.get("tokens", kw.get("tokens")) == kw.get("tokens"):
            return r
    return None

tokens = sorted({r["tokens"] for r in rows if "tokens" in r})
dtypes = sorted({r["dtype"] for r in rows if "dtype" in r}) or ["?"]
print(f"Loss alone, forward + backward, H {H:,}, V {V:,} ({'/'.join(dtypes)}, {device}); "
      "memory: what the loss adds over hidden, grad_hidden, head and its gradient. "
      "Plain fp32 logits alone would be " + ", ".join(f"{gb(t * V * 4)} at {t:,}" for t in tokens) + ".\n")
print("| tokens | loss | chunk rows | time ms | GEMM TFLOP/s | memory added | time / lcx chunked |")
print("|---|---|---|---|---|---|---|")
for t in tokens:
    base = find(loss="chunked", tokens=t, chunk_rows=256)
    cases = [("lcx chunked (fused kernel)", find(loss="chunked", tokens=t, chunk_rows=256)),
             ("lcx plain (core, full logits)", find(loss="plain", tokens=t)),
             ("PyTorch chunked (checkpointed, fp32 upcast)", find(system="pytorch", tokens=t))]
    for name, r in cases:
        if r is None:
            print(f"| {t:,} | {name} | - | not run | - | - | - |")
        elif "error" in r:
            print(f"| {t:,} | {name} | - | {r['error']} | - | - | - |")
        else:
            rows_ = r.get("chunk_rows", "-") if "plain" not in name else "all"
            tf = r.get("tflops", r.get("gemm_tflops", 0))
            ratio = f"{r['ms'] / base['ms']:.2f}" if base and "ms" in base else "-"
            print(f"| {t:,} | {name} | {rows_} | {r['ms']:.1f} | {tf:.0f} | {gb(r['added_bytes'])} | {ratio} |")

sweep = sorted({r["chunk_rows"] for r in rows if r.get("loss") == "chunked" and "chunk_rows" in r})
if sweep:
    print("\nchunk_rows sweep (lcx chunked): time ms / memory added\n")
    print("| chunk rows | " + " | ".join(f"{t:,} tokens" for t in tokens) + " |")
    print("|---" * (len(tokens) + 1) + "|")
    for c in sweep:
        cells = []
        for t in tokens:
            r = find(loss="chunked", tokens=t, chunk_rows=c)
            cells.append("-" if r is None else r["error"] if "error" in r else f"{r['ms']:.1f} ms / {gb(r['added_bytes'])}")
        print(f"| {c} | " + " | ".join(cells) + " |")
PY
cat "$out/loss_bench.md"
