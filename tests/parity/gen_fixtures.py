#!/usr/bin/env python3
"""Parity fixtures from transformers: small random Qwen3 models and what Qwen3ForCausalLM computes.

For each model below: build it with random weights, save it as a Hugging Face folder (one of them
sharded, most with bf16 weights on disk, one fp32, one with YaRN rope parameters), reload the folder in fp32 on the CPU, run fixed
token ids with labels (a few -100) through Qwen3ForCausalLM with eager attention, and record in
expected.safetensors: input_ids, labels, the loss (transformers' mean over shifted valid labels), a
slice of the logits and the gradient of every parameter, all fp32 (the loss fp64).

Needs torch and transformers 5.x (written against 5.17). Runs on a CPU in a few seconds:
    python3 tests/parity/gen_fixtures.py --out tests/parity/fixtures
"""
import argparse
import json
import os
import shutil
import sys

import torch
import transformers
from safetensors.torch import save_file
from transformers import Qwen3Config, Qwen3ForCausalLM

VOCAB = 384
TOKENS = 64
LOGIT_COLUMNS = 32
IGNORED = (0, 5, 17, 40)  # label positions set to -100 (0 is never a target after the shift)
DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 10000.0}
# YaRN stretching 16 trained positions by 4: the 64 tokens run past the original range.
YARN_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16}

# Small enough that all five fit in < 3 MB; together they cover tied and untied heads, GQA ratios
# 1, 2 and 4, head_dim 64 and 128, fp32 and bf16 on disk, one and several shards, YaRN off and on.
MODELS = [
    dict(name="tied_gqa1_d64_f32", tie=True, heads=2, kv=2, head_dim=64, dtype=torch.float32, shard=None,
         rope=DEFAULT_ROPE),
    dict(name="untied_gqa2_d64_sharded", tie=False, heads=2, kv=1, head_dim=64, dtype=torch.bfloat16,
         shard="100KB", rope=DEFAULT_ROPE),
    dict(name="tied_gqa4_d64", tie=True, heads=4, kv=1, head_dim=64, dtype=torch.bfloat16, shard=None,
         rope=DEFAULT_ROPE),
    dict(name="untied_gqa2_d128", tie=False, heads=2, kv=1, head_dim=128, dtype=torch.bfloat16, shard=None,
         rope=DEFAULT_ROPE),
    dict(name="tied_gqa2_d64_yarn", tie=True, heads=2, kv=1, head_dim=64, dtype=torch.bfloat16, shard=None,
         rope=YARN_ROPE),
]


def build(spec, seed):
    cfg = Qwen3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
        num_attention_heads=spec["heads"], num_key_value_heads=spec["kv"], head_dim=spec["head_dim"],
        max_position_embeddings=TOKENS, rms_norm_eps=1e-6, tie_word_embeddings=spec["tie"],
        rope_parameters=dict(spec["rope"]))
    for key, value in spec["rope"].items():
        assert cfg.rope_parameters[key] == value, cfg.rope_parameters
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(cfg).to(torch.float32)
    # Larger than transformers' 0.02 so attention is far from uniform and every path carries
    # signal; norm weights away from 1 so their place in the formula matters.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
    return model


def generate(spec, index, out_dir):
    folder = os.path.join(out_dir, spec["name"])
    shutil.rmtree(folder, ignore_errors=True)
    model = build(spec, 1000 + index)
    kwargs = {"max_shard_size": spec["shard"]} if spec["shard"] else {}
    model.to(spec["dtype"]).save_pretrained(folder, **kwargs)
    # The reference is what the folder holds, read back as any user would, computed in fp32.
    ref = Qwen3ForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    ref.train()  # dropout is 0; train mode only to mirror a fine-tuning step
    g = torch.Generator().manual_seed(77 + index)
    ids = torch.randint(0, VOCAB, (1, TOKENS), generator=g)
    labels = ids.clone()
    labels[0, list(IGNORED)] = -100
    out = ref(input_ids=ids, labels=labels)
    out.loss.backward()
    record = {
        "input_ids": ids[0].clone(),
        "labels": labels[0].clone(),
        "loss": out.loss.detach().double().reshape(1),
        "logits": out.logits[0, :, :LOGIT_COLUMNS].detach().float().contiguous(),
    }
    names = []
    for name, p in ref.named_parameters():
        record["grad." + name] = p.grad.detach().float().contiguous()
        names.append(name)
    save_file(record, os.path.join(folder, "expected.safetensors"),
              metadata={"transformers": transformers.__version__, "torch": torch.__version__})
    files = sorted(os.listdir(folder))
    size = sum(os.path.getsize(os.path.join(folder, f)) for f in files)
    print(f"{spec['name']}: rope {ref.config.rope_parameters}, loss {out.loss.item():.6f}, {len(names)} parameters, files {files}, {size} bytes")
    return size


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder to write the model folders into")
    args = ap.parse_args()
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    torch.use_deterministic_algorithms(True)
    total = sum(generate(spec, i, args.out) for i, spec in enumerate(MODELS))
    print(f"total {total} bytes")
    if total > 3 * 1024 * 1024:
        sys.exit("fixtures exceed 3 MiB; shrink the models")


if __name__ == "__main__":
    main()
