#!/usr/bin/env python3
"""The peer of scripts/bench/startup_bench.sh: transformers writes a random-init Qwen3 folder, and
times from_pretrained onto the GPU plus one training step (bf16, gradient checkpointing, SDPA,
fused AdamW, the chunked loss of torch_step.py), as a user of transformers starts a run.

    python3 startup_torch.py write DIR --model qwen3-8b --shard 4GB
    python3 startup_torch.py step DIR --tokens 8192      # one JSON line: import, load, step seconds
"""
import argparse
import json
import os
import sys
import time

t_start = time.perf_counter()
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402
from transformers import Qwen3Config, Qwen3ForCausalLM  # noqa: E402

from torch_step import EOS, SHAPES, ChunkedLossCheckpoint  # noqa: E402


def write(d, model_name, shard):
    cfg = Qwen3Config(vocab_size=151936, head_dim=128, rope_theta=1e6, rms_norm_eps=1e-6,
                      max_position_embeddings=40960, **SHAPES[model_name])
    torch.manual_seed(0)
    with torch.device("cuda"):  # initialised on the GPU: seconds, where the CPU takes minutes
        model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(d, max_shard_size=shard)
    files = sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))
    size = sum(os.path.getsize(os.path.join(d, f)) for f in files)
    print(json.dumps(dict(written=d, files=len(files), bytes=size)), flush=True)


def step(d, tokens):
    t_import = time.perf_counter() - t_start
    t0 = time.perf_counter()
    model = Qwen3ForCausalLM.from_pretrained(d, dtype=torch.bfloat16, device_map="cuda")
    torch.cuda.synchronize()
    t_load = time.perf_counter() - t0
    t1 = time.perf_counter()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    ids = torch.randint(0, EOS, (1, tokens), device="cuda")
    labels = torch.roll(ids, -1, dims=1)[0]
    labels[-1] = -100
    hidden = model.model(input_ids=ids).last_hidden_state[0]
    loss = ChunkedLossCheckpoint.apply(hidden, model.lm_head.weight, labels, 256)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    t_step = time.perf_counter() - t1
    print(json.dumps(dict(system="transformers", import_s=t_import, load_s=t_load, step_s=t_step,
                          in_process_s=time.perf_counter() - t_start, loss=float(loss))), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["write", "step"])
    ap.add_argument("dir")
    ap.add_argument("--model", default="qwen3-8b", choices=sorted(SHAPES))
    ap.add_argument("--shard", default="4GB")
    ap.add_argument("--tokens", type=int, default=8192)
    a = ap.parse_args()
    if a.what == "write":
        write(a.dir, a.model, a.shard)
    else:
        step(a.dir, a.tokens)


if __name__ == "__main__":
    main()
