#include "qwen3_config.h"

#include <algorithm>
#include <nlohmann/json.hpp>
#include <set>

#include "lcx/error.h"

namespace lcx::qwen3 {
namespace {

void read_moe(const HfConfig& c, ModelConfig& m);

// transformers' Qwen3Config defaults, for keys a config.json leaves out.
ModelConfig transformers_defaults() {
  ModelConfig c;
  c.model_type = "qwen3";
  c.vocab_size = 151936;
  c.hidden_size = 4096;
  c.intermediate_size = 22016;
  c.num_layers = 32;
  c.num_heads = 32;
  c.num_kv_heads = 32;
  c.head_dim = 128;
  c.max_position_embeddings = 32768;
  c.rope_theta = 10000;
  c.rms_norm_eps = 1e-6;
  c.tie_word_embeddings = false;
  c.torch_dtype = "bfloat16";
  return c;
}

// The public Qwen3 shapes (vocab 151,936, head_dim 128, theta 1e6, 40,960 positions).
ModelConfig preset(const std::string& name) {
  ModelConfig c = transformers_defaults();
  c.rope_theta = 1e6;
  c.max_position_embeddings = 40960;
  struct Shape {
    const char* name;
    int64_t hidden, inter, layers, heads, kv;
    bool tied;
  };
  // The mixture-of-experts releases: 128 experts, top-8 renormalized, 32k positions trained on
  // 40,960 like the dense ones; intermediate_size is the dense MLP a layer in mlp_only_layers runs.
  struct MoeShape {
    const char* name;
    int64_t hidden, inter, moe_inter, layers, heads, kv;
  };
  static const MoeShape moe_shapes[] = {{"qwen3-30b-a3b", 2048, 6144, 768, 48, 32, 4},
                                        {"qwen3-235b-a22b", 4096, 12288, 1536, 94, 64, 4}};
  for (const auto& s : moe_shapes)
    if (name == s.name) {
      c.model_type = "qwen3_moe";
      c.hidden_size = s.hidden;
      c.intermediate_size = s.inter;
      c.moe_intermediate_size = s.moe_inter;
      c.num_layers = s.layers;
      c.num_heads = s.heads;
      c.num_kv_heads = s.kv;
      c.num_experts = 128;
      c.num_experts_per_tok = 8;
      c.norm_topk_prob = true;
      c.router_aux_loss_coef = 0.001;
      c.tie_word_embeddings = false;
      c.layer_types.assign(static_cast<size_t>(c.num_layers), "full_attention");
      return c;
    }
  static const Shape shapes[] = {{"qwen3-0.6b", 1024, 3072, 28, 16, 8, true},
                                 {"qwen3-1.7b", 2048, 6144, 28, 16, 8, true},
                                 {"qwen3-4b", 2560, 9728, 36, 32, 8, true},
                                 {"qwen3-8b", 4096, 12288, 36, 32, 8, false},
                                 {"qwen3-14b", 5120, 17408, 40, 40, 8, false},
                                 {"qwen3-32b", 5120, 25600, 64, 64, 8, false}};
  for (const auto& s : shapes)
    if (name == s.name) {
      c.hidden_size = s.hidden;
      c.intermediate_size = s.inter;
      c.num_layers = s.layers;
      c.num_heads = s.heads;
      c.num_kv_heads = s.kv;
      c.tie_word_embeddings = s.tied;
      c.layer_types.assign(static_cast<size_t>(c.num_layers), "full_attention");
      return c;
    }
  throw Error(str("model init '", name, "' is neither a preset nor a JSON object"), "model.init",
              "use qwen3-0.6b, qwen3-1.7b, qwen3-4b, qwen3-8b, qwen3-14b, qwen3-32b, qwen3-30b-a3b, qwen3-235b-a22b, "
              "or {\"hidden_size\": 256, ...}");
}

// Small enough for a CPU test, shaped like the real thing (GQA 2, tied).
ModelConfig small_default() {
  ModelConfig c = transformers_defaults();
  c.vocab_size = 1024;
  c.hidden_size = 128;
  c.intermediate_size = 384;
  c.num_layers = 2;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 32;
  c.max_position_embeddings = 40960;
  c.rope_theta = 1e6;
  c.tie_word_embeddings = true;
  return c;
}

// Every key of a Qwen3 config.json; an init spec may use only these (plus "preset").
const std::set<std::string>& known_keys() {
  static const std::set<std::string> keys = {
      "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
      "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
      "rope_theta", "rope_parameters", "rope_scaling", "layer_types", "use_sliding_window", "sliding_window",
      "max_window_layers", "torch_dtype", "dtype", "attention_bias", "attention_dropout", "hidden_act",
      "initializer_range", "use_cache", "model_type", "architectures", "bos_token_id", "eos_token_id",
      "pad_token_id", "transformers_version", "mlp_bias", "partial_rotary_factor", "num_experts", "num_local_experts",
      "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers",
      "router_aux_loss_coef", "output_router_logits"};
  return keys;
}

// Reads every Qwen3 key over `base`, refusing the variants this module does not compute.
ModelConfig apply(const HfConfig& c, ModelConfig base) {
  ModelConfig m = std::move(base);
  if (c.has("model_type")) {
    m.model_type = c.get_string("model_type", "");
    if (m.model_type != "qwen3" && m.model_type != "qwen3_moe") c.expect_model_type("qwen3");
  } else if (c.get_int("num_experts", c.get_int("num_local_experts", m.num_experts)) > 0) {
    m.model_type = "qwen3_moe";  // an init spec that names experts
  }
  if (m.model_type == "qwen3_moe") read_moe(c, m);
  m.vocab_size = c.get_int("vocab_size", m.vocab_size);
  m.hidden_size = c.get_int("hidden_size", m.hidden_size);
  m.intermediate_size = c.get_int("intermediate_size", m.intermediate_size);
  const bool layers_given = c.has("num_hidden_layers");
  m.num_layers = c.get_int("num_hidden_layers", m.num_layers);
  m.num_heads = c.get_int("num_attention_heads", m.num_heads);
  // transformers: num_key_value_heads None means one kv head per query head.
  m.num_kv_heads = c.has("num_key_value_heads") ? c.get_int("num_key_value_heads", 0)
                   : c.has("num_attention_heads") ? m.num_heads
                                                  : m.num_kv_heads;
  m.head_dim = c.get_int("head_dim", m.head_dim);
  m.max_position_embeddings = c.get_int("max_position_embeddings", m.max_position_embeddings);
  m.rms_norm_eps = c.get_double("rms_norm_eps", m.rms_norm_eps);
  m.tie_word_embeddings = c.get_bool("tie_word_embeddings", m.tie_word_embeddings);
  m.rope_theta = c.rope_theta(m.rope_theta);
  const std::string rope = c.rope_parameters_json();
  if (rope != "{}") m.rope_parameters_json = rope;
  if (c.has("layer_types") || c.has("use_sliding_window") || layers_given || m.layer_types.empty())
    m.layer_types = c.layer_types(m.num_layers);
  m.torch_dtype = c.torch_dtype(m.torch_dtype);
  if (c.get_bool("attention_bias", false))
    throw Error(str(c.source(), ": attention_bias is true, but Qwen3 has no projection biases"), "attention_bias",
                "this checkpoint is not a plain Qwen3; set attention_bias to false only if it has no bias tensors");
  const std::string act = c.get_string("hidden_act", "silu");
  if (act != "silu")
    throw Error(str(c.source(), ": hidden_act is '", act, "'; the Qwen3 MLP here is SwiGLU (silu)"), "hidden_act");
  if (c.get_bool("mlp_bias", false))
    throw Error(str(c.source(), ": mlp_bias is true, but the Qwen3 MLP has no biases"), "mlp_bias",
                "this checkpoint is not a plain Qwen3; set mlp_bias to false only if it has no bias tensors");
  if (c.get_double("partial_rotary_factor", 1.0) != 1.0)
    throw Error(str(c.source(), ": partial_rotary_factor is ", c.get_double("partial_rotary_factor", 1.0),
                    "; Qwen3 rotates every dimension of a head"),
                "partial_rotary_factor", "use a checkpoint with partial_rotary_factor 1");
  if (c.has("quantization_config"))
    throw Error(str(c.source(), ": quantization_config is set; this module reads unquantized bf16/fp16/fp32 weights"),
                "quantization_config", "use the checkpoint's unquantized release");
  if (c.get_double("attention_dropout", 0.0) != 0.0)
    throw Error(str(c.source(), ": attention_dropout is ", c.get_double("attention_dropout", 0.0),
                    "; lcx trains without dropout"),
                "attention_dropout", "set it to 0.0");
  return m;
}

// The mixture-of-experts keys, over transformers' Qwen3MoeConfig defaults.
void read_moe(const HfConfig& c, ModelConfig& m) {
  // The Hub's checkpoints say num_experts; transformers 5 writes num_local_experts.
  m.num_experts = c.get_int("num_experts", c.get_int("num_local_experts", m.num_experts > 0 ? m.num_experts : 128));
  m.num_experts_per_tok = c.get_int("num_experts_per_tok", m.num_experts_per_tok > 0 ? m.num_experts_per_tok : 8);
  m.moe_intermediate_size = c.get_int("moe_intermediate_size", m.moe_intermediate_size > 0 ? m.moe_intermediate_size : 768);
  m.norm_topk_prob = c.get_bool("norm_topk_prob", m.norm_topk_prob);
  m.decoder_sparse_step = c.get_int("decoder_sparse_step", m.decoder_sparse_step);
  m.router_aux_loss_coef = c.get_double("router_aux_loss_coef", m.router_aux_loss_coef > 0 ? m.router_aux_loss_coef : 0.001);
  m.output_router_logits = c.get_bool("output_router_logits", m.output_router_logits);
  if (c.has("mlp_only_layers")) {
    const nlohmann::json j = nlohmann::json::parse(c.raw("mlp_only_layers"));
    m.mlp_only_layers.clear();
    if (!j.is_null()) {
      if (!j.is_array()) throw Error(str(c.source(), ": mlp_only_layers must be a list of layer numbers"), "mlp_only_layers");
      for (const auto& v : j) {
        if (!v.is_number_integer())
          throw Error(str(c.source(), ": mlp_only_layers holds ", v.dump(), ", not a layer number"), "mlp_only_layers");
        m.mlp_only_layers.push_back(v.get<int64_t>());
      }
    }
  }
}

const char* hf_dtype_name(DType t) {
  switch (t) {
    case DType::bf16: return "bfloat16";
    case DType::f16: return "float16";
    default: return "float32";
  }
}

}  // namespace

void validate(const ModelConfig& c, const std::string& source) {
  auto positive = [&](const char* key, int64_t v) {
    if (v <= 0) throw Error(str(source, ": ", key, " is ", v, "; it must be positive"), key);
  };
  positive("vocab_size", c.vocab_size);
  positive("hidden_size", c.hidden_size);
  positive("intermediate_size", c.intermediate_size);
  positive("num_hidden_layers", c.num_layers);
  positive("num_attention_heads", c.num_heads);
  positive("num_key_value_heads", c.num_kv_heads);
  positive("head_dim", c.head_dim);
  positive("max_position_embeddings", c.max_position_embeddings);
  if (c.num_heads % c.num_kv_heads != 0)
    throw Error(str(source, ": num_attention_heads ", c.num_heads, " is not a multiple of num_key_value_heads ",
                    c.num_kv_heads),
                "num_key_value_heads");
  if (c.head_dim % 2 != 0)
    throw Error(str(source, ": head_dim ", c.head_dim, " is odd; rotary embeddings need pairs"), "head_dim");
  if (!(c.rms_norm_eps > 0)) throw Error(str(source, ": rms_norm_eps must be positive"), "rms_norm_eps");
  if (static_cast<int64_t>(c.layer_types.size()) != c.num_layers)
    throw Error(str(source, ": layer_types has ", c.layer_types.size(), " entries for ", c.num_layers, " layers"),
                "layer_types");
  for (const auto& t : c.layer_types)
    if (t != "full_attention" && t != "sliding_attention")
      throw Error(str(source, ": layer type '", t, "' is unknown to Qwen3"), "layer_types",
                  "use full_attention or sliding_attention");
  if (c.model_type != "qwen3_moe") return;
  positive("num_experts", c.num_experts);
  positive("num_experts_per_tok", c.num_experts_per_tok);
  positive("moe_intermediate_size", c.moe_intermediate_size);
  positive("decoder_sparse_step", c.decoder_sparse_step);
  if (c.num_experts_per_tok > c.num_experts)
    throw Error(str(source, ": num_experts_per_tok ", c.num_experts_per_tok, " is larger than num_experts ", c.num_experts,
                    ": each token picks its top-k of the experts"),
                "num_experts_per_tok", str("use at most ", c.num_experts));
  for (int64_t l : c.mlp_only_layers)
    if (l < 0 || l >= c.num_layers)
      throw Error(str(source, ": mlp_only_layers names layer ", l, " of a model with ", c.num_layers, " layers"),
                  "mlp_only_layers");
  if (!(c.router_aux_loss_coef >= 0))
    throw Error(str(source, ": router_aux_loss_coef must not be negative"), "router_aux_loss_coef");
}

ModelConfig config_from_hf(const HfConfig& c) {
  if (c.get_string("model_type", "") != "qwen3_moe") c.expect_model_type("qwen3");
  for (const char* key : {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"})
    c.require_int(key);
  ModelConfig m = apply(c, transformers_defaults());
  validate(m, c.source());
  return m;
}

ModelConfig config_from_spec(const std::string& spec, double* init_std) {
  if (init_std) *init_std = 0.02;
  const auto first = spec.find_first_not_of(" \t\n");
  if (first == std::string::npos || spec[first] != '{') {
    ModelConfig m = preset(spec);
    validate(m, spec);
    return m;
  }
  HfConfig c = HfConfig::parse(spec, "model init spec");
  for (const auto& k : c.keys())
    if (k != "preset" && !known_keys().count(k))
      throw Error(str("model init spec: unknown key '", k, "'"), "model.init",
                  "use config.json keys of Qwen3 (hidden_size, num_hidden_layers, ...) or \"preset\"");
  ModelConfig base = c.has("preset") ? preset(c.get_string("preset", "")) : small_default();
  if (base.layer_types.empty()) base.layer_types.assign(static_cast<size_t>(base.num_layers), "full_attention");
  ModelConfig m = apply(c, base);
  validate(m, "model init spec");
  if (init_std) *init_std = c.get_double("initializer_range", 0.02);
  return m;
}

std::string config_to_json(const ModelConfig& c, const std::string& rope_parameters_json, DType dtype) {
  nlohmann::ordered_json rope = nlohmann::ordered_json::parse(rope_parameters_json.empty() ? "{}" : rope_parameters_json);
  if (!rope.is_object()) throw Error("rope parameters for config.json must be a JSON object");
  if (!rope.contains("rope_type")) rope["rope_type"] = "default";
  if (!rope.contains("rope_theta")) rope["rope_theta"] = c.rope_theta;
  nlohmann::ordered_json j;
  const bool moe = c.model_type == "qwen3_moe";
  j["architectures"] = {moe ? "Qwen3MoeForCausalLM" : "Qwen3ForCausalLM"};
  j["model_type"] = moe ? "qwen3_moe" : "qwen3";
  j["vocab_size"] = c.vocab_size;
  j["hidden_size"] = c.hidden_size;
  j["intermediate_size"] = c.intermediate_size;
  j["num_hidden_layers"] = c.num_layers;
  j["num_attention_heads"] = c.num_heads;
  j["num_key_value_heads"] = c.num_kv_heads;
  j["head_dim"] = c.head_dim;
  j["hidden_act"] = "silu";
  j["max_position_embeddings"] = c.max_position_embeddings;
  j["rms_norm_eps"] = c.rms_norm_eps;
  j["tie_word_embeddings"] = c.tie_word_embeddings;
  j["rope_parameters"] = rope;
  j["rope_theta"] = rope["rope_theta"];  // transformers 4 reads only this
  j["attention_bias"] = false;
  j["attention_dropout"] = 0.0;
  j["use_sliding_window"] = false;
  j["sliding_window"] = nullptr;
  j["max_window_layers"] = c.num_layers;
  j["layer_types"] = c.layer_types;
  j["initializer_range"] = 0.02;
  j["use_cache"] = true;
  j["dtype"] = hf_dtype_name(dtype);
  if (moe) {
    j["num_experts"] = c.num_experts;
    j["num_experts_per_tok"] = c.num_experts_per_tok;
    j["moe_intermediate_size"] = c.moe_intermediate_size;
    j["norm_topk_prob"] = c.norm_topk_prob;
    j["decoder_sparse_step"] = c.decoder_sparse_step;
    j["mlp_only_layers"] = c.mlp_only_layers;
    j["router_aux_loss_coef"] = c.router_aux_loss_coef;
    j["output_router_logits"] = c.output_router_logits;
  }
  return j.dump(2) + "\n";
}

}  // namespace lcx::qwen3
