// The llama model module: Llama 2 and 3.x (model_type "llama") on the shared decoder
// (models/common): GQA attention without q/k norms or biases, a SwiGLU MLP, the head tied or not.
// Rope scaling (llama3, linear, dynamic) is the PositionalEncoding slot's: core's default computes
// them from the checkpoint's rope parameters.
#include <nlohmann/json.hpp>
#include <set>

#include "decoder_config.h"
#include "decoder_model.h"
#include "lcx/error.h"

namespace lcx::llama {
namespace {

// transformers' LlamaConfig defaults, for keys a config.json leaves out.
ModelConfig transformers_defaults() {
  ModelConfig c;
  c.model_type = "llama";
  c.vocab_size = 32000;
  c.hidden_size = 4096;
  c.intermediate_size = 11008;
  c.num_layers = 32;
  c.num_heads = 32;
  c.num_kv_heads = 32;
  c.head_dim = 128;
  c.max_position_embeddings = 2048;
  c.rope_theta = 10000;
  c.rms_norm_eps = 1e-6;
  c.tie_word_embeddings = false;
  c.torch_dtype = "bfloat16";
  return c;
}

// Llama 3.1's rope scaling: factor 8 over 8,192 trained positions, blended between 1 and 4.
std::string llama31_rope(double theta, double factor) {
  return nlohmann::json{{"rope_type", "llama3"}, {"rope_theta", theta},         {"factor", factor},
                        {"low_freq_factor", 1.0}, {"high_freq_factor", 4.0}, {"original_max_position_embeddings", 8192}}
      .dump();
}

// The public shapes.
ModelConfig preset(const std::string& name) {
  ModelConfig c = transformers_defaults();
  c.rms_norm_eps = 1e-5;
  if (name == "llama-2-7b") {
    c.max_position_embeddings = 4096;
  } else if (name == "llama-3.1-8b" || name == "llama-3.2-1b" || name == "llama-3.2-3b") {
    c.vocab_size = 128256;
    c.num_kv_heads = 8;
    c.rope_theta = 500000;
    c.max_position_embeddings = 131072;
    if (name == "llama-3.1-8b") {
      c.intermediate_size = 14336;
      c.rope_parameters_json = llama31_rope(c.rope_theta, 8.0);
    } else {  // 3.2: smaller, tied, factor 32
      const bool one = name == "llama-3.2-1b";
      c.hidden_size = one ? 2048 : 3072;
      c.intermediate_size = 8192;
      c.num_layers = one ? 16 : 28;
      c.num_heads = one ? 32 : 24;
      c.head_dim = c.hidden_size / c.num_heads;
      c.tie_word_embeddings = true;
      c.rope_parameters_json = llama31_rope(c.rope_theta, 32.0);
    }
  } else {
    throw Error(str("model init '", name, "' is neither a preset nor a JSON object"), "model.init",
                "use llama-2-7b, llama-3.1-8b, llama-3.2-1b, llama-3.2-3b, or {\"hidden_size\": 256, ...}");
  }
  c.layer_types.assign(static_cast<size_t>(c.num_layers), "full_attention");
  return c;
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
  c.rms_norm_eps = 1e-5;
  c.tie_word_embeddings = true;
  return c;
}

const std::set<std::string>& known_keys() {
  static const std::set<std::string> keys = [] {
    std::set<std::string> k = decoder::common_keys();
    k.insert({"attention_bias", "mlp_bias", "pretraining_tp"});
    return k;
  }();
  return keys;
}

// Reads every Llama key over `base`, refusing the variants this module does not compute.
ModelConfig apply(const HfConfig& c, ModelConfig base) {
  if (c.has("model_type")) c.expect_model_type("llama");
  ModelConfig m = std::move(base);
  decoder::read_common(c, m, "Llama", true);
  if (c.get_bool("attention_bias", false))
    throw Error(str(c.source(), ": attention_bias is true (biases on q, k, v and o); this module computes Llama without "
                    "projection biases"),
                "attention_bias", "use a checkpoint with attention_bias false");
  if (c.get_bool("mlp_bias", false))
    throw Error(str(c.source(), ": mlp_bias is true; this module computes the Llama MLP without biases"), "mlp_bias",
                "use a checkpoint with mlp_bias false");
  if (c.get_int("pretraining_tp", 1) != 1)
    throw Error(str(c.source(), ": pretraining_tp is ", c.get_int("pretraining_tp", 1),
                    "; transformers 5 computes the projections whole, as this module does"),
                "pretraining_tp", "set it to 1 (the weights are the same)");
  return m;
}

void validate(const ModelConfig& c, const std::string& source) { decoder::validate_common(c, source, "Llama"); }

ModelConfig config_from_hf(const HfConfig& c) {
  c.expect_model_type("llama");
  for (const char* key : {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"})
    c.require_int(key);
  ModelConfig m = apply(c, transformers_defaults());
  validate(m, c.source());
  return m;
}

ModelConfig config_from_spec(const std::string& spec, double* init_std) {
  static const decoder::SpecReader reader{"Llama", &known_keys(), preset, small_default, apply, validate};
  return decoder::config_from_spec(spec, init_std, reader);
}

std::string config_to_json(const ModelConfig& c, const std::string& rope_parameters_json, DType dtype) {
  nlohmann::ordered_json j = decoder::common_json(c, rope_parameters_json, "LlamaForCausalLM", "llama");
  j["attention_bias"] = false;
  j["attention_dropout"] = 0.0;
  j["mlp_bias"] = false;
  j["pretraining_tp"] = 1;
  j["initializer_range"] = 0.02;
  j["use_cache"] = true;
  j["dtype"] = decoder::hf_dtype_name(dtype);
  return j.dump(2) + "\n";
}

std::unique_ptr<Plugin> create(const PluginArgs& args) {
  static const decoder::Family family{.name = "llama", .from_hf = config_from_hf,
                                       .from_spec = config_from_spec, .to_json = config_to_json};
  return decoder::create_model(args, family);
}

}  // namespace
}  // namespace lcx::llama

LCX_PLUGIN(LCX_SLOT_MODEL, "llama", "0.1.0", "Llama 2 and 3.x: exact forward/backward, HF checkpoints in and out", "ready",
           lcx::llama::create)
