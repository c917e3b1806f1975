#!/usr/bin/env python3
"""Qwen3-MoE fixtures from transformers: small random qwen3_moe models and what Qwen3MoeForCausalLM computes.

Each model below is built with random weights of odd shapes (experts, top-k, moe_intermediate_size
that line up with nothing), saved as a Hugging Face folder by save_pretrained (the layout
transformers writes: the test reads the folder as a user's checkpoint), reloaded in fp32 on the CPU,
and run on fixed token ids with labels (a few -100) with eager attention. expected.safetensors
records: input_ids, labels, the loss transformers reports (LM loss plus router_aux_loss_coef times
the load-balancing loss where the config sets output_router_logits), the LM loss and the auxiliary
loss apart,
each MoE layer's router logits, a slice of the logits, and the gradient of every parameter under the
name the checkpoint stores it by (transformers keeps the experts fused in memory as
gate_up_proj [E, 2I, H] and down_proj [E, H, I]; their gradients are cut back into the per-expert
keys the folder holds, after checking that the folder's tensors are those very slices).

moe_packed packs three documents, each attending to itself (positions restart), with labels -100
outside a few trained spans, as tests/parity/gen_fixtures.py's masked_packed does.

Needs torch and transformers 5.x (written against 5.17). A few seconds on a CPU:
    python3 tests/models/gen_moe_fixtures.py --out tests/models/fixtures
"""
import argparse
import glob
import json
import os
import shutil
import sys

import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

TOKENS = 72
LOGIT_COLUMNS = 24
IGNORED = (0, 5, 17, 40)
PACKED_BOUNDS = (0, 29, 55, 72)
PACKED_SPANS = ((9, 18), (24, 29), (36, 47), (56, 61), (66, 72))

MODELS = [
    # Layer 1 dense (mlp_only_layers), the others sparse; renormalized top-3 of 7; aux loss on.
    dict(name="moe_norm_aux", vocab=331, hidden=40, intermediate=56, moe_intermediate=20, layers=3, heads=6, kv=2,
         head_dim=12, experts=7, top_k=3, norm=True, sparse_step=1, mlp_only=[1], router_logits=True, coef=0.02,
         tie=False, dtype=torch.float32, packed=False),
    # Every second layer sparse (decoder_sparse_step 2), top-2 of 5 not renormalized, aux loss off,
    # tied head, bf16 on disk.
    dict(name="moe_step2_plain", vocab=293, hidden=36, intermediate=44, moe_intermediate=28, layers=4, heads=4, kv=1,
         head_dim=16, experts=5, top_k=2, norm=False, sparse_step=2, mlp_only=[], router_logits=False, coef=0.001,
         tie=True, dtype=torch.bfloat16, packed=False),
    # Packed documents with trained spans, every layer sparse, top-2 of 6, aux loss on.
    dict(name="moe_packed", vocab=331, hidden=40, intermediate=56, moe_intermediate=24, layers=2, heads=6, kv=2,
         head_dim=12, experts=6, top_k=2, norm=True, sparse_step=1, mlp_only=[], router_logits=True, coef=0.05,
         tie=False, dtype=torch.float32, packed=True),
]


def build(spec, seed):
    cfg = Qwen3MoeConfig(
        vocab_size=spec["vocab"], hidden_size=spec["hidden"], intermediate_size=spec["intermediate"],
        moe_intermediate_size=spec["moe_intermediate"], num_hidden_layers=spec["layers"],
        num_attention_heads=spec["heads"], num_key_value_heads=spec["kv"], head_dim=spec["head_dim"],
        num_experts=spec["experts"], num_experts_per_tok=spec["top_k"], norm_topk_prob=spec["norm"],
        decoder_sparse_step=spec["sparse_step"], mlp_only_layers=list(spec["mlp_only"]),
        output_router_logits=spec["router_logits"], router_aux_loss_coef=spec["coef"],
        max_position_embeddings=TOKENS, rms_norm_eps=1e-6, tie_word_embeddings=spec["tie"],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(cfg).to(torch.float32)
    # Larger than transformers' 0.02 so the routing is far from uniform and every path carries signal.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
    return model


def stored_tensors(folder):
    out = {}
    for path in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        if not path.endswith("expected.safetensors"):
            out.update(load_file(path))
    return out


def disk_gradients(model, stored, spec):
    """Every parameter's gradient under the folder's key names (fused experts cut per expert)."""
    grads = {}
    inter = spec["moe_intermediate"]
    for name, p in model.named_parameters():
        g = p.grad.detach().float()
        if name.endswith("mlp.experts.gate_up_proj"):
            stem = name[: -len("gate_up_proj")]
            for e in range(p.shape[0]):
                for part, rows in (("gate_proj", slice(0, inter)), ("up_proj", slice(inter, 2 * inter))):
                    key = f"{stem}{e}.{part}.weight"
                    assert torch.equal(stored[key].float(), p.detach()[e, rows].to(stored[key].dtype).float()), key
                    grads[key] = g[e, rows].contiguous()
        elif name.endswith("mlp.experts.down_proj"):
            stem = name[: -len("down_proj")]
            for e in range(p.shape[0]):
                key = f"{stem}{e}.down_proj.weight"
                assert torch.equal(stored[key].float(), p.detach()[e].to(stored[key].dtype).float()), key
                grads[key] = g[e].contiguous()
        else:
            key = name if name in stored or not (name == "lm_head.weight" and spec["tie"]) else None
            if key is None:
                continue  # the tied head is the embedding's gradient
            assert key in stored, f"{key} is not in the folder ({sorted(stored)[:8]}...)"
            grads[key] = g.contiguous()
    missing = sorted(set(stored) - set(grads))
    assert not missing, f"no gradient for {missing}"
    return grads


def generate(spec, index, out_dir):
    folder = os.path.join(out_dir, spec["name"])
    shutil.rmtree(folder, ignore_errors=True)
    model = build(spec, 3000 + index)
    model.to(spec["dtype"]).save_pretrained(folder)
    stored = stored_tensors(folder)
    ref = Qwen3MoeForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    ref.train()
    g = torch.Generator().manual_seed(91 + index)
    vocab = spec["vocab"]
    kwargs = {}
    if spec["packed"]:
        eos = vocab - 1
        ids = torch.randint(0, eos, (1, TOKENS), generator=g)
        for end in PACKED_BOUNDS[1:]:
            ids[0, end - 1] = eos
        labels = torch.full_like(ids, -100)
        for b, e in PACKED_SPANS:
            labels[0, b:e] = ids[0, b:e]
        kwargs["position_ids"] = torch.cat(
            [torch.arange(e - b) for b, e in zip(PACKED_BOUNDS, PACKED_BOUNDS[1:])]).unsqueeze(0)
        kwargs["use_cache"] = False
    else:
        ids = torch.randint(0, vocab, (1, TOKENS), generator=g)
        labels = ids.clone()
        labels[0, list(IGNORED)] = -100
    # The router logits are asked for in every case (the auxiliary loss is recorded, and lcx logs it
    # whatever the config); asked for, transformers adds the auxiliary loss to its loss, so where
    # the config leaves it out the reported (and trained) loss is the LM loss alone.
    out = ref(input_ids=ids, labels=labels, output_router_logits=True, **kwargs)
    shift = labels[0, 1:]
    valid = shift != -100
    lm = torch.nn.functional.cross_entropy(out.logits[0, :-1][valid].float(), shift[valid], reduction="mean")
    aux = out.aux_loss.detach().double()
    expected = lm.detach().double() + spec["coef"] * aux
    assert abs(expected.item() - out.loss.item()) < 1e-5 * abs(expected.item()), (expected.item(), out.loss.item())
    loss = out.loss if spec["router_logits"] else lm
    loss.backward()
    record = {
        "input_ids": ids[0].clone(),
        "labels": labels[0].clone(),
        "loss": loss.detach().double().reshape(1),
        "lm_loss": lm.detach().double().reshape(1),
        "aux_loss": aux.reshape(1),
        "logits": out.logits[0, :, :LOGIT_COLUMNS].detach().float().contiguous(),
    }
    if spec["packed"]:
        record["position_ids"] = kwargs["position_ids"][0].clone()
        record["document_bounds"] = torch.tensor(PACKED_BOUNDS, dtype=torch.int64)
    sparse = [l for l in range(spec["layers"])
              if l not in spec["mlp_only"] and (l + 1) % spec["sparse_step"] == 0]
    assert len(out.router_logits) == len(sparse), (len(out.router_logits), sparse)
    for l, rl in zip(sparse, out.router_logits):
        record[f"router_logits.{l}"] = rl.detach().float().reshape(TOKENS, spec["experts"]).contiguous()
    for key, grad in disk_gradients(ref, stored, spec).items():
        record["grad." + key] = grad
    save_file(record, os.path.join(folder, "expected.safetensors"),
              metadata={"transformers": transformers.__version__, "torch": torch.__version__})
    files = sorted(os.listdir(folder))
    size = sum(os.path.getsize(os.path.join(folder, f)) for f in files)
    impl = getattr(ref.config, "_experts_implementation", None)
    print(f"{spec['name']}: loss {loss.item():.6f} (lm {lm.item():.6f}, aux {aux.item():.6f}), sparse layers "
          f"{sparse}, {len(stored)} stored tensors, experts implementation {impl}, files {files}, {size} bytes")
    return size


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    torch.use_deterministic_algorithms(True)
    total = sum(generate(spec, i, args.out) for i, spec in enumerate(MODELS))
    print(f"total {total} bytes")
    if total > 2 * 1024 * 1024:
        sys.exit("fixtures exceed 2 MiB; shrink the models")


if __name__ == "__main__":
    main()
