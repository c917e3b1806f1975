#!/usr/bin/env python3
"""GPT-OSS fixtures from transformers: small random gpt_oss models and what GptOssForCausalLM computes.

Each model below is built with random weights (attention biases on q, k, v and o, sinks, the router's
bias, the experts' biases all away from zero; swiglu_limit small enough that the clamps bite), saved
by save_pretrained, reloaded in fp32 on the CPU with eager attention and run on fixed token ids with
labels (a few -100). Layers alternate sliding_attention (window 8 over 64 tokens) and
full_attention, the rotary is YaRN (truncate false, so the ramp's ends are not rounded).
expected.safetensors records: input_ids, labels, the loss transformers reports (the LM loss plus
router_aux_loss_coef times the load-balancing loss where the config sets output_router_logits),
the LM and auxiliary losses apart, each layer's router logits, a slice of the logits and the gradient
of every parameter under its checkpoint name (GPT-OSS stores the experts fused:
gate_up_proj [E, H, 2I] with gate and up interleaved along the last axis, down_proj [E, I, H]).

Fixtures:
  gpt_oss_basic   2 layers (sliding, full), top-2 of 5 experts, fp32 on disk.
  gpt_oss_aux     3 layers (sliding, sliding, full), top-3 of 6, output_router_logits (aux trained),
                  bf16 on disk.
  gpt_oss_packed  three documents packed with restarting position ids, labels -100 outside spans;
                  checked against each document run alone before it is written.
  gpt_oss_lora    PEFT LoRA over gpt_oss_basic (target_modules q/k/v/o_proj, target_parameters the
                  experts' gate_up_proj and down_proj): adapter_model.safetensors and
                  adapter_config.json as PEFT saves them, the loss and each LoRA factor's gradient
                  under the adapter's key names.
  gpt_oss_mxfp4   a checkpoint with the experts in MXFP4 (*_blocks uint8, *_scales uint8 e8m0 and
                  quantization_config mxfp4, as the Hub's gpt-oss checkpoints) and what the model
                  dequantized by transformers' convert_moe_packed_tensors computes.
  mxfp4_tensor    blocks, scales and convert_moe_packed_tensors' bf16 output for a hand-made tensor.

A reference of the sparse MLP written here from the formulas (router top-k then softmax over the k,
interleaved gate/up, the clamped SwiGLU) is checked against transformers' module for layer 0 of each
model, so a difference between this description and transformers stops the generator.

Needs torch, transformers 5.x (written against 5.17) and peft (for gpt_oss_lora). Seconds on a CPU:
    python3 tests/models/gen_gpt_oss_fixtures.py --out tests/models/fixtures/gpt_oss
"""
import argparse
import glob
import json
import os
import shutil
import sys
import traceback

import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import GptOssConfig, GptOssForCausalLM

TOKENS = 64
LOGIT_COLUMNS = 24
IGNORED = (0, 5, 17, 40)
PACKED_BOUNDS = (0, 29, 55, 72)
PACKED_SPANS = ((9, 18), (24, 29), (36, 47), (56, 61), (66, 72))
WINDOW = 8
ALPHA = 1.702
# YaRN as gpt-oss configures it (truncate false), at a small scale: 64 positions over 16 trained.
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 8.0, "beta_slow": 0.5,
        "truncate": False, "original_max_position_embeddings": 16}

MODELS = {
    "gpt_oss_basic": dict(vocab=256, hidden=64, intermediate=32, layers=2, heads=4, kv=2, head_dim=16, experts=5,
                          top_k=2, limit=1.25, router_logits=False, coef=0.01, dtype=torch.float32,
                          layer_types=["sliding_attention", "full_attention"]),
    "gpt_oss_aux": dict(vocab=293, hidden=48, intermediate=40, layers=3, heads=6, kv=2, head_dim=8, experts=6,
                        top_k=3, limit=1.0, router_logits=True, coef=0.05, dtype=torch.bfloat16,
                        layer_types=["sliding_attention", "sliding_attention", "full_attention"]),
    # 6 query and 2 kv heads split over sp 2, 72 tokens over 2 x cp x sp = 8.
    "gpt_oss_packed": dict(vocab=331, hidden=48, intermediate=24, layers=2, heads=6, kv=2, head_dim=8, experts=4,
                           top_k=2, limit=1.25, router_logits=False, coef=0.01, dtype=torch.float32,
                           layer_types=["sliding_attention", "full_attention"]),
    # MXFP4 needs H and I in whole blocks of 32.
    "gpt_oss_mxfp4": dict(vocab=256, hidden=64, intermediate=32, layers=2, heads=4, kv=2, head_dim=16, experts=3,
                          top_k=2, limit=1.25, router_logits=False, coef=0.01, dtype=torch.float32,
                          layer_types=["sliding_attention", "full_attention"]),
}

FP4 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def make_config(spec):
    kw = dict(vocab_size=spec["vocab"], hidden_size=spec["hidden"], intermediate_size=spec["intermediate"],
              num_hidden_layers=spec["layers"], num_attention_heads=spec["heads"], num_key_value_heads=spec["kv"],
              head_dim=spec["head_dim"], num_local_experts=spec["experts"], num_experts_per_tok=spec["top_k"],
              sliding_window=WINDOW, layer_types=list(spec["layer_types"]), rope_parameters=dict(YARN),
              max_position_embeddings=int(YARN["factor"] * YARN["original_max_position_embeddings"]),
              rms_norm_eps=1e-5, tie_word_embeddings=False, router_aux_loss_coef=spec["coef"],
              output_router_logits=spec["router_logits"], attention_bias=True)
    try:
        cfg = GptOssConfig(**kw, swiglu_limit=spec["limit"], swiglu_alpha=ALPHA)
    except TypeError:  # a GptOssConfig without the swiglu fields: they ride along as attributes
        cfg = GptOssConfig(**kw)
        cfg.swiglu_limit = spec["limit"]
        cfg.swiglu_alpha = ALPHA
    return cfg


def force_swiglu(model, spec):
    # Whatever the experts module reads (the config, or constants), it computes with config.json's values.
    n = 0
    for m in model.modules():
        if type(m).__name__ == "GptOssExperts":
            m.limit = spec["limit"]
            m.alpha = ALPHA
            n += 1
    assert n == spec["layers"], n


def randomize(model):
    # Larger than transformers' 0.02 so attention and routing are far from uniform; biases and sinks
    # away from 0; norm weights away from 1.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.copy_(torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            elif p.dim() == 1:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))


def reference_mlp(mlp, x, spec):
    """The sparse MLP from its formulas: router logits with bias, top-k, softmax over the k chosen,
    gate/up interleaved, gate clamped above, up clamped both sides, (up + 1) * gate * sigmoid(alpha gate)."""
    e = mlp.experts
    logits = x @ mlp.router.weight.t() + mlp.router.bias
    top, idx = torch.topk(logits, spec["top_k"], dim=-1)
    w = torch.softmax(top, dim=-1)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(spec["top_k"]):
            k = int(idx[t, j])
            gu = x[t] @ e.gate_up_proj[k] + e.gate_up_proj_bias[k]
            gate, up = gu[::2].clamp(max=spec["limit"]), gu[1::2].clamp(-spec["limit"], spec["limit"])
            h = (up + 1) * (gate * torch.sigmoid(ALPHA * gate))
            out[t] += w[t, j] * (h @ e.down_proj[k] + e.down_proj_bias[k])
    return out, logits


def check_mlp(model, spec):
    mlp = model.model.layers[0].mlp
    g = torch.Generator().manual_seed(5)
    x = torch.randn(1, 16, spec["hidden"], generator=g)
    with torch.no_grad():
        got = mlp(x)[0].reshape(16, -1)
        want, logits = reference_mlp(mlp, x[0], spec)
        gate = torch.cat([x[0] @ mlp.experts.gate_up_proj[k] + mlp.experts.gate_up_proj_bias[k]
                          for k in range(spec["experts"])])
    clamped = float((gate.abs() > spec["limit"]).float().mean())
    gap = ((got - want).norm() / want.norm()).item()
    print(f"  layer 0 MLP against the formulas: rel L2 {gap:.2e}; {100 * clamped:.0f}% of gate/up values past the limit")
    assert gap < 1e-5, f"transformers' GptOssMLP differs from the formulas (rel L2 {gap})"
    assert clamped > 0.05, "swiglu_limit does not bite; lower it"


def stored_tensors(folder):
    out = {}
    for path in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        if not os.path.basename(path).startswith(("expected", "adapter")):
            out.update(load_file(path))
    return out


def write(folder, record, name="expected.safetensors"):
    save_file(record, os.path.join(folder, name),
              metadata={"transformers": transformers.__version__, "torch": torch.__version__})
    files = sorted(os.listdir(folder))
    return files, sum(os.path.getsize(os.path.join(folder, f)) for f in files)


def tokens_for(spec, packed, seed):
    g = torch.Generator().manual_seed(seed)
    vocab = spec["vocab"]
    if not packed:
        ids = torch.randint(0, vocab, (1, TOKENS), generator=g)
        labels = ids.clone()
        labels[0, list(IGNORED)] = -100
        return ids, labels, None
    eos = vocab - 1
    T = PACKED_BOUNDS[-1]
    ids = torch.randint(0, eos, (1, T), generator=g)
    for end in PACKED_BOUNDS[1:]:
        ids[0, end - 1] = eos
    labels = torch.full_like(ids, -100)
    for b, e in PACKED_SPANS:
        labels[0, b:e] = ids[0, b:e]
    positions = torch.cat([torch.arange(e - b) for b, e in zip(PACKED_BOUNDS, PACKED_BOUNDS[1:])]).unsqueeze(0)
    return ids, labels, positions


def lm_loss(logits, labels):
    shift = labels[0, 1:]
    valid = shift != -100
    return torch.nn.functional.cross_entropy(logits[0, :-1][valid].float(), shift[valid], reduction="mean")


def packed_masks(T):
    """Each layer type's additive mask for the packed documents: a query sees its own document's keys
    up to itself, and on sliding_attention layers only the WINDOW nearest (itself included), as
    transformers' sliding_window_causal mask has it. Handed over explicitly, so the packing does not
    rest on transformers detecting documents from position ids; the documents-alone check below
    holds both to transformers' own masks."""
    doc = torch.zeros(T, dtype=torch.int64)
    for i, (b, e) in enumerate(zip(PACKED_BOUNDS, PACKED_BOUNDS[1:])):
        doc[b:e] = i
    q = torch.arange(T).unsqueeze(1)
    k = torch.arange(T).unsqueeze(0)
    full = (k <= q) & (doc.unsqueeze(1) == doc.unsqueeze(0))
    sliding = full & (q - k < WINDOW)
    neg = torch.finfo(torch.float32).min

    def additive(allowed):
        return torch.zeros(T, T).masked_fill(~allowed, neg).reshape(1, 1, T, T)

    return {"full_attention": additive(full), "sliding_attention": additive(sliding)}


def run(ref, spec, ids, labels, positions):
    """The trained loss as transformers reports it, the LM loss, the auxiliary loss and the outputs."""
    kwargs = {"use_cache": False}
    if positions is not None:
        # transformers' load-balancing loss cannot take the masks' dict: the packed fixture trains
        # the LM loss alone and records no auxiliary loss.
        assert not spec["router_logits"]
        out = ref(input_ids=ids, labels=labels, position_ids=positions, attention_mask=packed_masks(ids.shape[1]),
                  use_cache=False)
        lm = lm_loss(out.logits, labels)
        assert abs(lm.item() - out.loss.item()) < 1e-6 * abs(lm.item()), (lm.item(), out.loss.item())
        return out.loss, lm, None, out
    out = ref(input_ids=ids, labels=labels, output_router_logits=True, **kwargs)
    lm = lm_loss(out.logits, labels)
    aux = out.aux_loss.detach().double()
    want = lm.detach().double() + spec["coef"] * aux
    assert abs(want.item() - out.loss.item()) < 1e-5 * abs(want.item()), (want.item(), out.loss.item())
    # Asked for, transformers adds the auxiliary loss; where the config leaves it out, the LM loss
    # alone is what trains.
    loss = out.loss if spec["router_logits"] else lm
    return loss, lm, aux, out


def base_record(ids, labels, positions, loss, lm, aux, out, spec):
    T = ids.shape[1]
    rec = {
        "input_ids": ids[0].clone(),
        "labels": labels[0].clone(),
        "loss": loss.detach().double().reshape(1),
        "lm_loss": lm.detach().double().reshape(1),
        "logits": out.logits[0, :, :LOGIT_COLUMNS].detach().float().contiguous(),
    }
    if positions is not None:
        rec["position_ids"] = positions[0].clone()
        rec["document_bounds"] = torch.tensor(PACKED_BOUNDS, dtype=torch.int64)
        rec["valid"] = torch.tensor([int((labels[0, 1:] != -100).sum())], dtype=torch.int64)
        return rec
    rec["aux_loss"] = aux.reshape(1)
    assert len(out.router_logits) == spec["layers"], len(out.router_logits)
    for l, rl in enumerate(out.router_logits):
        rec[f"router_logits.{l}"] = rl.detach().float().reshape(T, spec["experts"]).contiguous()
    return rec


def load_ref(folder, spec, **kw):
    ref = GptOssForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager", **kw)
    force_swiglu(ref, spec)
    ref.train()
    return ref


def relative_l2(got, want):
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def generate(name, index, out_dir):
    spec = MODELS[name]
    packed = name == "gpt_oss_packed"
    folder = os.path.join(out_dir, name)
    shutil.rmtree(folder, ignore_errors=True)
    torch.manual_seed(3100 + index)
    model = GptOssForCausalLM(make_config(spec)).to(torch.float32)
    randomize(model)
    model.to(spec["dtype"]).save_pretrained(folder)
    stored = stored_tensors(folder)
    ref = load_ref(folder, spec)
    check_mlp(ref, spec)
    ids, labels, positions = tokens_for(spec, packed, 91 + index)
    loss, lm, aux, out = run(ref, spec, ids, labels, positions)
    loss.backward()
    rec = base_record(ids, labels, positions, loss, lm, aux, out, spec)
    grads = {n: p.grad.detach().float().contiguous() for n, p in ref.named_parameters()}
    if packed:
        ref.zero_grad()
        valid = int(rec["valid"][0])
        alone = torch.zeros((), dtype=torch.float64)
        for b, e in zip(PACKED_BOUNDS, PACKED_BOUNDS[1:]):
            n = int((labels[0, b + 1:e] != -100).sum())
            if n == 0:
                continue
            doc = ref(input_ids=ids[:, b:e], labels=labels[:, b:e], use_cache=False)
            (doc.loss * (n / valid)).backward()
            alone += doc.loss.detach().double() * n
        alone /= valid
        loss_gap = abs(alone.item() - loss.item()) / abs(alone.item())
        grad_gap = max(relative_l2(grads[n], p.grad) for n, p in ref.named_parameters())
        print(f"  packed against documents alone: loss rel {loss_gap:.2e}, worst gradient rel L2 {grad_gap:.2e}")
        if loss_gap > 1e-5 or grad_gap > 1e-4:
            raise RuntimeError(f"{name}: the packed run attends across documents; not written")
    for n, g in grads.items():
        if n not in stored:
            print(f"  note: parameter {n} is not a key of the saved folder")
        rec["grad." + n] = g
    missing = sorted(set(stored) - set(grads))
    assert not missing, f"no gradient for stored keys {missing}"
    files, size = write(folder, rec)
    impl = getattr(ref.config, "_experts_implementation", None)
    aux_text = "not recorded" if aux is None else f"{aux.item():.6f}"
    print(f"{name}: loss {loss.item():.6f} (lm {lm.item():.6f}, aux {aux_text}), layer types "
          f"{ref.config.layer_types}, rope {ref.config.rope_parameters}, experts implementation {impl}, "
          f"{len(stored)} stored tensors, files {files}, {size} bytes")
    return size


def generate_lora(out_dir):
    from peft import LoraConfig, get_peft_model

    spec = MODELS["gpt_oss_basic"]
    base = os.path.join(out_dir, "gpt_oss_basic")
    assert os.path.exists(os.path.join(base, "config.json")), "gpt_oss_basic must be written first"
    folder = os.path.join(out_dir, "gpt_oss_lora")
    shutil.rmtree(folder, ignore_errors=True)
    ref = load_ref(base, spec)
    cfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                     target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    peft_model = get_peft_model(ref, cfg)
    torch.manual_seed(4242)
    with torch.no_grad():  # B away from zero so the adapters change the loss and A gets a gradient
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.copy_(0.2 * torch.randn_like(p))
            elif "lora_A" in n:
                p.copy_(0.2 * torch.randn_like(p))
    peft_model.train()
    peft_model.save_pretrained(folder)
    saved = load_file(os.path.join(folder, "adapter_model.safetensors"))
    ids, labels, _ = tokens_for(spec, False, 91)
    out = peft_model(input_ids=ids, labels=labels, use_cache=False)
    lm = lm_loss(out.logits, labels)
    lm.backward()
    rec = {
        "input_ids": ids[0].clone(),
        "labels": labels[0].clone(),
        "loss": lm.detach().double().reshape(1),
        "logits": out.logits[0, :, :LOGIT_COLUMNS].detach().float().contiguous(),
    }
    names = []
    for n, p in peft_model.named_parameters():
        if not p.requires_grad:
            continue
        key = n.replace(".default.", ".")
        assert key in saved, f"{n} -> {key} is not a key of adapter_model.safetensors ({sorted(saved)[:6]}...)"
        assert torch.equal(saved[key].float(), p.detach().float()), key
        rec["grad." + key] = p.grad.detach().float().contiguous()
        names.append(key)
    assert sorted(names) == sorted(saved), (sorted(set(saved) - set(names)), sorted(set(names) - set(saved)))
    files, size = write(folder, rec)
    print(f"gpt_oss_lora: loss {lm.item():.6f}; adapter keys with shapes:")
    for k in sorted(saved):
        print(f"    {k} {tuple(saved[k].shape)} {saved[k].dtype}")
    with open(os.path.join(folder, "adapter_config.json")) as f:
        print("  adapter_config.json:", f.read().replace("\n", " "))
    print(f"  files {files}, {size} bytes")
    return size


def convert(blocks, scales):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    return convert_moe_packed_tensors(blocks.clone(), scales.clone(), dtype=torch.bfloat16).cpu()


def own_dequant(blocks, scales):
    # The layout as read from the format (nibble low first, value * 2^(scale - 127), last axis
    # blocks of 32, then the two inner axes swapped), to check transformers' function says the same.
    lut = torch.tensor(FP4, dtype=torch.float32)
    lo = lut[(blocks & 0x0F).long()]
    hi = lut[(blocks >> 4).long()]
    vals = torch.stack([lo, hi], dim=-1).reshape(*blocks.shape[:-1], 32)
    vals = vals * torch.pow(2.0, scales.to(torch.float32) - 127).unsqueeze(-1)
    return vals.reshape(*blocks.shape[:-2], -1).transpose(-1, -2).to(torch.bfloat16)


def random_mxfp4(shape_rows, cols, g, lo=118, hi=124):
    """blocks [*rows, cols/32, 16] and scales [*rows, cols/32] uint8."""
    blocks = torch.randint(0, 256, (*shape_rows, cols // 32, 16), generator=g, dtype=torch.int64).to(torch.uint8)
    scales = torch.randint(lo, hi, (*shape_rows, cols // 32), generator=g, dtype=torch.int64).to(torch.uint8)
    return blocks, scales


def generate_mxfp4_tensor(out_dir):
    folder = os.path.join(out_dir, "mxfp4_tensor")
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    g = torch.Generator().manual_seed(77)
    blocks, scales = random_mxfp4((3, 5), 64, g, 110, 140)
    scales[0, 0, 0] = 0  # 2^-127: subnormal in bf16
    scales[1, 2, 1] = 127  # 2^0
    blocks[2, 4, 1, :] = torch.arange(16, dtype=torch.uint8) * 17  # every code in both nibbles
    got = convert(blocks, scales)
    mine = own_dequant(blocks, scales)
    differ = int((got.float() != mine.float()).sum())
    # transformers' output is what the fixture records either way; a difference is reported so the
    # reading in lcx can be checked against the format as well.
    print(f"mxfp4_tensor: blocks {tuple(blocks.shape)} -> {tuple(got.shape)} {got.dtype}; "
          f"values differing from the format as read here: {differ}")
    files, size = write(folder, {"blocks": blocks, "scales": scales, "dequantized": got.float().contiguous()},
                        "mxfp4.safetensors")
    print(f"  files {files}, {size} bytes")
    return size


def generate_mxfp4_model(index, out_dir):
    name = "gpt_oss_mxfp4"
    spec = MODELS[name]
    folder = os.path.join(out_dir, name)
    shutil.rmtree(folder, ignore_errors=True)
    torch.manual_seed(3100 + index)
    model = GptOssForCausalLM(make_config(spec)).to(torch.float32)
    randomize(model)
    g = torch.Generator().manual_seed(505)
    E, H, I = spec["experts"], spec["hidden"], spec["intermediate"]
    quantized = {}
    with torch.no_grad():
        for l, layer in enumerate(model.model.layers):
            ex = layer.mlp.experts
            # gate_up_proj [E, H, 2I] is stored as blocks over H: [E, 2I, H/32, 16]; down_proj
            # [E, I, H] as blocks over I: [E, H, I/32, 16]. Scales near 2^-6 keep values ~0.1.
            gb, gs = random_mxfp4((E, 2 * I), H, g)
            db, ds = random_mxfp4((E, H), I, g)
            ex.gate_up_proj.copy_(convert(gb, gs).float())
            ex.down_proj.copy_(convert(db, ds).float())
            stem = f"model.layers.{l}.mlp.experts."
            quantized.update({stem + "gate_up_proj_blocks": gb, stem + "gate_up_proj_scales": gs,
                              stem + "down_proj_blocks": db, stem + "down_proj_scales": ds})
    model.save_pretrained(folder)  # fp32, dequantized experts: rewritten below as the Hub stores them
    for path in glob.glob(os.path.join(folder, "*.safetensors")):
        os.remove(path)
    for path in glob.glob(os.path.join(folder, "*.index.json")):
        os.remove(path)
    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()
             if not k.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    state.update(quantized)
    save_file(state, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    cfg_path = os.path.join(folder, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "mxfp4",
                                  "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                             "model.embed_tokens", "lm_head"]}
    cfg["torch_dtype"] = cfg["dtype"] = "bfloat16"
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2)
    # The reference: the same weights as the loader sees them (bf16 on disk, the experts dequantized
    # to bf16 values), computed in fp32.
    with torch.no_grad():
        for k, p in model.named_parameters():
            p.copy_(p.to(torch.bfloat16).float())
    force_swiglu(model, spec)
    try:
        model.set_attn_implementation("eager")
    except AttributeError:
        model.config._attn_implementation = "eager"
    model.train()
    ids, labels, _ = tokens_for(spec, False, 91 + index)
    loss, lm, aux, out = run(model, spec, ids, labels, None)
    loss.backward()
    rec = base_record(ids, labels, None, loss, lm, aux, out, spec)
    for n, p in model.named_parameters():
        rec["grad." + n] = p.grad.detach().float().contiguous()
    files, size = write(folder, rec)
    print(f"{name}: loss {loss.item():.6f}, {len(state)} stored tensors, files {files}, {size} bytes")
    try:  # transformers' own MXFP4 loading, dequantized on the CPU, where this install can
        from transformers import Mxfp4Config
        hf = GptOssForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager",
                                               quantization_config=Mxfp4Config(dequantize=True))
        force_swiglu(hf, spec)
        hf.train()
        with torch.no_grad():
            hf_out = hf(input_ids=ids, labels=labels, use_cache=False)
        print(f"  transformers' mxfp4 loader (dequantize=True): loss {hf_out.loss.item():.6f} "
              f"(rel {abs(hf_out.loss.item() - lm.item()) / lm.item():.2e} to the fixture's)")
    except Exception as e:  # informational only
        print(f"  transformers' mxfp4 loader not run here: {type(e).__name__}: {str(e)[:200]}")
    return size


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    names = list(MODELS) + ["gpt_oss_lora", "mxfp4_tensor"]
    ap.add_argument("--only", choices=names, action="append", help="write only these fixtures (repeatable)")
    args = ap.parse_args()
    only = set(args.only or names)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    try:
        import peft
        print(f"peft {peft.__version__}")
    except ImportError:
        print("peft not installed: gpt_oss_lora will fail")
    torch.use_deterministic_algorithms(True)
    os.makedirs(args.out, exist_ok=True)
    jobs = [(n, lambda n=n, i=i: generate(n, i, args.out)) for i, n in enumerate(MODELS) if n != "gpt_oss_mxfp4"]
    jobs.append(("gpt_oss_lora", lambda: generate_lora(args.out)))
    jobs.append(("mxfp4_tensor", lambda: generate_mxfp4_tensor(args.out)))
    jobs.append(("gpt_oss_mxfp4", lambda: generate_mxfp4_model(3, args.out)))
    sizes, failed = {}, []
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
