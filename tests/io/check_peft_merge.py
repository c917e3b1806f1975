#!/usr/bin/env python3
"""Checks `lcx-train merge` against a merge by hand in PyTorch, both loaded by transformers.

For each base dtype (fp32, bf16) this builds a random Qwen3 with transformers (save_pretrained), a
random PEFT LoRA adapter folder (adapter_config.json + adapter_model.safetensors with PEFT's key
names, B not zero so the update shows), runs `lcx-train merge`, and compares:
- the merged folder loads with Qwen3ForCausalLM.from_pretrained with no missing, unexpected or
  mismatched key, in the base's dtype;
- every weight equals the reference W + scale * B @ A computed here in fp32 from the adapter's
  safetensors and rounded to the base's dtype (fp32: 1e-6 relative; bf16: one rounding step), and
  every other weight equals the base bit for bit;
- the logits of a few token ids (eager attention, fp32 compute) equal the reference model's
  (fp32: 1e-5 relative; bf16: 1e-3).
It also runs once with use_rslora (scale alpha / sqrt(r)). PEFT is not needed; when it is installed,
PEFT's own merge_and_unload in the base's dtype is compared too. With --base and --adapter it checks a real pair
instead (fp32 logits on the CPU or --device).

    python3 tests/io/check_peft_merge.py --lcx-train build/bin/lcx-train --work /tmp/peft-check

Prints one line per case and "PASS" or the problems; exit 1 on any problem.
"""
import argparse
import json
import math
import os
import shutil
import subprocess
import sys

import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3Config, Qwen3ForCausalLM

MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def module_path(m):
    return ("self_attn." if m in MODULES[:4] else "mlp.") + m


def tiny_base(path, dtype, seed):
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                      tie_word_embeddings=False)
    model = Qwen3ForCausalLM(cfg).to(dtype)
    # Random norms too, so a norm copied wrongly would show.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    return model.config


def random_adapter(path, config, r, alpha, rslora, modules, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    os.makedirs(path, exist_ok=True)
    sd = {}
    for layer in range(config.num_hidden_layers):
        for m in modules:
            lin = {"q_proj": (config.num_attention_heads * config.head_dim, config.hidden_size),
                   "k_proj": (config.num_key_value_heads * config.head_dim, config.hidden_size),
                   "v_proj": (config.num_key_value_heads * config.head_dim, config.hidden_size),
                   "o_proj": (config.hidden_size, config.num_attention_heads * config.head_dim),
                   "gate_proj": (config.intermediate_size, config.hidden_size),
                   "up_proj": (config.intermediate_size, config.hidden_size),
                   "down_proj": (config.hidden_size, config.intermediate_size)}[m]
            key = f"base_model.model.model.layers.{layer}.{module_path(m)}"
            sd[key + ".lora_A.weight"] = (torch.rand(r, lin[1], generator=g) * 2 - 1).mul(0.1).to(dtype).contiguous()
            sd[key + ".lora_B.weight"] = (torch.rand(lin[0], r, generator=g) * 2 - 1).mul(0.1).to(dtype).contiguous()
    save_file(sd, os.path.join(path, "adapter_model.safetensors"), metadata={"format": "pt"})
    cfg = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": alpha, "lora_dropout": 0.0,
           "target_modules": modules, "use_rslora": rslora, "bias": "none", "base_model_name_or_path": None,
           "modules_to_save": None, "fan_in_fan_out": False, "init_lora_weights": True, "inference_mode": True}
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(cfg, f, indent=2)


def reference_merge(base_dir, adapter_dir, dtype, device):
    """The base loaded by transformers with W += scale * B @ A applied by hand in fp32."""
    with open(os.path.join(adapter_dir, "adapter_config.json")) as f:
        cfg = json.load(f)
    r, alpha = cfg["r"], cfg["lora_alpha"]
    scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    ad = load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))
    model = Qwen3ForCausalLM.from_pretrained(base_dir, dtype=dtype, attn_implementation="eager").to(device)
    params = dict(model.named_parameters())
    adapted = {}  # name -> |W| + scale * |B| @ |A|: the size of the sum's terms, which bounds its rounding
    with torch.no_grad():
        for key, a in ad.items():
            if not key.endswith(".lora_A.weight"):
                continue
            stem = key[len("base_model.model."):-len(".lora_A.weight")]
            b = ad[key.replace(".lora_A.", ".lora_B.")]
            w = params[stem + ".weight"]
            bf, af = b.float().to(device), a.float().to(device)
            merged = w.float() + scale * (bf @ af)
            adapted[stem + ".weight"] = w.float().abs() + scale * (bf.abs() @ af.abs())
            w.copy_(merged.to(w.dtype))
    return model, adapted, scale


def compare(base_dir, adapter_dir, merged_dir, dtype, device, tag, problems):
    ref, adapted, scale = reference_merge(base_dir, adapter_dir, dtype, device)
    got, info = Qwen3ForCausalLM.from_pretrained(merged_dir, dtype=dtype, attn_implementation="eager",
                                                 output_loading_info=True)
    got = got.to(device)
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        if info.get(kind):
            problems.append(f"{tag}: {kind}: {info[kind]}")
    stored = {}
    for f in sorted(os.listdir(merged_dir)):
        if f.endswith(".safetensors"):
            stored.update(load_file(os.path.join(merged_dir, f)))
    want_dtype = {torch.float32: torch.float32, torch.bfloat16: torch.bfloat16}[dtype]
    for name, t in stored.items():
        if t.dtype != want_dtype:
            problems.append(f"{tag}: {name} stored as {t.dtype}, the base is {want_dtype}")
    rs, gs = ref.state_dict(), got.state_dict()
    worst = 0.0
    for name, w in rs.items():
        g = gs[name]
        if name in adapted:
            diff = (g.float() - w.float()).abs()
            # fp32: the sum's rounding, which scales with its terms (W and scale*B@A may cancel);
            # bf16: one rounding step of the result.
            tol = (1e-6 * (adapted[name] + 1e-6) if dtype == torch.float32
                   else 2.0 ** -8 * (w.float().abs() + 1e-3))
            worst = max(worst, (diff / (w.float().abs() + 1e-3)).max().item())
            if (diff > tol).any():
                problems.append(f"{tag}: {name}: merged differs from W + scale*B@A (max abs {diff.max().item():.3g})")
        elif not torch.equal(g, w):
            problems.append(f"{tag}: {name} (not adapted) differs from the base")
    ids = torch.tensor([[1, 17, 300, 42, 99, 7, 256, 511, 3, 64, 128, 5]], device=device)
    with torch.no_grad():
        lr = ref.float()(ids).logits
        lg = got.float()(ids).logits
    rel = ((lg - lr).norm() / lr.norm()).item()
    ltol = 1e-5 if dtype == torch.float32 else 1e-3
    if not rel <= ltol:
        problems.append(f"{tag}: logits differ from the reference merge (rel L2 {rel:.3g} > {ltol})")
    try:
        from peft import PeftModel  # optional: PEFT's own merge as a second reference
        # PEFT merges in the base's dtype, as a user's merge_and_unload does. In bf16 it adds a
        # bf16-rounded B@A to the bf16 weight (two roundings where lcx rounds W + scale*B@A once), so
        # there its logits sit a rounding step's worth away: 5e-3, against one rounding's 2^-8.
        base = Qwen3ForCausalLM.from_pretrained(base_dir, dtype=dtype, attn_implementation="eager").to(device)
        pm = PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()
        with torch.no_grad():
            lp = pm.float()(ids).logits
        prel = ((lg - lp).norm() / lp.norm()).item()
        if not prel <= (ltol if dtype == torch.float32 else 5e-3):
            problems.append(f"{tag}: logits differ from PEFT's merge_and_unload (rel L2 {prel:.3g})")
        peft_note = f", vs PEFT {prel:.2e}"
    except ImportError:
        peft_note = ", PEFT not installed"
    print(f"{tag}: {len(adapted)} matrices, scale {scale:g}, worst weight rel {worst:.2e}, "
          f"logits rel L2 {rel:.2e}{peft_note}")


def run_merge(lcx, base, adapter, out, problems, tag):
    shutil.rmtree(out, ignore_errors=True)
    p = subprocess.run([lcx, "merge", "--base", base, "--adapter", adapter, "--out", out],
                       capture_output=True, text=True)
    if p.returncode != 0:
        problems.append(f"{tag}: lcx-train merge exited {p.returncode}: {p.stderr.strip()}")
        return False
    if "merge: layer 0" not in p.stderr:
        problems.append(f"{tag}: no progress line in lcx-train merge's output: {p.stderr.strip()}")
    return True


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lcx-train", default="build/bin/lcx-train")
    ap.add_argument("--work", default="/tmp/lcx-peft-check")
    ap.add_argument("--base", help="a real base folder (with --adapter) instead of the random fixtures")
    ap.add_argument("--adapter")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    problems = []
    os.makedirs(args.work, exist_ok=True)
    if args.base:
        out = os.path.join(args.work, "merged")
        if run_merge(args.lcx_train, args.base, args.adapter, out, problems, "given"):
            with open(os.path.join(args.base, "config.json")) as f:
                d = json.load(f).get("dtype") or "float32"
            dtype = torch.bfloat16 if "bfloat16" in str(d) else torch.float32
            compare(args.base, args.adapter, out, dtype, args.device, "given", problems)
    else:
        cases = [("fp32", torch.float32, 8, 16, False, MODULES),
                 ("fp32-rslora", torch.float32, 16, 8, True, ["q_proj", "v_proj", "down_proj"]),
                 ("bf16", torch.bfloat16, 8, 16, False, MODULES)]
        for i, (tag, dtype, r, alpha, rslora, modules) in enumerate(cases):
            base = os.path.join(args.work, tag, "base")
            adapter = os.path.join(args.work, tag, "adapter")
            out = os.path.join(args.work, tag, "merged")
            shutil.rmtree(os.path.join(args.work, tag), ignore_errors=True)
            config = tiny_base(base, dtype, seed=10 + i)
            random_adapter(adapter, config, r, alpha, rslora, modules, seed=20 + i)
            if run_merge(args.lcx_train, base, adapter, out, problems, tag):
                compare(base, adapter, out, dtype, args.device, tag, problems)
    for p in problems:
        print("PROBLEM:", p)
    print("PASS" if not problems else "FAIL")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
