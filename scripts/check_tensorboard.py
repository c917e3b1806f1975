#!/usr/bin/env python3
"""Reads a run folder's TensorBoard events file with TensorBoard's own reader and checks that it
holds what metrics.jsonl holds: the same tags (train/<key> for every number of a step row,
eval/<name> for eval_<name> of an evaluation row), the same steps, the same values (as float32). Prints each tag with its step count and last value; exits 1
on any difference.

    python3 scripts/check_tensorboard.py runs/quickstart
"""
import json
import math
import pathlib
import struct
import sys

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def as_f32(x):
    return struct.unpack("<f", struct.pack("<f", float(x)))[0]


def main(run_dir):
    run = pathlib.Path(run_dir)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    if not rows:
        print(f"{run}/metrics.jsonl has no rows")
        return 1
    files = sorted(run.glob("events.out.tfevents.*"))
    print(f"{len(files)} events file(s): {', '.join(f.name for f in files)}")
    want = {}  # tag -> [(step, value)]
    for r in rows:
        for k, v in r.items():
            if k in ("step", "time") or v is None or isinstance(v, str):
                continue
            tag = "eval/" + k[len("eval_"):] if k.startswith("eval_") else "train/" + k
            want.setdefault(tag, []).append((r["step"], as_f32(v)))

    acc = EventAccumulator(str(run), size_guidance={"scalars": 0})
    acc.Reload()
    have = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}

    problems = []
    if set(have) != set(want):
        problems.append(f"tags only in the events file: {sorted(set(have) - set(want))}; "
                        f"only in metrics.jsonl: {sorted(set(want) - set(have))}")
    for tag in sorted(set(have) & set(want)):
        h, w = have[tag], want[tag]
        print(f"  {tag:32s} {len(h):6d} steps, last step {h[-1][0]}, last value {h[-1][1]:.6g}")
        if [s for s, _ in h] != [s for s, _ in w]:
            problems.append(f"{tag}: steps {[s for s, _ in h][:10]}... != metrics.jsonl {[s for s, _ in w][:10]}...")
            continue
        for (s, hv), (_, wv) in zip(h, w):
            if not (hv == wv or (math.isnan(hv) and math.isnan(wv))):
                problems.append(f"{tag} at step {s}: {hv} != metrics.jsonl {wv}")
                break
    for p in problems:
        print("MISMATCH:", p)
    if problems:
        return 1
    print(f"OK: {len(have)} tags over {len(rows)} rows match metrics.jsonl")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print(__doc__)
        sys.exit(2)
    sys.exit(main(sys.argv[1]))
