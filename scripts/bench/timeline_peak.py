#!/usr/bin/env python3
"""Where a step's memory peak comes from, read from a memory_timeline.json ([run] memory_timeline):
live bytes by category at the peak, and the allocations and frees around it, to set beside
`lcx-train --plan`'s terms when the plan and the measured peak disagree.
    python3 scripts/bench/timeline_peak.py RUN_DIR/memory_timeline.json [--window 40]
"""
import argparse
import json

p = argparse.ArgumentParser()
p.add_argument("timeline")
p.add_argument("--window", type=int, default=40)
a = p.parse_args()
d = json.load(open(a.timeline))
ev = d["events"]
live = dict(d["live_at_start"])
peak_i, peak = -1, sum(live.values())
by_cat_at_peak = dict(live)
for i, e in enumerate(ev):
    live[e["category"]] = live.get(e["category"], 0) + e["delta"]
    if e["live_after"] > peak:
        peak_i, peak, by_cat_at_peak = i, e["live_after"], dict(live)
mib = lambda b: f"{b / 2**20:,.1f} MiB"
print(f"peak {peak:,} bytes ({peak / 2**30:.3f} GiB) at event {peak_i} of {len(ev)}; planned {d.get('planned_peak_bytes', 0):,}")
for c, b in sorted(by_cat_at_peak.items(), key=lambda kv: -kv[1]):
    if b:
        print(f"  {c:14s} {mib(b)}")
print(f"events {max(0, peak_i - a.window)} to {peak_i + 10} (delta, live after, tag):")
for i in range(max(0, peak_i - a.window), min(len(ev), peak_i + 11)):
    e = ev[i]
    mark = " <- peak" if i == peak_i else ""
    print(f"  {i:6d} {e['category']:13s} {e['delta'] / 2**20:+12.2f} MiB  {e['live_after'] / 2**30:8.3f} GiB  {e.get('tag', '')}{mark}")
