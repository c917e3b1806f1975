// The decoder model every family module is: embedding, layers of GQA attention (rotary positions
// through the PositionalEncoding slot, attention through the Parallelism slot) and a SwiGLU MLP
// (through the MLP slot) or a sparse mixture of experts, a final RMSNorm and a head, tied or not;
// parameters by Hugging Face name, explicit forward and backward, HF load and save, plan terms.
// A family is a recipe: what its layers carry beyond that (q/k norms, q/k/v biases, sliding
// windows, Gemma's (1 + w) and sandwich norms, scaled embedding and GeGLU) and how its config.json
// reads and writes. Linked into each model module; not part of the plugin ABI.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "lcx/hf_config.h"
#include "lcx/ops.h"
#include "lcx/plugin.h"
#include "lcx/slots/model.h"

namespace lcx::decoder {

// How a family's sparse layers store and compute their experts (moe.h's two layouts).
struct ExpertsLayout {
  // GPT-OSS's: mlp.router.weight and .bias, mlp.experts.gate_up_proj [E,H,2I] (gate and up
  // interleaved) and down_proj [E,I,H] stored whole with a bias each, the clamped SwiGLU. Otherwise
  // Qwen3-MoE's: mlp.gate.weight and one tensor per expert and projection.
  bool fused = false;
  float swiglu_alpha = 1.702f, swiglu_limit = 7.f;
  // The checkpoint stores gate_up_proj and down_proj as MXFP4 (`*_blocks`, `*_scales`), as the Hub's
  // gpt-oss releases do: dequantized at load (moe_mxfp4.h); a save writes them unquantized.
  bool mxfp4 = false;
};

struct Family {
  std::string name;       // the module's name: messages and the manifest's default table ("qwen3")
  bool qk_norm = false;   // per-head RMSNorm of q and k before rotary (Qwen3)
  bool qkv_bias = false;  // biases on the q, k and v projections (Qwen2)
  bool experts = false;   // sparse layers may run a mixture of experts (Qwen3-MoE): moe_tile_rows is a key
  // "sliding_attention" layers attend within ModelConfig::sliding_window (Gemma 3, GPT-OSS); a
  // family without it refuses such layers by layer_types.
  bool sliding_window = false;
  // Learned attention sinks (GPT-OSS): each layer's "self_attn.sinks" [num_heads], one logit per
  // query head joining its softmax's denominator (ops::attention_sinks_forward).
  bool sinks = false;
  // Every RMSNorm's weight read as (1 + w), the product in fp32 rounded once (Gemma3RMSNorm,
  // ops::rmsnorm_offset_forward); such weights start at 0.
  bool unit_offset_norms = false;
  // Four norms a layer (Gemma 2 and 3): post_attention_layernorm on the attention's output before
  // its residual, pre_feedforward_layernorm on the MLP's input, post_feedforward_layernorm on the
  // MLP's output before its residual.
  bool sandwich_norms = false;
  // The embedding's rows times sqrt(hidden_size) rounded to the weights' dtype (Gemma); the tied
  // head reads the table unscaled.
  bool scaled_embedding = false;
  // The gated MLP's activation: silu (SwiGLU) or gelu_tanh (Gemma's gelu_pytorch_tanh).
  ops::GateActivation activation = ops::GateActivation::silu;
  // A checkpoint tensor's name as this decoder names the parameter ("model.layers.0...."), or ""
  // for a tensor the family leaves unread (a multimodal checkpoint's vision tower); null: the
  // names are the decoder's. Saving writes the decoder's names.
  std::string (*checkpoint_name)(const std::string& stored) = nullptr;
  bool o_bias = false;    // a bias on o_proj too (GPT-OSS's attention_bias: q, k, v and o)
  // The experts' layout a config.json (or an init spec, as JSON keys) gives; null: Qwen3-MoE's.
  ExpertsLayout (*experts_layout)(const HfConfig& c) = nullptr;
  // A checkpoint's config.json; refuses what the family does not compute, naming the key.
  ModelConfig (*from_hf)(const HfConfig& c) = nullptr;
  // A preset name or a JSON object of config.json keys (init_random, describe); init_std, when not
  // null, receives initializer_range.
  ModelConfig (*from_spec)(const std::string& spec, double* init_std) = nullptr;
  // The config.json transformers reads back, with these rope parameters.
  std::string (*to_json)(const ModelConfig& c, const std::string& rope_parameters_json, DType dtype) = nullptr;
  // In place of to_json where the config carries the experts' layout too (GPT-OSS's swiglu_limit).
  std::string (*to_json_with_experts)(const ModelConfig& c, const ExpertsLayout& experts,
                                      const std::string& rope_parameters_json, DType dtype) = nullptr;
};

// The standard decoder's linear modules, by the id a layer exposes each with (LinearModule::id,
// Adapter::find): a dense layer's q, k, v, o, gate, up and down; a sparse layer's experts' gate,
// up and down (Qwen3-MoE's, one nn.Linear per expert as PEFT sees them) or gate_up and down
// (the fused layout's 3-D parameters).
enum class Proj : int { q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, gate_up_proj };
// What each reads (LinearModule::input): the normed input, the attention's output, the MLP's
// input, the gated activation.
enum class ProjInput : int { attention_in, attention_out, mlp_in, mlp_act };
// Every layer's linear modules of a model of config c, as the family builds them.
std::vector<std::vector<LinearModule>> linear_modules(const ModelConfig& c, const Family& family,
                                                      const ExpertsLayout& layout);

// The Model a module's factory returns: the family's recipe, and the module's manifest table
// (check_finite, max_shard_size, attention_head_groups, attention_keep_outputs, keep_attention, and
// moe_tile_rows where the family has experts).
std::unique_ptr<Plugin> create_model(const PluginArgs& args, const Family& family);

}  // namespace lcx::decoder
