#include "decoder_config.h"

#include <map>

#include "lcx/error.h"

namespace lcx::decoder {

// Parsed once per distinct text and thread: the layers and the plan ask for it often.
const MoeConfig& moe(const ModelConfig& c) {
  static const MoeConfig none;
  if (c.family_json.empty()) return none;
  thread_local std::map<std::string, MoeConfig> parsed;
  const auto it = parsed.find(c.family_json);
  if (it != parsed.end()) return it->second;
  const nlohmann::json j = nlohmann::json::parse(c.family_json);
  MoeConfig e;
  e.num_experts = j.at("num_experts").get<int64_t>();
  e.num_experts_per_tok = j.at("num_experts_per_tok").get<int64_t>();
  e.moe_intermediate_size = j.at("moe_intermediate_size").get<int64_t>();
  e.norm_topk_prob = j.at("norm_topk_prob").get<bool>();
  e.decoder_sparse_step = j.at("decoder_sparse_step").get<int64_t>();
  e.mlp_only_layers = j.at("mlp_only_layers").get<std::vector<int64_t>>();
  e.router_aux_loss_coef = j.at("router_aux_loss_coef").get<double>();
  e.output_router_logits = j.at("output_router_logits").get<bool>();
  return parsed.emplace(c.family_json, std::move(e)).first->second;
}

void set_moe(ModelConfig& c, const MoeConfig& e) {
  c.family_json = nlohmann::json{{"num_experts", e.num_experts},
                                 {"num_experts_per_tok", e.num_experts_per_tok},
                                 {"moe_intermediate_size", e.moe_intermediate_size},
                                 {"norm_topk_prob", e.norm_topk_prob},
                                 {"decoder_sparse_step", e.decoder_sparse_step},
                                 {"mlp_only_layers", e.mlp_only_layers},
                                 {"router_aux_loss_coef", e.router_aux_loss_coef},
                                 {"output_router_logits", e.output_router_logits}}
                      .dump();
}

bool sparse(const ModelConfig& c, int64_t layer) {
  const MoeConfig& m = moe(c);
  if (m.num_experts <= 0 || m.decoder_sparse_step <= 0) return false;
  for (int64_t l : m.mlp_only_layers)
    if (l == layer) return false;
  return (layer + 1) % m.decoder_sparse_step == 0;
}

int64_t sparse_layers(const ModelConfig& c) {
  int64_t n = 0;
  for (int64_t l = 0; l < c.num_layers; ++l) n += sparse(c, l) ? 1 : 0;
  return n;
}

const std::set<std::string>& common_keys() {
  static const std::set<std::string> keys = {
      "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
      "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
      "rope_theta", "rope_parameters", "rope_scaling", "layer_types", "torch_dtype", "dtype", "attention_dropout",
      "hidden_act", "initializer_range", "use_cache", "model_type", "architectures", "bos_token_id", "eos_token_id",
      "pad_token_id", "transformers_version", "partial_rotary_factor"};
  return keys;
}

bool quantized_mxfp4(const HfConfig& c) {
  if (!c.has("quantization_config")) return false;
  const nlohmann::json q = nlohmann::json::parse(c.raw("quantization_config"), nullptr, false);
  return q.is_object() && q.value("quant_method", std::string()) == "mxfp4";
}

void read_common(const HfConfig& c, ModelConfig& m, const std::string& display, bool derive_head_dim,
                 bool mxfp4_experts) {
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
  // transformers: head_dim None means hidden_size / num_attention_heads (Qwen3 defaults to 128).
  m.head_dim = c.get_int("head_dim", derive_head_dim && m.num_heads > 0 ? m.hidden_size / m.num_heads : m.head_dim);
  m.max_position_embeddings = c.get_int("max_position_embeddings", m.max_position_embeddings);
  m.rms_norm_eps = c.get_double("rms_norm_eps", m.rms_norm_eps);
  m.tie_word_embeddings = c.get_bool("tie_word_embeddings", m.tie_word_embeddings);
  m.rope_theta = c.rope_theta(m.rope_theta);
  const std::string rope = c.rope_parameters_json();
  if (rope != "{}") m.rope_parameters_json = rope;
  if (c.has("layer_types") || c.has("use_sliding_window") || layers_given || m.layer_types.empty())
    m.layer_types = c.layer_types(m.num_layers);
  m.torch_dtype = c.torch_dtype(m.torch_dtype);
  const std::string act = c.get_string("hidden_act", "silu");
  if (act != "silu")
    throw Error(str(c.source(), ": hidden_act is '", act, "'; the ", display, " MLP here is SwiGLU (silu)"), "hidden_act");
  if (c.get_double("partial_rotary_factor", 1.0) != 1.0)
    throw Error(str(c.source(), ": partial_rotary_factor is ", c.get_double("partial_rotary_factor", 1.0), "; ", display,
                    " rotates every dimension of a head"),
                "partial_rotary_factor", "use a checkpoint with partial_rotary_factor 1");
  if (c.has("quantization_config") && !(mxfp4_experts && quantized_mxfp4(c)))
    throw Error(str(c.source(), ": quantization_config is set; this module reads unquantized bf16/fp16/fp32 weights"),
                "quantization_config", "use the checkpoint's unquantized release");
  if (c.get_double("attention_dropout", 0.0) != 0.0)
    throw Error(str(c.source(), ": attention_dropout is ", c.get_double("attention_dropout", 0.0),
                    "; lcx trains without dropout"),
                "attention_dropout", "set it to 0.0");
}

void validate_common(const ModelConfig& c, const std::string& source, const std::string& display) {
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
      throw Error(str(source, ": layer type '", t, "' is unknown to ", display), "layer_types",
                  "use full_attention or sliding_attention");
}

ModelConfig config_from_spec(const std::string& spec, double* init_std, const SpecReader& r) {
  if (init_std) *init_std = 0.02;
  const auto first = spec.find_first_not_of(" \t\n");
  if (first == std::string::npos || spec[first] != '{') {
    ModelConfig m = r.preset(spec);
    r.validate(m, spec);
    return m;
  }
  HfConfig c = HfConfig::parse(spec, "model init spec");
  for (const auto& k : c.keys())
    if (k != "preset" && !r.keys->count(k))
      throw Error(str("model init spec: unknown key '", k, "'"), "model.init",
                  str("use config.json keys of ", r.display, " (hidden_size, num_hidden_layers, ...) or \"preset\""));
  ModelConfig base = c.has("preset") ? r.preset(c.get_string("preset", "")) : r.small_default();
  if (base.layer_types.empty()) base.layer_types.assign(static_cast<size_t>(base.num_layers), "full_attention");
  ModelConfig m = r.apply(c, base);
  r.validate(m, "model init spec");
  if (init_std) *init_std = c.get_double("initializer_range", 0.02);
  return m;
}

const char* hf_dtype_name(DType t) {
  switch (t) {
    case DType::bf16: return "bfloat16";
    case DType::f16: return "float16";
    default: return "float32";
  }
}

nlohmann::ordered_json common_json(const ModelConfig& c, const std::string& rope_parameters_json,
                                   const std::string& architecture, const std::string& model_type) {
  nlohmann::ordered_json rope = nlohmann::ordered_json::parse(rope_parameters_json.empty() ? "{}" : rope_parameters_json);
  if (!rope.is_object()) throw Error("rope parameters for config.json must be a JSON object");
  if (!rope.contains("rope_type")) rope["rope_type"] = "default";
  if (!rope.contains("rope_theta")) rope["rope_theta"] = c.rope_theta;
  nlohmann::ordered_json j;
  j["architectures"] = {architecture};
  j["model_type"] = model_type;
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
  // transformers 4 and vLLM read a scaled rotary from rope_scaling (`type` is its older name).
  if (rope["rope_type"] != "default") {
    nlohmann::ordered_json scaling = rope;
    scaling.erase("rope_theta");
    scaling["type"] = rope["rope_type"];
    j["rope_scaling"] = scaling;
  }
  return j;
}

}  // namespace lcx::decoder
