// The qwen2 model module: Qwen2 and Qwen2.5 (model_type "qwen2") on the shared decoder
// (models/common): GQA attention with biases on q, k and v (trained, or frozen base parameters
// under an adapter), no q/k norms, a SwiGLU MLP. Full attention only: use_sliding_window true is
// refused by that key until sliding-window attention exists.
#include <nlohmann/json.hpp>
#include <set>

#include "decoder_config.h"
#include "decoder_model.h"
#include "lcx/error.h"

namespace lcx::qwen2 {
namespace {

// transformers' Qwen2Config defaults, for keys a config.json leaves out.
ModelConfig transformers_defaults() {
  ModelConfig c;
  c.model_type = "qwen2";
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

// The public Qwen2.5 shapes (theta 1e6, 32,768 positions).
ModelConfig preset(const std::string& name) {
  struct Shape {
    const char* name;
    int64_t vocab, hidden, inter, layers, heads, kv;
    bool tied;
  };
  static const Shape shapes[] = {{"qwen2.5-0.5b", 151936, 896, 4864, 24, 14, 2, true},
                                 {"qwen2.5-1.5b", 151936, 1536, 8960, 28, 12, 2, true},
                                 {"qwen2.5-7b", 152064, 3584, 18944, 28, 28, 4, false}};
  for (const auto& s : shapes)
    if (name == s.name) {
      ModelConfig c = transformers_defaults();
      c.vocab_size = s.vocab;
      c.hidden_size = s.hidden;
      c.intermediate_size = s.inter;
      c.num_layers = s.layers;
      c.num_heads = s.heads;
      c.num_kv_heads = s.kv;
      c.head_dim = s.hidden / s.heads;
      c.tie_word_embeddings = s.tied;
      c.rope_theta = 1e6;
      c.layer_types.assign(static_cast<size_t>(c.num_layers), "full_attention");
      return c;
    }
  throw Error(str("model init '", name, "' is neither a preset nor a JSON object"), "model.init",
              "use qwen2.5-0.5b, qwen2.5-1.5b, qwen2.5-7b, or {\"hidden_size\": 256, ...}");
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
  c.rope_theta = 1e6;
  c.tie_word_embeddings = true;
  return c;
}

const std::set<std::string>& known_keys() {
  static const std::set<std::string> keys = [] {
    std::set<std::string> k = decoder::common_keys();
    k.insert({"use_sliding_window", "sliding_window", "max_window_layers"});
    return k;
  }();
  return keys;
}

ModelConfig apply(const HfConfig& c, ModelConfig base) {
  if (c.has("model_type")) c.expect_model_type("qwen2");
  if (c.get_bool("use_sliding_window", false))
    throw Error(str(c.source(), ": use_sliding_window is true; this module computes full causal attention only (no "
                    "sliding window yet)"),
                "use_sliding_window", "use a checkpoint with use_sliding_window false (every Qwen2.5 release)");
  ModelConfig m = std::move(base);
  decoder::read_common(c, m, "Qwen2", true);
  for (size_t l = 0; l < m.layer_types.size(); ++l)
    if (m.layer_types[l] != "full_attention")
      throw Error(str(c.source(), ": layer ", l, " is ", m.layer_types[l], "; this module computes full attention only"),
                  "layer_types", "use a checkpoint with full_attention in every layer");
  return m;
}

void validate(const ModelConfig& c, const std::string& source) { decoder::validate_common(c, source, "Qwen2"); }

ModelConfig config_from_hf(const HfConfig& c) {
  c.expect_model_type("qwen2");
  for (const char* key : {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"})
    c.require_int(key);
  ModelConfig m = apply(c, transformers_defaults());
  validate(m, c.source());
  return m;
}

ModelConfig config_from_spec(const std::string& spec, double* init_std) {
  static const decoder::SpecReader reader{"Qwen2", &known_keys(), preset, small_default, apply, validate};
  return decoder::config_from_spec(spec, init_std, reader);
}

std::string config_to_json(const ModelConfig& c, const std::string& rope_parameters_json, DType dtype) {
  nlohmann::ordered_json j = decoder::common_json(c, rope_parameters_json, "Qwen2ForCausalLM", "qwen2");
  j["attention_dropout"] = 0.0;
  j["use_sliding_window"] = false;
  j["sliding_window"] = nullptr;
  j["max_window_layers"] = c.num_layers;
  j["layer_types"] = c.layer_types;
  j["initializer_range"] = 0.02;
  j["use_cache"] = true;
  j["dtype"] = decoder::hf_dtype_name(dtype);
  return j.dump(2) + "\n";
}

std::unique_ptr<Plugin> create(const PluginArgs& args) {
  static const decoder::Family family{.name = "qwen2", .qkv_bias = true, .from_hf = config_from_hf,
                                       .from_spec = config_from_spec, .to_json = config_to_json};
  return decoder::create_model(args, family);
}

}  // namespace
}  // namespace lcx::qwen2

LCX_PLUGIN(LCX_SLOT_MODEL, "qwen2", "0.1.0", "Qwen2 and Qwen2.5 (q/k/v biases): exact forward/backward, HF checkpoints in and out",
           "ready", lcx::qwen2::create)
