#!/usr/bin/env python3
"""Checks that an HF folder written by lcx loads in transformers with the same weights and loss.

The folder (tests/parity/fixtures/lcx_export, written by the lcx_parity_export tool) holds
config.json, safetensors and expected.json (token ids, labels, the loss lcx computed). This loads it
with Qwen3ForCausalLM.from_pretrained in fp32, and fails unless: no key is missing, unexpected or
mismatched; every weight equals the stored tensor bit for bit (the tied head included); the config
carries lcx's rope parameters; and the loss equals lcx's to 1e-5 relative. It writes what
transformers computed to --out (committed beside the folder as transformers_check.json, which the
CTest parity suite compares against lcx on every run).

    python3 tests/parity/check_export.py --export tests/parity/fixtures/lcx_export --out check.json
"""
import argparse
import glob
import json
import os
import sys

import torch
import transformers
from safetensors.torch import load_file
from transformers import Qwen3ForCausalLM


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

    model, info = Qwen3ForCausalLM.from_pretrained(args.export, dtype=torch.float32, attn_implementation="eager",
                                                   output_loading_info=True)
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        if info.get(kind):
            problems.append(f"{kind}: {info[kind]}")

    stored = {}
    for path in sorted(glob.glob(os.path.join(args.export, "*.safetensors"))):
        stored.update(load_file(path))
    state = model.state_dict()
    compared = 0
    for name, tensor in state.items():
        source = "model.embed_tokens.weight" if name == "lm_head.weight" and model.config.tie_word_embeddings else name
        if source not in stored:
            problems.append(f"{name}: not in the safetensors files")
            continue
        if not torch.equal(tensor.float(), stored[source].float()):
            diff = (tensor.float() - stored[source].float()).abs().max().item()
            problems.append(f"{name}: differs from the file (max abs {diff})")
        compared += 1

    rope = getattr(model.config, "rope_parameters", None) or {}
    if float(rope.get("rope_theta", -1)) != float(cfg_json["rope_parameters"]["rope_theta"]):
        problems.append(f"rope_parameters read as {rope}, written {cfg_json['rope_parameters']}")

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
              "logits_row0_first8": out.logits[0, 0, :8].tolist(), "problems": problems}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))
    if problems:
        sys.exit("export check FAILED")
    print("export check OK")


if __name__ == "__main__":
    main()
