"""CUDA-event timing shared by the PyTorch peer scripts (attention_torch.py, grouped_torch.py)."""
import statistics

import torch


def time_ms(fn, reps):
    """fn's median time in milliseconds over reps CUDA-event timed runs, after one warm-up run."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)
