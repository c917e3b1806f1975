#!/usr/bin/env python3
"""PyTorch's document-masked attention beside lcx's (time and rate per useful FLOP), on the same GPU and the same
documents: the bounds come from `doc_attention_bench --bounds` (one JSON line per mix). For each
mix, one forward and one backward of Qwen3-8B's attention shape (32/8 heads of 128, bf16) are timed
masked and full causal over the same tokens, on the two ways PyTorch offers to mask documents:

- varlen: `torch.nn.attention.varlen.varlen_attn` (flash attention over cumulative lengths; what
  transformers runs for packed sequences with flash_attention_2), against the same call with one
  document of all the tokens.
- flex: `flex_attention` compiled, with a block mask of causal attention within each document (what
  torchtitan runs for packed documents), against a causal block mask.

Timing as doc_attention_bench's: the device synchronized around each call, the median of --reps
after a warm-up (compilation, block masks built outside the timing). Useful FLOPs count only the
score entries a query may see (4 n(n+1)/2 Hq d per document forward, 2.5x that backward), so the
rate masked/causal per useful FLOP compares like with like. One JSON line per (mix, peer, kind).

    doc_attention_bench --bounds --tokens 131072 --mixes pg19,short,uniform4k >bounds.jsonl
    python3 scripts/bench/doc_attention_torch.py --bounds bounds.jsonl
"""
import argparse
import inspect
import json
import statistics
import time

import torch


def seconds(fn, reps):
    """Median seconds of fn over reps after one warm-up, the device synchronized around each."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def useful_flops(bounds, heads, head_dim):
    pairs = sum((b - a) * (b - a + 1) / 2 for a, b in zip(bounds, bounds[1:]))
    return 4.0 * pairs * heads * head_dim


def varlen_peer(q, k, v, dout, bounds, reps):
    """Forward and backward seconds of varlen_attn over these document bounds (causal in each), and
    how it took the grouped heads."""
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    kw = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    group = q.shape[1] // k.shape[1]
    how = "gqa"
    if "enable_gqa" in params:
        kw["enable_gqa"] = True
    elif group > 1:
        how = "k, v expanded"
        # K and V expanded to every query head: the same arithmetic, as transformers does where
        # the kernel takes no GQA flag.
        k = k.detach().repeat_interleave(group, 1).requires_grad_()
        v = v.detach().repeat_interleave(group, 1).requires_grad_()
    cu = torch.tensor(bounds, dtype=torch.int32, device=q.device)
    longest = max(b - a for a, b in zip(bounds, bounds[1:]))
    fwd = lambda: varlen_attn(q, k, v, cu, cu, longest, longest, **kw)
    f = seconds(fwd, reps)
    out = fwd()
    grads = (q, k, v)
    b = seconds(lambda: torch.autograd.grad(out, grads, dout, retain_graph=True), reps)
    return f, b, how


def flex_peer(q, k, v, dout, bounds, reps):
    """Forward and backward seconds of compiled flex_attention, causal within each document."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    T = q.shape[0]
    doc = torch.zeros(T, dtype=torch.int32, device=q.device)
    for a in bounds[1:-1]:
        doc[a] += 1
    doc = torch.cumsum(doc, 0, dtype=torch.int32)

    def mask(b, h, qi, ki):
        return (qi >= ki) & (doc[qi] == doc[ki])

    # Compiled, as torch's docs advise for long sequences: eager it builds the dense T x T mask.
    block = torch.compile(create_block_mask)(mask, None, None, T, T, device=q.device)
    attend = torch.compile(flex_attention)
    # flex takes [B, H, T, d]
    qh, kh, vh = (x.detach().transpose(0, 1).unsqueeze(0).contiguous().requires_grad_() for x in (q, k, v))
    douth = dout.transpose(0, 1).unsqueeze(0).contiguous()
    fwd = lambda: attend(qh, kh, vh, block_mask=block, enable_gqa=True)
    f = seconds(fwd, reps)
    out = fwd()
    b = seconds(lambda: torch.autograd.grad(out, (qh, kh, vh), douth, retain_graph=True), reps)
    return f, b, "gqa"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bounds", required=True, help="doc_attention_bench --bounds output")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--peers", default="varlen,flex")
    a = ap.parse_args()
    peers = {"varlen": varlen_peer, "flex": flex_peer}
    for line in open(a.bounds):
        if not line.strip():
            continue
        mix = json.loads(line)
        bounds, T = mix["bounds"], mix["tokens"]
        g = torch.Generator(device="cuda").manual_seed(1)
        rnd = lambda h: (torch.rand(T, h, a.head_dim, device="cuda", generator=g, dtype=torch.float32) * 2 - 1).to(
            torch.bfloat16).requires_grad_()
        q, k, v = rnd(a.heads), rnd(a.kv_heads), rnd(a.kv_heads)
        dout = rnd(a.heads).detach()
        for name in a.peers.split(","):
            for kind, b in (("causal", [0, T]), ("masked", bounds)):
                try:
                    f, bw, how = peers[name](q, k, v, dout, b, a.reps)
                except Exception as e:  # a peer missing from this PyTorch is reported, not fatal
                    print(json.dumps({"mix": mix["mix"], "peer": name, "kind": kind, "error": str(e)[:200]}), flush=True)
                    continue
                flops = useful_flops(b, a.heads, a.head_dim)
                print(json.dumps({"mix": mix["mix"], "peer": name, "kind": kind, "tokens": T,
                                  "documents": len(b) - 1, "heads": how, "forward_s": f, "backward_s": bw,
                                  "useful_tflops_fwd": flops / f / 1e12,
                                  "useful_tflops_bwd": 2.5 * flops / bw / 1e12,
                                  "torch": torch.__version__}), flush=True)
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
