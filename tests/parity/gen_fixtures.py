#!/usr/bin/env python3
"""Parity fixtures from transformers: small random Qwen3 models and what Qwen3ForCausalLM computes.

For each model below: build it with random weights, save it as a Hugging Face folder (one of them
sharded, most with bf16 weights on disk, one fp32, one with YaRN rope parameters), reload the folder in fp32 on the CPU, run fixed
token ids with labels (a few -100) through Qwen3ForCausalLM with eager attention, and record in
expected.safetensors: input_ids, labels, the loss (transformers' mean over shifted valid labels), a
slice of the logits and the gradient of every parameter, all fp32 (the loss fp64).

masked_packed is of another kind: one packed sequence of three documents, each attending only to
itself (positions restart at each document, as lcx packs them, and transformers derives the same
block-diagonal mask from the restarting position_ids), with labels -100 outside a few trained spans,
as an assistant-only mask leaves them. Its record, expected_masked.safetensors, holds the ids, the
labels, the position ids, the document bounds, the loss and every gradient; the generator checks
them against each document run alone before writing.

Needs torch and transformers 5.x (written against 5.17). Runs on a CPU in a few seconds:
    python3 tests/parity/gen_fixtures.py --out tests/parity/fixtures
    python3 tests/parity/gen_fixtures.py --out tests/parity/fixtures --only masked_packed
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


# Odd sizes everywhere (prime vocab, hidden 40, head_dim 12, GQA 3) so no shape lines up by luck;
# 6 query and 2 kv heads split over sp 2, and 72 tokens over 2 x cp x sp = 8.
MASKED = dict(name="masked_packed", vocab=331, hidden=40, intermediate=56, layers=2, heads=6, kv=2, head_dim=12)
# Three documents of 29, 26 and 17 tokens, each ending with its EOS (the vocabulary's last id).
MASKED_BOUNDS = (0, 29, 55, 72)
# The label positions that train ([begin, end) in the sequence); every other label is -100. They
# end at a document's EOS (the closing token an assistant turn trains on), start at a document's
# second token, and lie wholly inside one document: a document's first label is never trained, as
# its first token cannot be predicted from the document before it.
MASKED_SPANS = ((9, 18), (24, 29), (36, 47), (56, 61), (66, 72))


def masked_labels(ids):
    labels = torch.full_like(ids, -100)
    for begin, end in MASKED_SPANS:
        assert not any(begin <= b < end for b in MASKED_BOUNDS), (begin, end)
        labels[0, begin:end] = ids[0, begin:end]
    return labels


def packed_positions():
    return torch.cat([torch.arange(e - b) for b, e in zip(MASKED_BOUNDS, MASKED_BOUNDS[1:])]).unsqueeze(0)


def relative_l2(got, want):
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def generate_masked(out_dir):
    spec = MASKED
    folder = os.path.join(out_dir, spec["name"])
    shutil.rmtree(folder, ignore_errors=True)
    tokens = MASKED_BOUNDS[-1]
    cfg = Qwen3Config(
        vocab_size=spec["vocab"], hidden_size=spec["hidden"], intermediate_size=spec["intermediate"],
        num_hidden_layers=spec["layers"], num_attention_heads=spec["heads"], num_key_value_heads=spec["kv"],
        head_dim=spec["head_dim"], max_position_embeddings=tokens, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters=dict(DEFAULT_ROPE))
    torch.manual_seed(2024)
    model = Qwen3ForCausalLM(cfg).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
    model.save_pretrained(folder)  # fp32 on disk: lcx reads the very weights the reference ran
    ref = Qwen3ForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    ref.train()
    eos = spec["vocab"] - 1
    g = torch.Generator().manual_seed(4242)
    ids = torch.randint(0, eos, (1, tokens), generator=g)
    for end in MASKED_BOUNDS[1:]:
        ids[0, end - 1] = eos
    labels = masked_labels(ids)
    positions = packed_positions()
    valid = int((labels[0, 1:] != -100).sum())

    # Packed: no attention mask, restarting position ids; transformers masks each document to itself
    # from them (masking_utils.find_packed_sequence_indices), as TRL's padding-free packing runs.
    # use_cache=False: with a cache (even empty) transformers skips the packed-sequence detection.
    out = ref(input_ids=ids, labels=labels, position_ids=positions, use_cache=False)
    out.loss.backward()
    packed_grads = {n: p.grad.detach().clone() for n, p in ref.named_parameters()}

    # The same documents one at a time, each weighted by its share of the valid labels: what the
    # packed run must equal if its attention stayed inside each document.
    ref.zero_grad()
    alone = torch.zeros((), dtype=torch.float64)
    for b, e in zip(MASKED_BOUNDS, MASKED_BOUNDS[1:]):
        n = int((labels[0, b + 1:e] != -100).sum())
        if n == 0:
            continue
        doc = ref(input_ids=ids[:, b:e], labels=labels[:, b:e], use_cache=False)
        (doc.loss * (n / valid)).backward()
        alone += doc.loss.detach().double() * n
    alone /= valid
    loss_gap = abs(alone.item() - out.loss.item()) / abs(alone.item())
    grad_gap = max(relative_l2(packed_grads[n], p.grad) for n, p in ref.named_parameters())
    print(f"masked_packed: packed against documents alone: loss rel {loss_gap:.2e}, worst gradient rel L2 {grad_gap:.2e}")
    if loss_gap > 1e-5 or grad_gap > 1e-4:
        sys.exit("masked_packed: the packed run attends across documents (transformers did not mask them); not written")

    record = {
        "input_ids": ids[0].clone(),
        "labels": labels[0].clone(),
        "position_ids": positions[0].clone(),
        "document_bounds": torch.tensor(MASKED_BOUNDS, dtype=torch.int64),
        "loss": out.loss.detach().double().reshape(1),
        "valid": torch.tensor([valid], dtype=torch.int64),
    }
    for name, grad in packed_grads.items():
        record["grad." + name] = grad.float().contiguous()
    # Not expected.safetensors: that name marks the five unmasked fixtures TransformersParity runs.
    save_file(record, os.path.join(folder, "expected_masked.safetensors"),
              metadata={"transformers": transformers.__version__, "torch": torch.__version__})
    files = sorted(os.listdir(folder))
    size = sum(os.path.getsize(os.path.join(folder, f)) for f in files)
    print(f"masked_packed: loss {out.loss.item():.6f} over {valid} valid labels, {len(packed_grads)} parameters, "
          f"files {files}, {size} bytes")
    return size


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder to write the model folders into")
    names = [m["name"] for m in MODELS] + [MASKED["name"]]
    ap.add_argument("--only", choices=names, action="append", help="write only these fixtures (repeatable)")
    args = ap.parse_args()
    only = set(args.only or names)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    torch.use_deterministic_algorithms(True)
    total = sum(generate(spec, i, args.out) for i, spec in enumerate(MODELS) if spec["name"] in only)
    if MASKED["name"] in only:
        total += generate_masked(args.out)
    print(f"total {total} bytes")
    if total > 3 * 1024 * 1024:
        sys.exit("fixtures exceed 3 MiB; shrink the models")


if __name__ == "__main__":
    main()
