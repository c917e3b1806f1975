#include "qwen3_config.h"

#include <nlohmann/json.hpp>
#include <set>

#include "decoder_config.h"
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
      decoder::MoeConfig e;
      e.moe_intermediate_size = s.moe_inter;
      c.num_layers = s.layers;
      c.num_heads = s.heads;
      c.num_kv_heads = s.kv;
      e.num_experts = 128;
      e.num_experts_per_tok = 8;
      e.norm_topk_prob = true;
      e.router_aux_loss_coef = 0.001;
      decoder::set_moe(c, e);
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
  static const std::set<std::string> keys = [] {
    std::set<std::string> k = decoder::common_keys();
    k.insert({"use_sliding_window", "sliding_window", "max_window_layers", "attention_bias", "mlp_bias", "num_experts",
              "num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
              "decoder_sparse_step", "mlp_only_layers", "router_aux_loss_coef", "output_router_logits"});
    return k;
  }();
  return keys;
}

// Reads every Qwen3 key over `base`, refusing the variants this module does not compute.
ModelConfig apply(const HfConfig& c, ModelConfig base) {
  ModelConfig m = std::move(base);
  if (c.has("model_type")) {
    m.model_type = c.get_string("model_type", "");
    if (m.model_type != "qwen3" && m.model_type != "qwen3_moe") c.expect_model_type("qwen3");
  } else if (c.get_int("num_experts", c.get_int("num_local_experts", decoder::moe(m).num_experts)) > 0) {
    m.model_type = "qwen3_moe";  // an init spec that names experts
  }
  if (m.model_type == "qwen3_moe") read_moe(c, m);
  decoder::read_common(c, m, "Qwen3", false);
  if (c.get_bool("attention_bias", false))
    throw Error(str(c.source(), ": attention_bias is true, but Qwen3 has no projection biases"), "attention_bias",
                "this checkpoint is not a plain Qwen3; set attention_bias to false only if it has no bias tensors");
  if (c.get_bool("mlp_bias", false))
    throw Error(str(c.source(), ": mlp_bias is true, but the Qwen3 MLP has no biases"), "mlp_bias",
                "this checkpoint is not a plain Qwen3; set mlp_bias to false only if it has no bias tensors");
  return m;
}

// The mixture-of-experts keys, over transformers' Qwen3MoeConfig defaults.
void read_moe(const HfConfig& c, ModelConfig& m) {
  decoder::MoeConfig e = decoder::moe(m);
  // The Hub's checkpoints say num_experts; transformers 5 writes num_local_experts.
  e.num_experts = c.get_int("num_experts", c.get_int("num_local_experts", e.num_experts > 0 ? e.num_experts : 128));
  e.num_experts_per_tok = c.get_int("num_experts_per_tok", e.num_experts_per_tok > 0 ? e.num_experts_per_tok : 8);
  e.moe_intermediate_size = c.get_int("moe_intermediate_size", e.moe_intermediate_size > 0 ? e.moe_intermediate_size : 768);
  e.norm_topk_prob = c.get_bool("norm_topk_prob", e.norm_topk_prob);
  e.decoder_sparse_step = c.get_int("decoder_sparse_step", e.decoder_sparse_step);
  e.router_aux_loss_coef = c.get_double("router_aux_loss_coef", e.router_aux_loss_coef > 0 ? e.router_aux_loss_coef : 0.001);
  e.output_router_logits = c.get_bool("output_router_logits", e.output_router_logits);
  if (c.has("mlp_only_layers")) {
    const nlohmann::json j = nlohmann::json::parse(c.raw("mlp_only_layers"));
    e.mlp_only_layers.clear();
    if (!j.is_null()) {
      if (!j.is_array()) throw Error(str(c.source(), ": mlp_only_layers must be a list of layer numbers"), "mlp_only_layers");
      for (const auto& v : j) {
        if (!v.is_number_integer())
          throw Error(str(c.source(), ": mlp_only_layers holds ", v.dump(), ", not a layer number"), "mlp_only_layers");
        e.mlp_only_layers.push_back(v.get<int64_t>());
      }
    }
  }
  decoder::set_moe(m, e);
}

}  // namespace

void validate(const ModelConfig& c, const std::string& source) {
  const decoder::MoeConfig& e = decoder::moe(c);
  decoder::validate_common(c, source, "Qwen3");
  if (c.model_type != "qwen3_moe") return;
  auto positive = [&](const char* key, int64_t v) {
    if (v <= 0) throw Error(str(source, ": ", key, " is ", v, "; it must be positive"), key);
  };
  positive("num_experts", e.num_experts);
  positive("num_experts_per_tok", e.num_experts_per_tok);
  positive("moe_intermediate_size", e.moe_intermediate_size);
  positive("decoder_sparse_step", e.decoder_sparse_step);
  if (e.num_experts_per_tok > e.num_experts)
    throw Error(str(source, ": num_experts_per_tok ", e.num_experts_per_tok, " is larger than num_experts ", e.num_experts,
                    ": each token picks its top-k of the experts"),
                "num_experts_per_tok", str("use at most ", e.num_experts));
  for (int64_t l : e.mlp_only_layers)
    if (l < 0 || l >= c.num_layers)
      throw Error(str(source, ": mlp_only_layers names layer ", l, " of a model with ", c.num_layers, " layers"),
                  "mlp_only_layers");
  if (!(e.router_aux_loss_coef >= 0))
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
  static const decoder::SpecReader reader{"Qwen3", &known_keys(), preset, small_default, apply, validate};
  return decoder::config_from_spec(spec, init_std, reader);
}

std::string config_to_json(const ModelConfig& c, const std::string& rope_parameters_json, DType dtype) {
  const bool moe = c.model_type == "qwen3_moe";
  nlohmann::ordered_json j = decoder::common_json(c, rope_parameters_json, moe ? "Qwen3MoeForCausalLM" : "Qwen3ForCausalLM",
                                                  moe ? "qwen3_moe" : "qwen3");
  j["attention_bias"] = false;
  j["attention_dropout"] = 0.0;
  j["use_sliding_window"] = false;
  j["sliding_window"] = nullptr;
  j["max_window_layers"] = c.num_layers;
  j["layer_types"] = c.layer_types;
  j["initializer_range"] = 0.02;
  j["use_cache"] = true;
  j["dtype"] = decoder::hf_dtype_name(dtype);
  if (moe) {
    j["num_experts"] = decoder::moe(c).num_experts;
    j["num_experts_per_tok"] = decoder::moe(c).num_experts_per_tok;
    j["moe_intermediate_size"] = decoder::moe(c).moe_intermediate_size;
    j["norm_topk_prob"] = decoder::moe(c).norm_topk_prob;
    j["decoder_sparse_step"] = decoder::moe(c).decoder_sparse_step;
    j["mlp_only_layers"] = decoder::moe(c).mlp_only_layers;
    j["router_aux_loss_coef"] = decoder::moe(c).router_aux_loss_coef;
    j["output_router_logits"] = decoder::moe(c).output_router_logits;
  }
  return j.dump(2) + "\n";
}

}  // namespace lcx::qwen3
