#!/usr/bin/env python3
"""What a step's time went to, read from a trace-step<N>.json ([run] profile = true): time by phase
and kind, and the ops that took the most (a GEMM's M, N, K kept apart), for docs/PERF.md and for
finding the shapes and passes worth fusing.
    python3 scripts/bench/trace_summary.py RUN_DIR/trace-step2.json [--top 30]
"""
import argparse
import collections
import json

p = argparse.ArgumentParser()
p.add_argument("trace")
p.add_argument("--top", type=int, default=30)
a = p.parse_args()

with open(a.trace) as f:
    trace = json.load(f)
summary = trace["otherData"]
step_ms = summary["step_ms"]
ops = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "kind" in e.get("args", {})]

by_phase_kind = collections.defaultdict(float)
kinds = set()
for e in ops:
    by_phase_kind[(e["args"]["phase"], e["cat"])] += e["dur"] / 1e3
    kinds.add(e["cat"])
kinds = sorted(kinds, key=lambda k: -summary["kinds"][k]["ms"])
phases = [ph for ph in ("forward", "loss", "backward", "communication", "optimizer", "none")
          if any(by_phase_kind[(ph, k)] for k in kinds)]
print(f"step {summary['step']} on {summary['device']}: {step_ms:.1f} ms, host gaps {summary['host_gaps_ms']:.1f} ms "
      f"({summary['host_gaps']})")
print(f"{'ms by phase':16}" + "".join(f"{k:>14}" for k in kinds))
for ph in phases:
    print(f"{ph:16}" + "".join(f"{by_phase_kind[(ph, k)]:14.2f}" for k in kinds))

top = collections.defaultdict(lambda: [0.0, 0])
for e in ops:
    t = top[(e["cat"], e["name"], e["args"].get("detail", ""))]
    t[0] += e["dur"] / 1e3
    t[1] += 1
print(f"\n{'ms':>10} {'% step':>7} {'count':>7}  op")
for (cat, name, detail), (ms, n) in sorted(top.items(), key=lambda kv: -kv[1][0])[: a.top]:
    print(f"{ms:10.2f} {100 * ms / step_ms:6.1f}% {n:7}  {cat}: {name} {detail}")
