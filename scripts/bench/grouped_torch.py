#!/usr/bin/env python3
"""PyTorch's grouped GEMM (torch._grouped_mm) at the shapes and routing of bench_gpu --grouped:
Qwen3-30B-A3B's experts (128, 8 a token, hidden 2048, width 768) over `tokens` tokens, every 32nd
expert 4x the mean rows, every 16th none, the rest the mean +-50% (bench_gpu's draw: a different
generator, the same shares). Each direction as bench_gpu names it: the forward and input gradient
of gate/up and down in bf16, the weights' gradients (2-D x 2-D with offsets along the rows) in
bf16; median of CUDA-event timed runs after a warm-up. A direction PyTorch refuses says why.

    python3 scripts/bench/grouped_torch.py --tokens 32768
"""
import argparse
import random

import torch
from torch_timing import time_ms


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    G, H, I = 128, 2048, 768
    R = args.tokens * 8
    rng = random.Random(7)
    share = [4.0 if g % 32 == 3 else 0.0 if g % 16 == 7 else 0.5 + rng.randrange(1000) / 1000 for g in range(G)]
    total = sum(share)
    ends, at = [], 0
    for g in range(G):
        at = R if g + 1 == G else min(R, at + int(share[g] / total * R))
        ends.append(at)
    offs = torch.tensor(ends, dtype=torch.int32, device="cuda")
    dev, bf = "cuda", torch.bfloat16
    rows = {H: torch.randn(R, H, device=dev, dtype=bf), I: torch.randn(R, I, device=dev, dtype=bf)}
    w_ih = torch.randn(G, I, H, device=dev, dtype=bf) * 0.05  # gate/up [G, I, H]
    w_hi = torch.randn(G, H, I, device=dev, dtype=bf) * 0.05  # down [G, H, I]
    weights = {(I, H): w_ih, (H, I): w_hi}
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}: {args.tokens} tokens, {R} rows")
    dirs = [("gate or up fwd 2048->768", H, I, 0), ("down fwd 768->2048", I, H, 0),
            ("gate or up dx 768->2048", I, H, 1), ("down dx 2048->768", H, I, 1),
            ("gate or up dw [768,2048]", H, I, 2), ("down dw [2048,768]", I, H, 2)]
    for name, K, N, kind in dirs:
        flops = 2.0 * R * K * N
        # The operands' layouts _grouped_mm may ask for (made before timing): as a step has them first,
        # then with the reduction dimension contiguous.
        if kind == 0:  # y = x w[g]^T: w [G, N, K] seen as [G, K, N]
            candidates = [(rows[K], weights[(N, K)].transpose(-2, -1))]
        elif kind == 1:  # dx = dy w[g]: w [G, K, N] as stored, or K contiguous
            w = weights[(K, N)]
            candidates = [(rows[K], w), (rows[K], w.transpose(-2, -1).contiguous().transpose(-2, -1))]
        else:  # dw[g] = dy_g^T x_g: [N, R] x [R, K], groups along R
            dyt = rows[N].t().contiguous()
            candidates = [(dyt, rows[K]), (dyt, rows[K].t().contiguous().t())]
        errors = []
        for a, b in candidates:
            try:
                ms = time_ms(lambda: torch._grouped_mm(a, b, offs=offs), args.reps)
                print(f"{name:26s} | torch._grouped_mm {ms:8.3f} ms {flops / ms / 1e9:7.1f} TFLOP/s")
                break
            except Exception as e:  # noqa: BLE001 - the refusal is the figure
                errors.append(str(e).splitlines()[0][:160])
        else:
            print(f"{name:26s} | torch._grouped_mm refused: {' / '.join(errors)}")


if __name__ == "__main__":
    main()
