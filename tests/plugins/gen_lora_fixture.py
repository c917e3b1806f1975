#!/usr/bin/env python3
"""A LoRA step in PyTorch, the reference of lcx's lora plugin (tests/plugins/lora_test.cpp).

The base is a parity fixture transformers wrote (tests/parity/fixtures/<base>, read as a user
would, fp32, eager attention). Every nn.Linear of its decoder layers gets PEFT's LoRA branch by
PEFT's own formula, written out here (PEFT is not installed on the GPU machine):

    y = base(x) + scale * lora_B(lora_A(x)),   scale = alpha / r  (alpha / sqrt(r) with rslora)

with A and B random (B non-zero, so every gradient carries signal), the norms trained whole
(modules_to_save = ["norm"]: every module whose name ends with "norm", as PEFT matches them), the
rest frozen. The fixture folder is a PEFT adapter folder (adapter_config.json,
adapter_model.safetensors with PEFT's key names) plus expected.safetensors: the ids and labels (the
base fixture's), the loss and the gradient of every A, B and norm. The step is run twice, in fp32
and again in fp64 from the same values: the fp64 one is the reference (`loss`, `grad.*`, rounded to
fp32 once), the fp32 one is kept beside it (`loss32`, `grad32.*`) so the test can say how far
PyTorch's own fp32 step is from it, the noise floor any fp32 implementation sits on.

    python3 tests/plugins/gen_lora_fixture.py --out tests/plugins/fixtures/lora
"""
import argparse
import json
import math
import os
import shutil

import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import Qwen3ForCausalLM

BASE = "untied_gqa2_d64_sharded"
R, ALPHA, RSLORA = 4, 12.0, False
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SAVED = ["norm"]


class LoraLinear(torch.nn.Module):
    def __init__(self, base, r, scale, gen):
        super().__init__()
        self.base = base
        self.scale = scale
        out_f, in_f = base.weight.shape
        bound = 1.0 / math.sqrt(in_f)  # kaiming_uniform_(a=sqrt(5)), as PEFT starts A
        self.lora_A = torch.nn.Parameter((torch.rand(r, in_f, generator=gen) * 2 - 1) * bound)
        self.lora_B = torch.nn.Parameter(0.05 * torch.randn(out_f, r, generator=gen))

    def forward(self, x):
        return self.base(x) + self.scale * ((x @ self.lora_A.t()) @ self.lora_B.t())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--base-dir", default=os.path.join(os.path.dirname(__file__), "..", "parity", "fixtures", BASE))
    args = ap.parse_args()
    model = Qwen3ForCausalLM.from_pretrained(args.base_dir, dtype=torch.float32, attn_implementation="eager")
    model.train()
    for p in model.parameters():
        p.requires_grad_(False)
    scale = ALPHA / math.sqrt(R) if RSLORA else ALPHA / R
    gen = torch.Generator().manual_seed(2024)
    adapters = {}
    for l, layer in enumerate(model.model.layers):
        for parent, names in ((layer.self_attn, TARGETS[:4]), (layer.mlp, TARGETS[4:])):
            for n in names:
                wrapped = LoraLinear(getattr(parent, n), R, scale, gen)
                setattr(parent, n, wrapped)
                path = ("self_attn." if parent is layer.self_attn else "mlp.") + n
                adapters[f"model.layers.{l}.{path}"] = wrapped
    saved = {}
    for name, module in model.named_modules():
        if any(name.endswith(s) for s in SAVED) and hasattr(module, "weight"):
            module.weight.requires_grad_(True)
            saved[name + ".weight"] = module.weight

    ref = load_file(os.path.join(args.base_dir, "expected.safetensors"))
    ids, labels = ref["input_ids"].unsqueeze(0), ref["labels"].unsqueeze(0)
    # The adapter's values are saved before the fp64 cast: fp32 -> fp64 is exact, so both steps start
    # from the values lcx reads.
    values = {}
    for stem, m in adapters.items():
        values[f"base_model.model.{stem}.lora_A.weight"] = m.lora_A.detach().clone().contiguous()
        values[f"base_model.model.{stem}.lora_B.weight"] = m.lora_B.detach().clone().contiguous()
    for name, p in saved.items():
        values["base_model.model." + name] = p.detach().clone().contiguous()
    trained = {f"base_model.model.{stem}.lora_{w}.weight": (m, w) for stem, m in adapters.items() for w in "AB"}

    def step():
        out = model(input_ids=ids, labels=labels)
        out.loss.backward()
        grads = {k: (m.lora_A if w == "A" else m.lora_B).grad.detach().float().contiguous()
                 for k, (m, w) in trained.items()}
        grads.update({"base_model.model." + n: p.grad.detach().float().contiguous() for n, p in saved.items()})
        for p in model.parameters():
            p.grad = None
        return out.loss.detach().double().reshape(1), grads

    loss32, grads32 = step()
    model.double()
    loss64, grads64 = step()

    shutil.rmtree(args.out, ignore_errors=True)
    os.makedirs(args.out)
    tensors = values
    record = {"input_ids": ids[0].clone(), "labels": labels[0].clone(), "loss": loss64, "loss32": loss32}
    for key in grads64:
        record["grad." + key] = grads64[key]
        record["grad32." + key] = grads32[key]
    save_file(tensors, os.path.join(args.out, "adapter_model.safetensors"), metadata={"format": "pt"})
    save_file(record, os.path.join(args.out, "expected.safetensors"),
              metadata={"transformers": transformers.__version__, "torch": torch.__version__, "base": BASE})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": R, "lora_alpha": ALPHA, "lora_dropout": 0.0,
              "target_modules": TARGETS, "use_rslora": RSLORA, "bias": "none", "modules_to_save": SAVED,
              "base_model_name_or_path": BASE, "fan_in_fan_out": False, "init_lora_weights": True,
              "inference_mode": False}
    with open(os.path.join(args.out, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    rel = lambda a, b: ((a.double() - b.double()).norm() / b.double().norm()).item()
    worst32 = max(rel(grads32[k], grads64[k]) for k in grads64)
    print(f"lora fixture over {BASE}: loss {loss64.item():.9f} (fp32 step {loss32.item():.9f}), "
          f"{len(adapters)} adapted projections, {len(saved)} norms trained whole, PyTorch fp32 vs fp64: worst "
          f"gradient rel L2 {worst32:.2e}, into {args.out}")


if __name__ == "__main__":
    main()
