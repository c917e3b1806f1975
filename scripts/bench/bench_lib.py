"""What the benchmark scripts read back from a run folder, written once.

    sys.path.insert(0, "scripts/bench"); from bench_lib import step_rows, layer_seconds
"""
import json


def step_rows(metrics_path):
    """metrics.jsonl's step rows, in order ([eval] rows have no step_s)."""
    with open(metrics_path) as f:
        return [r for r in (json.loads(l) for l in f if l.strip()) if "step_s" in r]


def layer_seconds(trace_path):
    """Seconds the traced step spent in its layers, by phase: {"forward": s, "backward": s}."""
    with open(trace_path) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    span = {"forward": 0.0, "backward": 0.0}
    for e in events:
        if e.get("cat") == "layer" and e.get("ph") == "X":
            span[e["args"]["phase"]] += e["dur"] / 1e6
    return span
