#!/usr/bin/env python3
"""Checks that a Gemma 3 folder written by lcx loads in transformers with the same weights and loss.

The folder (tests/models/fixtures/gemma3_export, written by the lcx_gemma3_export tool) holds
config.json, safetensors and expected.json (token ids, labels, the loss lcx computed). This loads it
with AutoModelForCausalLM (Gemma3ForCausalLM) in fp32 with eager attention, and fails unless: the
class is Gemma3ForCausalLM; no key is missing, unexpected or mismatched; every weight equals the
stored tensor bit for bit (the tied head included); the config reads back lcx's layer types, window,
query_pre_attn_scalar and both layer kinds' rope parameters; and the loss equals lcx's to 1e-5
relative. It writes what transformers computed to --out.

    python3 tests/models/check_gemma3_export.py --export tests/models/fixtures/gemma3_export --out check.json
"""
import argparse
import glob
import json
import os
import sys

import torch
import transformers
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--export", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    problems = []
    with open(os.path.join(args.export, "config.json")) as f:
        cfg_json = json.load(f)
    with open(os.path.join(args.export, "expected.json")) as f:
        expected = json.load(f)

    model, info = AutoModelForCausalLM.from_pretrained(args.export, dtype=torch.float32, attn_implementation="eager",
                                                       output_loading_info=True)
    if type(model).__name__ != "Gemma3ForCausalLM":
        problems.append(f"loaded as {type(model).__name__}")
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        if info.get(kind):
            problems.append(f"{kind}: {info[kind]}")

    stored = {}
    for path in sorted(glob.glob(os.path.join(args.export, "*.safetensors"))):
        stored.update(load_file(path))
    compared = 0
    for name, tensor in model.state_dict().items():
        source = "model.embed_tokens.weight" if name == "lm_head.weight" and model.config.tie_word_embeddings else name
        if source not in stored:
            problems.append(f"{name}: not in the safetensors files")
            continue
        if not torch.equal(tensor.float(), stored[source].float()):
            diff = (tensor.float() - stored[source].float()).abs().max().item()
            problems.append(f"{name}: differs from the file (max abs {diff})")
        compared += 1

    c = model.config
    if list(c.layer_types) != cfg_json["layer_types"]:
        problems.append(f"layer_types read as {c.layer_types}, written {cfg_json['layer_types']}")
    if c.sliding_window != cfg_json["sliding_window"]:
        problems.append(f"sliding_window read as {c.sliding_window}, written {cfg_json['sliding_window']}")
    if c.query_pre_attn_scalar != cfg_json["query_pre_attn_scalar"]:
        problems.append(f"query_pre_attn_scalar read as {c.query_pre_attn_scalar}")
    for kind, written in cfg_json["rope_parameters"].items():
        got = c.rope_parameters[kind]
        for key, value in written.items():
            if got.get(key) != value:
                problems.append(f"rope_parameters.{kind}.{key} read as {got.get(key)}, written {value}")

    ids = torch.tensor([expected["input_ids"]])
    labels = torch.tensor([expected["labels"]])
    with torch.no_grad():
        out = model(input_ids=ids, labels=labels)
    hf_loss = out.loss.item()
    rel = abs(hf_loss - expected["loss"]) / abs(hf_loss)
    if rel > 1e-5:
        problems.append(f"loss: transformers {hf_loss:.8f}, lcx {expected['loss']:.8f} (rel {rel:.2e})")

    result = {"transformers": transformers.__version__, "torch": torch.__version__, "loss": hf_loss,
              "lcx_loss": expected["loss"], "relative_difference": rel, "weights_compared": compared,
              "problems": problems}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))
    if problems:
        sys.exit("export check FAILED")
    print("export check OK")


if __name__ == "__main__":
    main()
