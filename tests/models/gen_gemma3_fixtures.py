#!/usr/bin/env python3
"""Parity fixtures from transformers for Gemma 3's language model on models/common.

Each fixture: a Gemma 3 model with random weights saved as a Hugging Face folder, reloaded in fp32 on
the CPU with eager attention, fixed token ids with labels (a few -100) run through it in training
mode, and recorded in expected.safetensors: input_ids, labels, the loss (transformers' mean over
shifted valid labels, fp64), a slice of the logits and the gradient of every parameter (fp32). The
windows are small (8 or 16 of 64 tokens) so sliding layers differ from full ones, and layer_types mix
both. Token id 0 (Gemma's pad_token_id, whose embedding row nn.Embedding leaves without gradient) is
kept out of the inputs.

  gemma3_text_f32   gemma3_text, fp32 on disk, hidden 48 (sqrt(48) is not a round scale), head_dim 16
                    (heads x head_dim != hidden), query_pre_attn_scalar 24 (not head_dim), GQA 4/2,
                    full layers with rope_theta 1e6 and linear scaling 8 beside sliding ones at 1e4.
  gemma3_text_bf16  gemma3_text, bf16 on disk, in transformers 4's config form (rope_theta,
                    rope_local_base_freq, rope_scaling, sliding_window_pattern and no layer_types), as
                    the Hub's Gemma 3 checkpoints are written; MQA, window 16.
  gemma3_mm         model_type gemma3 (Gemma3ForConditionalGeneration) with a tiny SigLIP tower: the
                    language model inside, run on text alone; gradients recorded under the text
                    model's names (model.layers..., model.embed_tokens...), the tower's are zero.
  gemma3_packed     masked_packed's kind: one sequence of three documents with restarting positions
                    and labels -100 outside a few spans, checked against each document run alone,
                    recorded in expected_masked.safetensors with position ids, bounds and valid count.

Needs torch and transformers 5.x (written against 5.17). Runs on a CPU in seconds:
    python3 tests/models/gen_gemma3_fixtures.py --out tests/models/fixtures/gemma3
"""
import argparse
import json
import os
import shutil
import sys
import traceback

import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import Gemma3Config, Gemma3ForCausalLM, Gemma3ForConditionalGeneration, Gemma3TextConfig

VOCAB = 256
TOKENS = 64
LOGIT_COLUMNS = 32
IGNORED = (0, 5, 17, 40)  # label positions set to -100

S, F = "sliding_attention", "full_attention"

MODELS = [
    dict(name="gemma3_text_f32", hidden=48, intermediate=80, heads=4, kv=2, head_dim=16, scalar=24, window=8,
         layer_types=[S, F, S, S], rope={S: {"rope_type": "default", "rope_theta": 10000.0},
                                         F: {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0}},
         dtype=torch.float32),
    dict(name="gemma3_text_bf16", hidden=64, intermediate=96, heads=4, kv=1, head_dim=16, scalar=16, window=16,
         layer_types=[S, F, S, F], pattern=2, transformers4=True,
         rope={S: {"rope_type": "default", "rope_theta": 10000.0},
               F: {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0}},
         dtype=torch.bfloat16),
]


def text_config(spec, positions=256):
    return Gemma3TextConfig(vocab_size=spec.get("vocab", VOCAB), hidden_size=spec["hidden"],
                            intermediate_size=spec["intermediate"], num_hidden_layers=len(spec["layer_types"]),
                            num_attention_heads=spec["heads"], num_key_value_heads=spec["kv"],
                            head_dim=spec["head_dim"], query_pre_attn_scalar=spec["scalar"],
                            sliding_window=spec["window"], layer_types=list(spec["layer_types"]),
                            rope_parameters={k: dict(v) for k, v in spec["rope"].items()},
                            max_position_embeddings=positions, rms_norm_eps=1e-6, tie_word_embeddings=True,
                            hidden_activation="gelu_pytorch_tanh", attn_logit_softcapping=None,
                            final_logit_softcapping=None)


def randomize(model):
    # Larger than transformers' 0.02 so attention is far from uniform; Gemma's norms scale by (1 + w)
    # with w stored around 0, so w is drawn around 0 with a spread that makes each norm matter.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
            elif p.dim() == 1:
                p.copy_(0.3 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))


def to_transformers4(folder, spec):
    # The same model as transformers 4 wrote it (the Hub's gemma-3 config.json files): the full
    # layers' theta in rope_theta with their scaling in rope_scaling, the sliding layers' theta in
    # rope_local_base_freq, and the layer types from sliding_window_pattern.
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg.pop("rope_parameters", None)
    cfg.pop("layer_types", None)
    full = spec["rope"][F]
    cfg["rope_theta"] = full["rope_theta"]
    cfg["rope_local_base_freq"] = spec["rope"][S]["rope_theta"]
    scaling = {k: v for k, v in full.items() if k != "rope_theta"}
    cfg["rope_scaling"] = scaling if scaling.get("rope_type") != "default" else None
    cfg["sliding_window_pattern"] = spec["pattern"]
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2)


def check_config(cfg, spec):
    assert list(cfg.layer_types) == list(spec["layer_types"]), cfg.layer_types
    for layer_type, rope in spec["rope"].items():
        got = cfg.rope_parameters[layer_type]
        for key, value in rope.items():
            assert got.get(key) == value, (layer_type, key, got)
    assert cfg.sliding_window == spec["window"], cfg.sliding_window
    assert cfg.query_pre_attn_scalar == spec["scalar"], cfg.query_pre_attn_scalar


def write_record(folder, record, name):
    save_file(record, os.path.join(folder, name),
              metadata={"transformers": transformers.__version__, "torch": torch.__version__})
    files = sorted(os.listdir(folder))
    return files, sum(os.path.getsize(os.path.join(folder, f)) for f in files)


def saved_keys(folder):
    keys = []
    for f in sorted(os.listdir(folder)):
        if f.endswith(".safetensors") and not f.startswith("expected"):
            with safe_open(os.path.join(folder, f), "pt") as st:
                keys += list(st.keys())
    return keys


def inputs(seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (1, TOKENS), generator=g)
    labels = ids.clone()
    labels[0, list(IGNORED)] = -100
    return ids, labels


def base_record(ids, labels, out):
    return {
        "input_ids": ids[0].clone(),
        "labels": labels[0].clone(),
        "loss": out.loss.detach().double().reshape(1),
        "logits": out.logits[0, :, :LOGIT_COLUMNS].detach().float().contiguous(),
    }


def generate(spec, index, out_dir):
    folder = os.path.join(out_dir, spec["name"])
    shutil.rmtree(folder, ignore_errors=True)
    torch.manual_seed(5000 + index)
    model = Gemma3ForCausalLM(text_config(spec)).to(torch.float32)
    randomize(model)
    model.to(spec["dtype"]).save_pretrained(folder)
    if spec.get("transformers4"):
        to_transformers4(folder, spec)
    ref = Gemma3ForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    check_config(ref.config, spec)
    ref.train()
    ids, labels = inputs(191 + index)
    out = ref(input_ids=ids, labels=labels, use_cache=False)
    out.loss.backward()
    record = base_record(ids, labels, out)
    names = []
    for name, p in ref.named_parameters():
        record["grad." + name] = p.grad.detach().float().contiguous()
        names.append(name)
    files, size = write_record(folder, record, "expected.safetensors")
    print(f"{spec['name']}: layer_types {ref.config.layer_types}, rope {ref.config.rope_parameters}, "
          f"loss {out.loss.item():.6f}, {len(names)} parameters, files {files}, {size} bytes")
    print(f"{spec['name']}: saved keys {saved_keys(folder)}")
    return size


MM = dict(name="gemma3_mm", hidden=48, intermediate=64, heads=2, kv=1, head_dim=32, scalar=32, window=8,
          layer_types=[S, F], rope={S: {"rope_type": "default", "rope_theta": 10000.0},
                                    F: {"rope_type": "default", "rope_theta": 1000000.0}})


def generate_mm(out_dir):
    spec = MM
    folder = os.path.join(out_dir, spec["name"])
    shutil.rmtree(folder, ignore_errors=True)
    vision = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    cfg = Gemma3Config(text_config=text_config(spec), vision_config=vision, mm_tokens_per_image=4, tie_word_embeddings=True)
    torch.manual_seed(6100)
    model = Gemma3ForConditionalGeneration(cfg).to(torch.float32)
    randomize(model)
    model.save_pretrained(folder)
    ref = Gemma3ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    check_config(ref.config.text_config, spec)
    ref.train()
    ids, labels = inputs(4711)
    # Text alone: token types all 0 (training mode asks for them), no pixel values.
    out = ref(input_ids=ids, labels=labels, token_type_ids=torch.zeros_like(ids), use_cache=False)
    out.loss.backward()
    record = base_record(ids, labels, out)
    lm = ref.model.language_model
    names = []
    for name, p in lm.named_parameters():
        record["grad.model." + name] = p.grad.detach().float().contiguous()
        names.append(name)
    lm_params = {id(p) for p in lm.parameters()}
    for name, p in ref.named_parameters():
        if id(p) in lm_params:
            continue
        if name == "lm_head.weight":  # tied to the embedding: its gradient is already recorded
            continue
        assert p.grad is None or float(p.grad.abs().max()) == 0.0, f"{name} has a gradient from text alone"
    files, size = write_record(folder, record, "expected.safetensors")
    print(f"gemma3_mm: model_type {ref.config.model_type}, loss {out.loss.item():.6f}, {len(names)} language-model "
          f"parameters, files {files}, {size} bytes")
    print(f"gemma3_mm: saved keys {saved_keys(folder)}")
    return size


# Heads 4 / kv 2 split over sp 2, 72 tokens over 2 x cp x sp = 8; documents of 29, 26 and 17 tokens,
# each longer than the window of 8, so the window bites inside every document.
PACKED = dict(name="gemma3_packed", vocab=331, hidden=48, intermediate=56, heads=4, kv=2, head_dim=16, scalar=16,
              window=8, layer_types=[S, F, S],
              rope={S: {"rope_type": "default", "rope_theta": 10000.0},
                    F: {"rope_type": "default", "rope_theta": 1000000.0}})
PACKED_BOUNDS = (0, 29, 55, 72)
PACKED_SPANS = ((9, 18), (24, 29), (36, 47), (56, 61), (66, 72))


def explicit_masks(bounds, tokens, window):
    # The masks transformers builds for packed documents, written out: causal within each document,
    # the sliding layers' also within the window (a query at p sees keys p - W + 1 .. p).
    doc = torch.zeros(tokens, dtype=torch.long)
    for i, (b, e) in enumerate(zip(bounds, bounds[1:])):
        doc[b:e] = i
    q = torch.arange(tokens)[:, None]
    k = torch.arange(tokens)[None, :]
    full = (k <= q) & (doc[:, None] == doc[None, :])
    sliding = full & (k > q - window)
    to_additive = lambda allowed: torch.where(allowed, 0.0, torch.finfo(torch.float32).min)[None, None]
    return {F: to_additive(full), S: to_additive(sliding)}


def relative_l2(got, want):
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def generate_packed(out_dir):
    spec = PACKED
    folder = os.path.join(out_dir, spec["name"])
    shutil.rmtree(folder, ignore_errors=True)
    tokens = PACKED_BOUNDS[-1]
    torch.manual_seed(2026)
    model = Gemma3ForCausalLM(text_config(spec, positions=128)).to(torch.float32)
    randomize(model)
    model.save_pretrained(folder)  # fp32 on disk
    ref = Gemma3ForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    check_config(ref.config, spec)
    ref.train()
    eos = spec["vocab"] - 1
    g = torch.Generator().manual_seed(4344)
    ids = torch.randint(1, eos, (1, tokens), generator=g)
    for end in PACKED_BOUNDS[1:]:
        ids[0, end - 1] = eos
    labels = torch.full_like(ids, -100)
    for begin, end in PACKED_SPANS:
        labels[0, begin:end] = ids[0, begin:end]
    positions = torch.cat([torch.arange(e - b) for b, e in zip(PACKED_BOUNDS, PACKED_BOUNDS[1:])]).unsqueeze(0)
    valid = int((labels[0, 1:] != -100).sum())
    alone = torch.zeros((), dtype=torch.float64)
    for b, e in zip(PACKED_BOUNDS, PACKED_BOUNDS[1:]):
        n = int((labels[0, b + 1:e] != -100).sum())
        if n == 0:
            continue
        doc = ref(input_ids=ids[:, b:e], labels=labels[:, b:e], use_cache=False)
        (doc.loss * (n / valid)).backward()
        alone += doc.loss.detach().double() * n
    alone /= valid
    alone_grads = {n: p.grad.detach().clone() for n, p in ref.named_parameters()}
    # transformers' own packed-sequence masks from the restarting position ids first; the same masks
    # written out (a dict by layer type, as Gemma3TextModel takes them) where those fall short.
    out = None
    for how, masks in (("position_ids", None), ("explicit masks", explicit_masks(PACKED_BOUNDS, tokens, spec["window"]))):
        ref.zero_grad()
        kwargs = {"attention_mask": masks} if masks is not None else {}
        run = ref(input_ids=ids, labels=labels, position_ids=positions, use_cache=False, **kwargs)
        run.loss.backward()
        packed_grads = {n: p.grad.detach().clone() for n, p in ref.named_parameters()}
        loss_gap = abs(alone.item() - run.loss.item()) / abs(alone.item())
        grad_gap = max(relative_l2(packed_grads[n], alone_grads[n]) for n in alone_grads)
        print(f"gemma3_packed ({how}): packed against documents alone: loss rel {loss_gap:.2e}, "
              f"worst gradient rel L2 {grad_gap:.2e}")
        if loss_gap <= 1e-5 and grad_gap <= 1e-4:
            out = run
            break
    if out is None:
        raise RuntimeError("gemma3_packed: the packed run attends across documents; not written")
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
    print(f"gemma3_packed: loss {out.loss.item():.6f} over {valid} valid labels, {len(packed_grads)} parameters, "
          f"files {files}, {size} bytes")
    return size


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder to write the model folders into")
    names = [m["name"] for m in MODELS] + [MM["name"], PACKED["name"]]
    ap.add_argument("--only", choices=names, action="append", help="write only these fixtures (repeatable)")
    args = ap.parse_args()
    only = set(args.only or names)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    torch.use_deterministic_algorithms(True)
    os.makedirs(args.out, exist_ok=True)
    sizes, failed = {}, []
    jobs = [(m["name"], lambda m=m, i=i: generate(m, i, args.out)) for i, m in enumerate(MODELS)]
    jobs.append((MM["name"], lambda: generate_mm(args.out)))
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
