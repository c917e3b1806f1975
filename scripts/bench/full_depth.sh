#!/usr/bin/env bash
# Full-depth training steps of lcx beside transformers + PyTorch in one GPU call: each variant
# of VARIANTS runs scripts/bench/step_bench.sh on every case of CASES (the peer once per case, in
# the first variant), the first variant's second step is traced (--profile), and a table of step,
# forward, backward, peak and the ratio to the peer is printed last. Runs on the GPU machine from
# the repository root with the bundle linked as build (scripts/gpu_all.sh does that).
#   CASES="qwen3-4b:65536" VARIANTS="offload:loss_chunked+offload chunked:loss_chunked" \
#     scripts/bench/full_depth.sh build
# A variant is name:plugins(+-joined)[:lcx-train flags, commas for spaces]. TORCH_ARGS=--offload runs
# the peer with its activation offload. Each row shows the measured peaks (GPU allocated, pinned
# host) beside the plan's, which lcx-train logs at the start ("memory   planned per GPU: ...").
# PROFILE=0 leaves the first variant's second step untraced (timing every variant alike).
# The trained full-depth step at the longest length one device call finishes, beside PyTorch with
# its offload:
#   FULL_CASES="qwen3-4b:262144" STEPS=1 TORCH=0 TESTS=0 scripts/gpu_all.sh   (one lcx step, ~4-5 min)
#   python3 scripts/bench/torch_step.py --model qwen3-4b --tokens 262144 --steps 1 --offload   (the peer, alone)
set -uo pipefail
build=${1:-build}
out=${OUT:-/tmp/lcx-full-depth}
cases=${CASES:-"qwen3-4b:65536"}
variants=${VARIANTS:-"offload:loss_chunked+offload"}
mkdir -p "$out"
first=1
for v in $variants; do
  name=${v%%:*}
  rest=${v#*:}
  plugins=${rest%%:*}
  flags=""
  [[ $rest == *:* ]] && flags=${rest#*:}
  flags=${flags//,/ }
  [[ $first == 1 && ${PROFILE:-1} != 0 ]] && flags="$flags --profile"
  OUT=$out/$name PLUGINS="${plugins//+/ }" MASTER=${MASTER:-bf16} TORCH=$((first && ${TORCH:-1})) LCX_ARGS="$flags" CASES="$cases" \
    LCX_STEP_TIMEOUT=${LCX_STEP_TIMEOUT:-400} scripts/bench/step_bench.sh "$build" >"$out/$name.out" 2>&1
  first=0
done
python3 - "$out" <<'PY'
import glob, json, os, statistics, sys
out = sys.argv[1]
peer = {}
for t in glob.glob(f"{out}/*/*/torch.json"):
    try:
        peer[os.path.basename(os.path.dirname(t))] = json.load(open(t))
    except ValueError:
        pass
print("| case | variant | step s | forward s | backward s | MFU | peak GiB | plan GiB | host (pinned + optimizer) / plan GiB | PyTorch s | PyTorch GiB | lcx / PyTorch |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|")
import re
def planned(log):
    try:
        text = open(log, errors="replace").read()
    except OSError:
        return None
    # The plan's line for scripts when logged, else the run summary's (GiB to two places).
    m = re.search(r"plan: peak_bytes=\d+ allocated_bytes=(\d+) .*?host_bytes=(\d+)", text)
    if m:
        return (int(m.group(1)), int(m.group(2)))
    m = re.search(r"planned per GPU: peak ([\d.]+) GiB.*?pinned host ([\d.]+) GiB", text)
    return (float(m.group(1)) * 2**30, float(m.group(2)) * 2**30) if m else None
for m in sorted(glob.glob(f"{out}/*/*/out/metrics.jsonl")):
    case = m.split("/")[-3]
    variant = m.split("/")[-4]
    rows = [r for r in (json.loads(l) for l in open(m) if l.strip()) if "step_s" in r]  # step rows, not [eval]'s
    if not rows:
        print(f"| {case} | {variant} | failed | | | | | | | | | |")
        continue
    med = lambda k: statistics.median(r.get(k, 0) for r in (rows[1:] or rows))  # one step: warm-up included
    step = med("step_s")
    peak = max(r.get("peak_gpu_bytes", 0) for r in rows) / 2**30
    # The plan's host figure: the pinned pool and an optimizer's state in host memory (host_adamw).
    pinned = max(r.get("peak_pinned_bytes", 0) + r.get("host_optimizer_bytes", 0) for r in rows) / 2**30
    pl = planned(os.path.join(os.path.dirname(os.path.dirname(m)), "lcx.log"))
    plan_gpu = f"{pl[0] / 2**30:.2f}" if pl else "-"
    plan_pinned = f"{pinned:.2f} / {pl[1] / 2**30:.2f}" if pl else f"{pinned:.2f} / -"
    p = peer.get(case, {})
    ps = p.get("step_s")
    ratio = f"{step / ps:.2f}" if ps else "-"
    print(f"| {case} | {variant} | {step:.2f} | {med('time_forward_s'):.2f} | {med('time_backward_s'):.2f} | "
          f"{med('mfu') * 100:.1f}% | {peak:.2f} | {plan_gpu} | {plan_pinned} | {ps if ps else '-'} | {p.get('peak_gib', '-')} | {ratio} |")
PY
for t in "$out"/*/*/out/trace-step*.json; do
  [[ -f $t ]] && python3 scripts/bench/trace_summary.py "$t" 2>&1 | head -60
done
