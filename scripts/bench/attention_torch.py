#!/usr/bin/env python3
"""PyTorch's attention beside lcx's on the same GPU: causal GQA scaled_dot_product_attention in
bf16 through the cuDNN backend (PyTorch's default on Hopper) and the flash backend, forward and
forward+backward, median of several timed runs after a warm-up, on random inputs. FLOPs are
counted as bench_gpu counts them (causal: half the score matrix; backward 2.5x forward). K and V
are expanded to every query head before timing (what transformers does where SDPA's GQA flag is
not taken), so every backend accepts the call; the arithmetic is the same.

    python3 scripts/bench/attention_torch.py --tokens 4096 16384 32768
"""
import argparse

import torch
from torch_timing import time_ms
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384, 32768])
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--fwd-only", action="store_true", help="time the forward alone")
    a = ap.parse_args()
    for T in a.tokens:
        q = torch.randn(1, a.heads, T, a.head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        group = a.heads // a.kv_heads
        kv_shape = (1, a.kv_heads, T, a.head_dim)
        k = torch.randn(kv_shape, device="cuda", dtype=torch.bfloat16).repeat_interleave(group, 1).requires_grad_()
        v = torch.randn(kv_shape, device="cuda", dtype=torch.bfloat16).repeat_interleave(group, 1).requires_grad_()
        dout = torch.randn(1, a.heads, T, a.head_dim, device="cuda", dtype=torch.bfloat16)
        flop = 4.0 * T * T * a.head_dim * a.heads / 2
        shape = f"T={T} Hq={a.heads} Hkv={a.kv_heads} d={a.head_dim} causal"
        for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
            try:
                with sdpa_kernel(backend):
                    fwd = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)
                    f = time_ms(fwd, a.reps)
                    if a.fwd_only:
                        print(f"torch {name:5} attention fwd      | {shape:34} | {f:9.3f} ms | {flop / f / 1e9:8.1f} TFLOP/s",
                              flush=True)
                        continue
                    fb = time_ms(lambda: fwd().backward(dout), a.reps)
            except RuntimeError as e:
                print(f"torch {name:5} attention          | {shape:34} | unavailable: {str(e).splitlines()[0][:60]}")
                continue
            b = fb - f
            print(f"torch {name:5} attention fwd      | {shape:34} | {f:9.3f} ms | {flop / f / 1e9:8.1f} TFLOP/s")
            print(f"torch {name:5} attention bwd      | {shape:34} | {b:9.3f} ms | {2.5 * flop / b / 1e9:8.1f} TFLOP/s")
            print(f"torch {name:5} attention fwd+bwd  | {shape:34} | {fb:9.3f} ms | {3.5 * flop / fb / 1e9:8.1f} TFLOP/s",
                  flush=True)


if __name__ == "__main__":
    main()
