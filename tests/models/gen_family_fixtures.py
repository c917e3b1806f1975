#!/usr/bin/env python3
"""Parity fixtures from transformers for the dense families on models/common: Llama, Mistral, Qwen2.

For each model below: build it with random weights, save it as a Hugging Face folder (one with the
rope parameters rewritten in transformers 4's form, top-level rope_theta and rope_scaling), reload
the folder in fp32 on the CPU, run fixed token ids with labels (a few -100) through the family's
ForCausalLM with eager attention, and record in expected.safetensors: input_ids, labels, the loss
(transformers' mean over shifted valid labels), a slice of the logits and the gradient of every
parameter, all fp32 (the loss fp64).

qwen2_packed is of masked_packed's kind (tests/parity/gen_fixtures.py): one packed sequence of three
documents with restarting positions and labels -100 outside a few spans, recorded in
expected_masked.safetensors with the position ids, the document bounds and the valid count; the
generator checks it against each document run alone before writing.

Needs torch and transformers 5.x (written against 5.17). Runs on a CPU in seconds:
    python3 tests/models/gen_family_fixtures.py --out tests/models/fixtures/families
"""
import argparse
import json
import os
import shutil
import sys
import traceback

import torch
import transformers
from safetensors.torch import save_file
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM)

VOCAB = 256
TOKENS = 64
LOGIT_COLUMNS = 32
IGNORED = (0, 5, 17, 40)  # label positions set to -100
# Llama 3.1's shape of rope scaling at a small scale: with head_dim 16 and theta 1e4 the wavelengths
# 6.3, 19.9, 62.8, 199, ... fall on each side of 64 / 4 and 64 / 1, so every branch (kept,
# smoothed, divided) is taken.
LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
LLAMA3_UNTIED = dict(LLAMA3, factor=4.0, high_freq_factor=2.0)
LINEAR = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}
# 64 tokens past 32 trained positions: transformers rescales the base from the longest position.
DYNAMIC = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
DEFAULT = {"rope_type": "default", "rope_theta": 10000.0}

FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
}

# hidden 64 over 4 heads: head_dim 16 = hidden / heads, so no reader has to guess which one rope uses.
MODELS = [
    dict(name="llama3_tied_f32", family="llama", tie=True, kv=2, rope=LLAMA3, positions=256, dtype=torch.float32),
    dict(name="llama3_untied", family="llama", tie=False, kv=1, rope=LLAMA3_UNTIED, positions=256, dtype=torch.bfloat16),
    dict(name="llama_linear_t4", family="llama", tie=False, kv=2, rope=LINEAR, positions=128, dtype=torch.bfloat16,
         transformers4=True),
    dict(name="llama_dynamic", family="llama", tie=True, kv=4, rope=DYNAMIC, positions=32, dtype=torch.bfloat16),
    dict(name="mistral_untied", family="mistral", tie=False, kv=1, rope=dict(DEFAULT, rope_theta=1e6), positions=128,
         dtype=torch.bfloat16),
    dict(name="qwen2_bias_tied", family="qwen2", tie=True, kv=2, rope=dict(DEFAULT, rope_theta=1e6), positions=128,
         dtype=torch.bfloat16),
]


def config_for(family, **kw):
    cls, _ = FAMILIES[family]
    extra = {}
    if family == "mistral":
        extra["sliding_window"] = None
    if family == "qwen2":
        extra["use_sliding_window"] = False
    return cls(**kw, **extra)


def randomize(model):
    # Larger than transformers' 0.02 so attention is far from uniform and every path carries
    # signal; norm weights away from 1 so their place in the formula matters; biases away from 0.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
            elif p.dim() == 1:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))


def to_transformers4(folder, rope):
    # The same model as transformers 4 wrote it: rope_theta at the top, the scaling in rope_scaling.
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg.pop("rope_parameters", None)
    cfg["rope_theta"] = rope["rope_theta"]
    scaling = {k: v for k, v in rope.items() if k not in ("rope_type", "rope_theta")}
    scaling["type"] = rope["rope_type"]
    cfg["rope_scaling"] = scaling
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2)


def check_rope(ref, rope):
    got = ref.config.rope_parameters
    for key, value in rope.items():
        assert got.get(key) == value, (key, got)


def write_record(folder, record, name):
    save_file(record, os.path.join(folder, name),
              metadata={"transformers": transformers.__version__, "torch": torch.__version__})
    files = sorted(os.listdir(folder))
    return files, sum(os.path.getsize(os.path.join(folder, f)) for f in files)


def generate(spec, index, out_dir):
    folder = os.path.join(out_dir, spec["name"])
    shutil.rmtree(folder, ignore_errors=True)
    family = spec["family"]
    cfg = config_for(family, vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=spec["kv"], head_dim=16,
                     max_position_embeddings=spec["positions"], rms_norm_eps=1e-5, tie_word_embeddings=spec["tie"],
                     rope_parameters=dict(spec["rope"]))
    torch.manual_seed(3000 + index)
    model = FAMILIES[family][1](cfg).to(torch.float32)
    randomize(model)
    model.to(spec["dtype"]).save_pretrained(folder)
    if spec.get("transformers4"):
        to_transformers4(folder, spec["rope"])
    ref = FAMILIES[family][1].from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    check_rope(ref, spec["rope"])
    ref.train()
    g = torch.Generator().manual_seed(91 + index)
    ids = torch.randint(0, VOCAB, (1, TOKENS), generator=g)
    labels = ids.clone()
    labels[0, list(IGNORED)] = -100
    out = ref(input_ids=ids, labels=labels, use_cache=False)
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
    files, size = write_record(folder, record, "expected.safetensors")
    print(f"{spec['name']}: {family}, rope {ref.config.rope_parameters}, loss {out.loss.item():.6f}, "
          f"{len(names)} parameters, files {files}, {size} bytes")
    return size


# Qwen2 with its q/k/v biases over the masked_packed shapes of tests/parity/gen_fixtures.py (6 query
# and 2 kv heads split over sp 2, 72 tokens over 2 x cp x sp = 8), hidden 48 so head_dim is
# hidden / heads = 8, as Qwen2's config leaves it.
PACKED = dict(name="qwen2_packed", vocab=331, hidden=48, intermediate=56, layers=2, heads=6, kv=2)
PACKED_BOUNDS = (0, 29, 55, 72)
PACKED_SPANS = ((9, 18), (24, 29), (36, 47), (56, 61), (66, 72))


def relative_l2(got, want):
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def generate_packed(out_dir):
    spec = PACKED
    folder = os.path.join(out_dir, spec["name"])
    shutil.rmtree(folder, ignore_errors=True)
    tokens = PACKED_BOUNDS[-1]
    cfg = config_for("qwen2", vocab_size=spec["vocab"], hidden_size=spec["hidden"],
                     intermediate_size=spec["intermediate"], num_hidden_layers=spec["layers"],
                     num_attention_heads=spec["heads"], num_key_value_heads=spec["kv"],
                     max_position_embeddings=tokens, rms_norm_eps=1e-6, tie_word_embeddings=False,
                     rope_parameters=dict(DEFAULT))
    torch.manual_seed(2025)
    model = Qwen2ForCausalLM(cfg).to(torch.float32)
    randomize(model)
    model.save_pretrained(folder)  # fp32 on disk
    ref = Qwen2ForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    ref.train()
    eos = spec["vocab"] - 1
    g = torch.Generator().manual_seed(4343)
    ids = torch.randint(0, eos, (1, tokens), generator=g)
    for end in PACKED_BOUNDS[1:]:
        ids[0, end - 1] = eos
    labels = torch.full_like(ids, -100)
    for begin, end in PACKED_SPANS:
        labels[0, begin:end] = ids[0, begin:end]
    positions = torch.cat([torch.arange(e - b) for b, e in zip(PACKED_BOUNDS, PACKED_BOUNDS[1:])]).unsqueeze(0)
    valid = int((labels[0, 1:] != -100).sum())
    out = ref(input_ids=ids, labels=labels, position_ids=positions, use_cache=False)
    out.loss.backward()
    packed_grads = {n: p.grad.detach().clone() for n, p in ref.named_parameters()}
    ref.zero_grad()
    alone = torch.zeros((), dtype=torch.float64)
    for b, e in zip(PACKED_BOUNDS, PACKED_BOUNDS[1:]):
        n = int((labels[0, b + 1:e] != -100).sum())
        if n == 0:
            continue
        doc = ref(input_ids=ids[:, b:e], labels=labels[:, b:e], use_cache=False)
        (doc.loss * (n / valid)).backward()
        alone += doc.loss.detach().double() * n
    alone /= valid
    loss_gap = abs(alone.item() - out.loss.item()) / abs(alone.item())
    grad_gap = max(relative_l2(packed_grads[n], p.grad) for n, p in ref.named_parameters())
    print(f"qwen2_packed: packed against documents alone: loss rel {loss_gap:.2e}, worst gradient rel L2 {grad_gap:.2e}")
    if loss_gap > 1e-5 or grad_gap > 1e-4:
        sys.exit("qwen2_packed: the packed run attends across documents; not written")
    record = {
        "input_ids": ids[0].clone(),
        "labels": labels[0].clone(),
        "position_ids": positions[0].clone(),
        "document_bounds": torch.tensor(PACKED_BOUNDS, dtype=torch.int64),
        "loss": out.loss.detach().double().reshape(1),
        "valid": torch.tensor([valid], dtype=torch.int64),
    }
    for name, grad in packed_grads.items():
        record["grad." + name] = grad.float().contiguous()
    files, size = write_record(folder, record, "expected_masked.safetensors")
    print(f"qwen2_packed: loss {out.loss.item():.6f} over {valid} valid labels, {len(packed_grads)} parameters, "
          f"files {files}, {size} bytes")
    return size


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder to write the model folders into")
    names = [m["name"] for m in MODELS] + [PACKED["name"]]
    ap.add_argument("--only", choices=names, action="append", help="write only these fixtures (repeatable)")
    args = ap.parse_args()
    only = set(args.only or names)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    torch.use_deterministic_algorithms(True)
    os.makedirs(args.out, exist_ok=True)
    sizes, failed = {}, []
    jobs = [(m["name"], lambda m=m, i=i: generate(m, i, args.out)) for i, m in enumerate(MODELS)]
    jobs.append((PACKED["name"], lambda: generate_packed(args.out)))
    for name, job in jobs:
        if name not in only:
            continue
        try:  # one fixture's failure leaves the others written
            sizes[name] = job()
        except Exception:
            traceback.print_exc()
            failed.append(name)
    print(f"total {sum(sizes.values())} bytes")
    big = [n for n, s in sizes.items() if s > 1024 * 1024]
    if big:
        sys.exit(f"fixtures over 1 MiB: {big}; shrink the models")
    if failed:
        sys.exit(f"not written: {failed}")


if __name__ == "__main__":
    main()
