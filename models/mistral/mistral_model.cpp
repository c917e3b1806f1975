// The mistral model module: Mistral (model_type "mistral") on the shared decoder (models/common):
// GQA attention without q/k norms or biases, a SwiGLU MLP. Full attention only: a config whose
// sliding_window is set is refused by that key until sliding-window attention exists.
#include <algorithm>
#include <nlohmann/json.hpp>
#include <set>

#include "decoder_config.h"
#include "decoder_model.h"
#include "lcx/error.h"

namespace lcx::mistral {
namespace {

// transformers' MistralConfig defaults, for keys a config.json leaves out (its sliding_window
// default, 4096, is refused where a config leaves the key out).
ModelConfig transformers_defaults() {
  ModelConfig c;
  c.model_type = "mistral";
  c.vocab_size = 32000;
  c.hidden_size = 4096;
  c.intermediate_size = 14336;
  c.num_layers = 32;
  c.num_heads = 32;
  c.num_kv_heads = 8;
  c.head_dim = 128;
  c.max_position_embeddings = 4096 * 32;
  c.rope_theta = 10000;
  c.rms_norm_eps = 1e-6;
  c.tie_word_embeddings = false;
  c.torch_dtype = "bfloat16";
  return c;
}

// The public shape of Mistral-7B-v0.3 (v0.2's, with the 32,768-token vocabulary).
ModelConfig preset(const std::string& name) {
  if (name != "mistral-7b-v0.3")
    throw Error(str("model init '", name, "' is neither a preset nor a JSON object"), "model.init",
                "use mistral-7b-v0.3, or {\"hidden_size\": 256, ...}");
  ModelConfig c = transformers_defaults();
  c.vocab_size = 32768;
  c.max_position_embeddings = 32768;
  c.rope_theta = 1e6;
  c.rms_norm_eps = 1e-5;
  c.layer_types.assign(static_cast<size_t>(c.num_layers), "full_attention");
  return c;
}

// Small enough for a CPU test (GQA 2, untied as Mistral's releases are).
ModelConfig small_default() {
  ModelConfig c = transformers_defaults();
  c.vocab_size = 1024;
  c.hidden_size = 128;
  c.intermediate_size = 384;
  c.num_layers = 2;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 32;
  c.max_position_embeddings = 32768;
  c.rms_norm_eps = 1e-5;
  return c;
}

const std::set<std::string>& known_keys() {
  static const std::set<std::string> keys = [] {
    std::set<std::string> k = decoder::common_keys();
    k.insert("sliding_window");
    return k;
  }();
  return keys;
}

ModelConfig apply(const HfConfig& c, ModelConfig base) {
  if (c.has("model_type")) c.expect_model_type("mistral");
  ModelConfig m = std::move(base);
  decoder::read_common(c, m, "Mistral", true);
  if (c.has("sliding_window"))
    throw Error(str(c.source(), ": sliding_window is ", c.raw("sliding_window"),
                    "; this module computes full causal attention only (no sliding window yet)"),
                "sliding_window",
                "use a checkpoint whose sliding_window is null (Mistral-7B v0.2 and v0.3), or train within the window "
                "with a copy of config.json that sets it to null");
  return m;
}

void validate(const ModelConfig& c, const std::string& source) { decoder::validate_common(c, source, "Mistral"); }

ModelConfig config_from_hf(const HfConfig& c) {
  c.expect_model_type("mistral");
  for (const char* key : {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"})
    c.require_int(key);
  // Left out, transformers windows at 4096 tokens; only an explicit null is full attention.
  const std::vector<std::string> keys = c.keys();
  if (std::find(keys.begin(), keys.end(), "sliding_window") == keys.end())
    throw Error(str(c.source(), ": sliding_window is absent, so transformers windows attention at 4096 tokens; this "
                    "module computes full causal attention only"),
                "sliding_window", "set \"sliding_window\": null in config.json if the model was trained without one");
  ModelConfig m = apply(c, transformers_defaults());
  validate(m, c.source());
  return m;
}

ModelConfig config_from_spec(const std::string& spec, double* init_std) {
  static const decoder::SpecReader reader{"Mistral", &known_keys(), preset, small_default, apply, validate};
  return decoder::config_from_spec(spec, init_std, reader);
}

std::string config_to_json(const ModelConfig& c, const std::string& rope_parameters_json, DType dtype) {
  nlohmann::ordered_json j = decoder::common_json(c, rope_parameters_json, "MistralForCausalLM", "mistral");
  j["sliding_window"] = nullptr;
  j["attention_dropout"] = 0.0;
  j["initializer_range"] = 0.02;
  j["use_cache"] = true;
  j["dtype"] = decoder::hf_dtype_name(dtype);
  return j.dump(2) + "\n";
}

std::unique_ptr<Plugin> create(const PluginArgs& args) {
  static const decoder::Family family{.name = "mistral", .from_hf = config_from_hf,
                                       .from_spec = config_from_spec, .to_json = config_to_json};
  return decoder::create_model(args, family);
}

}  // namespace
}  // namespace lcx::mistral

LCX_PLUGIN(LCX_SLOT_MODEL, "mistral", "0.1.0", "Mistral (full attention): exact forward/backward, HF checkpoints in and out",
           "ready", lcx::mistral::create)
