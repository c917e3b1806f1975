// The gpt_oss model module: GPT-OSS (model_type "gpt_oss", gpt-oss-20b and gpt-oss-120b) on the
// shared decoder (models/common), as transformers 5.17's GptOssForCausalLM computes it: biases on
// q, k, v and o, a learned sink logit per head in each softmax, layers alternating between a
// sliding window (sliding_window keys) and full causal attention, YaRN rotary positions (the
// rope_yarn plugin reads them from the checkpoint), and in every layer a mixture of experts: a
// router with a bias, the softmax over the k largest logits, experts fused as gate_up_proj
// [E,H,2I] (gate and up interleaved) and down_proj [E,I,H] with biases, and the clamped SwiGLU
// (swiglu_limit, alpha 1.702). The Hub's MXFP4 experts are dequantized at load; saves are
// unquantized.
#include <nlohmann/json.hpp>
#include <set>

#include "decoder_config.h"
#include "decoder_model.h"
#include "lcx/error.h"

namespace lcx::gpt_oss {
namespace {

// gpt-oss's rotary: YaRN, factor 32 over 4,096 trained positions, beta 32 / 1, ends not rounded.
std::string yarn(double theta) {
  return nlohmann::json{{"rope_type", "yarn"},    {"rope_theta", theta}, {"factor", 32.0},
                        {"beta_fast", 32.0},      {"beta_slow", 1.0},    {"truncate", false},
                        {"original_max_position_embeddings", 4096}}
      .dump();
}

// Layer i slides when i is even, as GptOssConfig lays them out when config.json lists none.
std::vector<std::string> alternating(int64_t layers) {
  std::vector<std::string> out;
  for (int64_t i = 0; i < layers; ++i) out.push_back(i % 2 == 0 ? "sliding_attention" : "full_attention");
  return out;
}

// transformers' GptOssConfig defaults (gpt-oss-120b's shape), for keys a config.json leaves out.
ModelConfig transformers_defaults() {
  ModelConfig c;
  c.model_type = "gpt_oss";
  c.vocab_size = 201088;
  c.hidden_size = 2880;
  c.intermediate_size = 2880;
  c.num_layers = 36;
  c.num_heads = 64;
  c.num_kv_heads = 8;
  c.head_dim = 64;
  c.max_position_embeddings = 131072;
  c.rope_theta = 150000;
  c.rope_parameters_json = yarn(c.rope_theta);
  c.rms_norm_eps = 1e-5;
  c.tie_word_embeddings = false;
  c.sliding_window = 128;
  decoder::MoeConfig e;
  e.num_experts = 128;
  e.num_experts_per_tok = 4;
  e.moe_intermediate_size = c.intermediate_size;
  // Softmax over the k largest logits is the top-k of the whole softmax renormalized.
  e.norm_topk_prob = true;
  e.decoder_sparse_step = 1;
  e.router_aux_loss_coef = 0.001;
  e.output_router_logits = false;
  decoder::set_moe(c, e);
  c.torch_dtype = "bfloat16";
  c.layer_types = alternating(c.num_layers);
  return c;
}

// The public shapes (the Hub's config.json of openai/gpt-oss-20b and -120b).
ModelConfig preset(const std::string& name) {
  ModelConfig c = transformers_defaults();
  decoder::MoeConfig e = decoder::moe(c);
  e.router_aux_loss_coef = 0.9;
  if (name == "gpt-oss-20b") {
    c.num_layers = 24;
    e.num_experts = 32;
  } else if (name == "gpt-oss-120b") {
    c.num_layers = 36;
    e.num_experts = 128;
  } else {
    throw Error(str("model init '", name, "' is neither a preset nor a JSON object"), "model.init",
                "use gpt-oss-20b, gpt-oss-120b, or {\"hidden_size\": 64, ...}");
  }
  decoder::set_moe(c, e);
  c.layer_types = alternating(c.num_layers);
  return c;
}

// Small enough for a CPU test: 2 layers (sliding, full), 4 experts of which 2 per token.
ModelConfig small_default() {
  ModelConfig c = transformers_defaults();
  c.vocab_size = 512;
  c.hidden_size = 64;
  decoder::MoeConfig e = decoder::moe(c);
  c.intermediate_size = e.moe_intermediate_size = 32;
  c.num_layers = 2;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 16;
  e.num_experts = 4;
  e.num_experts_per_tok = 2;
  decoder::set_moe(c, e);
  c.sliding_window = 8;
  c.max_position_embeddings = 4096;
  c.rope_parameters_json = nlohmann::json{{"rope_type", "yarn"},
                                          {"rope_theta", c.rope_theta},
                                          {"factor", 4.0},
                                          {"beta_fast", 32.0},
                                          {"beta_slow", 1.0},
                                          {"truncate", false},
                                          {"original_max_position_embeddings", 1024}}
                               .dump();
  c.layer_types = alternating(c.num_layers);
  return c;
}

const std::set<std::string>& known_keys() {
  static const std::set<std::string> keys = [] {
    std::set<std::string> k = decoder::common_keys();
    k.insert({"attention_bias", "sliding_window", "num_local_experts", "num_experts", "num_experts_per_tok",
              "experts_per_token", "router_aux_loss_coef", "output_router_logits", "swiglu_limit", "swiglu_alpha",
              "initial_context_length", "quantization_config"});
    return k;
  }();
  return keys;
}

// Reads every GPT-OSS key over `base`, refusing the variants this module does not compute.
ModelConfig apply(const HfConfig& c, ModelConfig base) {
  if (c.has("model_type")) c.expect_model_type("gpt_oss");
  ModelConfig m = std::move(base);
  const bool layers_given = c.has("num_hidden_layers");
  decoder::read_common(c, m, "GPT-OSS", false, true);
  // GptOssConfig: no layer_types means layer i slides when i is even.
  if (!c.has("layer_types") && (layers_given || static_cast<int64_t>(m.layer_types.size()) != m.num_layers))
    m.layer_types = alternating(m.num_layers);
  if (!c.get_bool("attention_bias", true))
    throw Error(str(c.source(), ": attention_bias is false; this module computes GPT-OSS with biases on q, k, v and o"),
                "attention_bias", "use a checkpoint with attention_bias true");
  m.sliding_window = c.get_int("sliding_window", m.sliding_window);
  decoder::MoeConfig e = decoder::moe(m);
  e.num_experts = c.get_int("num_local_experts", c.get_int("num_experts", e.num_experts));
  e.num_experts_per_tok = c.get_int("num_experts_per_tok", c.get_int("experts_per_token", e.num_experts_per_tok));
  if (c.has("num_experts_per_tok") && c.has("experts_per_token") &&
      c.get_int("num_experts_per_tok", 0) != c.get_int("experts_per_token", 0))
    throw Error(str(c.source(), ": num_experts_per_tok ", c.get_int("num_experts_per_tok", 0), " and experts_per_token ",
                    c.get_int("experts_per_token", 0), " differ"),
                "num_experts_per_tok", "set both to the number of experts each token runs");
  e.moe_intermediate_size = m.intermediate_size;
  e.norm_topk_prob = true;
  e.decoder_sparse_step = 1;
  e.mlp_only_layers.clear();
  e.router_aux_loss_coef = c.get_double("router_aux_loss_coef", e.router_aux_loss_coef);
  e.output_router_logits = c.get_bool("output_router_logits", e.output_router_logits);
  decoder::set_moe(m, e);
  return m;
}

decoder::ExpertsLayout experts_layout(const HfConfig& c) {
  decoder::ExpertsLayout e;
  e.fused = true;
  e.swiglu_limit = static_cast<float>(c.get_double("swiglu_limit", 7.0));
  e.swiglu_alpha = static_cast<float>(c.get_double("swiglu_alpha", 1.702));
  if (!(e.swiglu_limit > 0) || !(e.swiglu_alpha > 0))
    throw Error(str(c.source(), ": swiglu_limit ", e.swiglu_limit, " and swiglu_alpha ", e.swiglu_alpha,
                    " must be positive"),
                "swiglu_limit", "GPT-OSS uses 7.0 and 1.702");
  e.mxfp4 = decoder::quantized_mxfp4(c);
  return e;
}

void validate(const ModelConfig& c, const std::string& source) {
  decoder::validate_common(c, source, "GPT-OSS");
  const decoder::MoeConfig& e = decoder::moe(c);
  if (e.num_experts < 1 || e.num_experts_per_tok < 1 || e.num_experts_per_tok > e.num_experts)
    throw Error(str(source, ": num_experts_per_tok ", e.num_experts_per_tok, " of num_local_experts ", e.num_experts,
                    " is not a valid routing"),
                "num_experts_per_tok", "1 <= num_experts_per_tok <= num_local_experts");
  for (const auto& t : c.layer_types)
    if (t == "sliding_attention" && c.sliding_window < 1)
      throw Error(str(source, ": a sliding_attention layer needs sliding_window >= 1, got ", c.sliding_window),
                  "sliding_window", "GPT-OSS slides over 128 keys");
}

ModelConfig config_from_hf(const HfConfig& c) {
  c.expect_model_type("gpt_oss");
  for (const char* key : {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"})
    c.require_int(key);
  ModelConfig m = apply(c, transformers_defaults());
  validate(m, c.source());
  return m;
}

ModelConfig config_from_spec(const std::string& spec, double* init_std) {
  static const decoder::SpecReader reader{"GPT-OSS", &known_keys(), preset, small_default, apply, validate};
  return decoder::config_from_spec(spec, init_std, reader);
}

std::string config_to_json(const ModelConfig& c, const decoder::ExpertsLayout& experts,
                           const std::string& rope_parameters_json, DType dtype) {
  nlohmann::ordered_json j = decoder::common_json(c, rope_parameters_json, "GptOssForCausalLM", "gpt_oss");
  j["layer_types"] = c.layer_types;
  j["sliding_window"] = c.sliding_window;
  j["attention_bias"] = true;
  j["attention_dropout"] = 0.0;
  const decoder::MoeConfig& e = decoder::moe(c);
  j["num_local_experts"] = e.num_experts;
  j["num_experts_per_tok"] = e.num_experts_per_tok;
  j["experts_per_token"] = e.num_experts_per_tok;
  j["router_aux_loss_coef"] = e.router_aux_loss_coef;
  j["output_router_logits"] = e.output_router_logits;
  j["swiglu_limit"] = experts.swiglu_limit;
  j["swiglu_alpha"] = experts.swiglu_alpha;
  j["initializer_range"] = 0.02;
  j["use_cache"] = true;
  j["dtype"] = decoder::hf_dtype_name(dtype);
  return j.dump(2) + "\n";
}

std::string config_to_json_plain(const ModelConfig& c, const std::string& rope_parameters_json, DType dtype) {
  return config_to_json(c, experts_layout(HfConfig::parse("{}", "defaults")), rope_parameters_json, dtype);
}

std::unique_ptr<Plugin> create(const PluginArgs& args) {
  static const decoder::Family family{.name = "gpt_oss",
                                       .qkv_bias = true,
                                       .experts = true,
                                       .sliding_window = true,
                                       .sinks = true,
                                       .o_bias = true,
                                       .experts_layout = experts_layout,
                                       .from_hf = config_from_hf,
                                       .from_spec = config_from_spec,
                                       .to_json = config_to_json_plain,
                                       .to_json_with_experts = config_to_json};
  return decoder::create_model(args, family);
}

}  // namespace
}  // namespace lcx::gpt_oss

LCX_PLUGIN(LCX_SLOT_MODEL, "gpt_oss", "0.1.0",
           "GPT-OSS: sinks, sliding and full layers, biased MoE, MXFP4 checkpoints dequantized; exact forward/backward",
           "ready", lcx::gpt_oss::create)
