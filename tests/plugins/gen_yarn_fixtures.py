#!/usr/bin/env python3
"""Writes the YaRN fixtures that tests/plugins/rope_yarn_test.cpp holds rope_yarn against.

For each case it builds a Qwen3Config carrying the case's rope parameters, asks transformers'
own YaRN initializer (ROPE_INIT_FUNCTIONS["yarn"], i.e. _compute_yarn_parameters) for inv_freq and
the attention factor, and for a few cases also the cos/sin rows that Qwen3RotaryEmbedding produces at
given positions. Run it where torch and transformers 5.x are installed (the GPU machine):

    python3 tests/plugins/gen_yarn_fixtures.py OUT.json [SOURCE.txt]

SOURCE.txt, when given, receives the source of the functions used, to check what was run.
"""
import inspect
import json
import sys

import torch
import transformers
from transformers import Qwen3Config
from transformers import modeling_rope_utils as rope_utils
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

# name, head_dim, rope_theta, max_position_embeddings, rope parameters (besides rope_type/theta),
# positions whose cos/sin rows are also recorded (empty: inv_freq and attention factor only).
CASES = [
    ("qwen3_4b_factor4", 128, 1e6, 163840, {"factor": 4.0, "original_max_position_embeddings": 40960},
     [0, 1, 4097, 40959, 100000, 163839]),
    ("factor2_orig32k", 128, 1e6, 65536, {"factor": 2.0, "original_max_position_embeddings": 32768}, []),
    ("factor8_theta1e4_d64", 64, 1e4, 32768, {"factor": 8.0, "original_max_position_embeddings": 4096},
     [0, 3, 2048, 32767]),
    ("factor16_theta5e5", 128, 5e5, 131072, {"factor": 16.0, "original_max_position_embeddings": 8192}, []),
    ("factor2p5_d96", 96, 1e6, 5120, {"factor": 2.5, "original_max_position_embeddings": 2048}, []),
    ("tiny_d16_factor8", 16, 1e4, 16384, {"factor": 8.0, "original_max_position_embeddings": 2048},
     [0, 5, 2047, 16383]),
    ("factor16_d32_orig2048", 32, 1e6, 32768, {"factor": 16.0, "original_max_position_embeddings": 2048}, []),
    ("no_truncate", 128, 1e6, 163840,
     {"factor": 4.0, "original_max_position_embeddings": 40960, "truncate": False}, [0, 77777]),
    ("betas_16_2", 128, 1e6, 163840,
     {"factor": 4.0, "original_max_position_embeddings": 40960, "beta_fast": 16.0, "beta_slow": 2.0}, []),
    ("attention_factor_given", 128, 1e6, 163840,
     {"factor": 4.0, "original_max_position_embeddings": 40960, "attention_factor": 1.25}, []),
    ("mscale_both", 64, 1e4, 163840,
     {"factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 0.707, "mscale_all_dim": 0.707}, []),
    ("mscale_differ", 64, 1e4, 163840,
     {"factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0, "mscale_all_dim": 0.5}, []),
    ("mscale_only", 64, 1e4, 163840,
     {"factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0}, []),
    ("factor1", 128, 1e6, 40960, {"factor": 1.0, "original_max_position_embeddings": 40960}, []),
    ("factor32_d128", 128, 1e6, 1048576, {"factor": 32.0, "original_max_position_embeddings": 32768}, []),
    # A config whose max_position_embeddings was left at the trained length: shows whether transformers
    # takes `factor` as given or derives it from the two lengths.
    ("max_pos_not_scaled", 128, 1e6, 40960, {"factor": 4.0, "original_max_position_embeddings": 40960}, []),
]


def make_config(head_dim, theta, max_pos, params):
    rope_parameters = {"rope_type": "yarn", "rope_theta": theta, **params}
    heads = 4
    return Qwen3Config(vocab_size=64, hidden_size=heads * head_dim, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=heads, num_key_value_heads=2, head_dim=head_dim,
                       max_position_embeddings=max_pos, rope_parameters=rope_parameters)


def run_case(name, head_dim, theta, max_pos, params, positions):
    out = {"name": name, "head_dim": head_dim, "rope_theta": theta, "max_position_embeddings": max_pos,
           "rope_parameters": {"rope_type": "yarn", "rope_theta": theta, **params}}
    try:
        config = make_config(head_dim, theta, max_pos, params)
        out["config_rope_parameters"] = json.loads(json.dumps(config.rope_parameters, default=str))
        inv_freq, attention_factor = rope_utils.ROPE_INIT_FUNCTIONS["yarn"](config, torch.device("cpu"))
        assert inv_freq.dtype == torch.float32, inv_freq.dtype
        out["inv_freq"] = [float(x) for x in inv_freq.tolist()]
        out["attention_factor"] = float(attention_factor)
        if positions:
            rotary = Qwen3RotaryEmbedding(config=config)
            x = torch.zeros(1, len(positions), head_dim, dtype=torch.float32)
            cos, sin = rotary(x, torch.tensor([positions], dtype=torch.long))
            half = head_dim // 2
            out["positions"] = positions
            out["cos"] = [[float(v) for v in row[:half]] for row in cos[0].tolist()]
            out["sin"] = [[float(v) for v in row[:half]] for row in sin[0].tolist()]
            out["rotary_inv_freq_matches"] = bool(torch.equal(rotary.inv_freq.float(), inv_freq))
    except Exception as e:  # recorded, so one bad case does not cost the others
        out["error"] = f"{type(e).__name__}: {e}"
    return out


def main():
    path = sys.argv[1]
    cases = [run_case(*c) for c in CASES]
    # transformers 4's spelling: top-level rope_theta and rope_scaling with "type".
    try:
        config = Qwen3Config(vocab_size=64, hidden_size=512, intermediate_size=64, num_hidden_layers=1,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                             max_position_embeddings=163840, rope_theta=1e6,
                             rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 40960})
        inv_freq, attention_factor = rope_utils.ROPE_INIT_FUNCTIONS["yarn"](config, torch.device("cpu"))
        cases.append({"name": "v4_rope_scaling", "head_dim": 128, "rope_theta": 1e6, "max_position_embeddings": 163840,
                      "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 40960},
                      "config_rope_parameters": json.loads(json.dumps(config.rope_parameters, default=str)),
                      "inv_freq": [float(x) for x in inv_freq.tolist()], "attention_factor": float(attention_factor)})
    except Exception as e:
        cases.append({"name": "v4_rope_scaling", "error": f"{type(e).__name__}: {e}"})
    doc = {"generator": "tests/plugins/gen_yarn_fixtures.py", "transformers": transformers.__version__,
           "torch": torch.__version__, "cases": cases}
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    for c in cases:
        print(c["name"], c.get("error", "ok"), c.get("attention_factor"))
    if len(sys.argv) > 2:
        with open(sys.argv[2], "w") as f:
            owners = [rope_utils, getattr(transformers, "PreTrainedConfig", None), Qwen3Config]
            names = ("_compute_yarn_parameters", "standardize_rope_params", "_validate_yarn_rope_parameters",
                     "rope_config_validation", "validate_rope", "_check_received_keys")
            for owner in owners:
                for fn in names:
                    if owner is not None and hasattr(owner, fn):
                        try:
                            f.write(f"# {owner.__name__}.{fn}\n" + inspect.getsource(getattr(owner, fn)) + "\n")
                        except (TypeError, OSError) as e:
                            f.write(f"# {owner.__name__}.{fn}: no source ({e})\n")
            f.write(inspect.getsource(Qwen3RotaryEmbedding) + "\n")

if __name__ == "__main__":
    main()
