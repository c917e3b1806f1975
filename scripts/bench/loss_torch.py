#!/usr/bin/env python3
"""The peer of tests/bench/loss_bench.cpp: PyTorch's chunked loss as TRL and ALST compute it.

The hidden states are cut into chunks of rows; each chunk's logits are computed in bf16, upcast to
fp32 and fed to cross entropy inside torch.utils.checkpoint, so backward recomputes them and only
one chunk's logits exist at a time. The sum over chunks is divided by the valid count. Timed:
forward + backward (median after a warm-up); memory: torch.cuda.max_memory_allocated() during the
call minus what was allocated before it (the inputs) and minus the gradients the call leaves
(hidden.grad and head.grad, which lcx's benchmark allocates before it measures). One JSON line per
length.

    python3 scripts/bench/loss_torch.py --tokens 32768 131072 --rows 256
"""
import argparse
import json
import os
import statistics
import time

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
import torch  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402


def chunk_loss(h, head, y):
    logits = (h @ head.t()).float()
    return torch.nn.functional.cross_entropy(logits, y, ignore_index=-100, reduction="sum")


def chunked_loss(hidden, head, labels, rows):
    valid = (labels != -100).sum()
    total = hidden.new_zeros((), dtype=torch.float32)
    for s in range(0, hidden.shape[0], rows):
        total = total + checkpoint(chunk_loss, hidden[s:s + rows], head, labels[s:s + rows], use_reentrant=False)
    return total / valid


def run(tokens, hidden_size, vocab, rows, reps):
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(tokens, hidden_size, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(True)
    head = (torch.randn(vocab, hidden_size, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02).requires_grad_(True)
    labels = torch.randint(0, vocab, (tokens,), device="cuda", generator=g)
    labels[-1] = -100
    times, added, raw = [], 0, 0
    loss = None
    for i in range(reps + 1):
        hidden.grad = None
        head.grad = None
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        loss = chunked_loss(hidden, head, labels, rows)
        loss.backward()
        torch.cuda.synchronize()
        t = time.perf_counter() - t0
        peak = torch.cuda.max_memory_allocated() - before
        grads = hidden.grad.nbytes + head.grad.nbytes
        raw = max(raw, peak)
        added = max(added, peak - grads)
        if i > 0:
            times.append(t)
    ms = statistics.median(times) * 1e3
    flop = 4.0 * 2 * tokens * vocab * hidden_size  # forward, its recompute, and two backward GEMMs
    return dict(system="pytorch", tokens=tokens, hidden=hidden_size, vocab=vocab, chunk_rows=rows, ms=ms,
                gemm_tflops=flop / ms / 1e9, added_bytes=added, peak_minus_inputs_bytes=raw,
                loss_mean=float(loss))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--hidden", type=int, default=2560)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    for t in a.tokens:
        try:
            out = run(t, a.hidden, a.vocab, a.rows, a.reps)
        except torch.OutOfMemoryError as e:
            out = dict(system="pytorch", tokens=t, error="does not fit", detail=str(e)[:200])
        print(json.dumps(out), flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
