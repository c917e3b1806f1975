// The model's shape for a plan, read without loading (or even creating) any weight: config.json
// under [model] path, else [model] init. The model module keeps its own reader for training; a
// plan needs only the shape keys every dense decoder's config.json carries.
#include <cctype>
#include <filesystem>

#include "lcx/error.h"
#include "lcx/hf_config.h"
#include "plan/plan.h"
#include "util/text.h"

namespace lcx {
namespace {

// The public Qwen3 shapes (vocab 151,936, head_dim 128, rope_theta 1e6, 40,960 positions).
std::optional<ModelConfig> qwen3_preset(const std::string& name) {
  struct Shape {
    const char* name;
    int64_t hidden, inter, layers, heads, kv;
    bool tied;
  };
  static const Shape shapes[] = {{"qwen3-0.6b", 1024, 3072, 28, 16, 8, true},
                                 {"qwen3-1.7b", 2048, 6144, 28, 16, 8, true},
                                 {"qwen3-4b", 2560, 9728, 36, 32, 8, true},
                                 {"qwen3-8b", 4096, 12288, 36, 32, 8, false},
                                 {"qwen3-14b", 5120, 17408, 40, 40, 8, false},
                                 {"qwen3-32b", 5120, 25600, 64, 64, 8, false}};
  for (const auto& s : shapes) {
    if (name != s.name) continue;
    ModelConfig c;
    c.model_type = "qwen3";
    c.vocab_size = 151936;
    c.hidden_size = s.hidden;
    c.intermediate_size = s.inter;
    c.num_layers = s.layers;
    c.num_heads = s.heads;
    c.num_kv_heads = s.kv;
    c.head_dim = 128;
    c.max_position_embeddings = 40960;
    c.rope_theta = 1e6;
    c.tie_word_embeddings = s.tied;
    c.layer_types.assign(static_cast<size_t>(s.layers), "full_attention");
    return c;
  }
  return std::nullopt;
}

// The qwen3 module's base for a JSON init spec without a preset (models/qwen3/qwen3_config.cpp).
ModelConfig qwen3_small_default() {
  ModelConfig c;
  c.model_type = "qwen3";
  c.vocab_size = 1024;
  c.hidden_size = 128;
  c.intermediate_size = 384;
  c.num_layers = 2;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 32;
  c.max_position_embeddings = 40960;
  c.tie_word_embeddings = true;
  return c;
}

ModelConfig apply(const HfConfig& h, ModelConfig c) {
  c.model_type = h.get_string("model_type", c.model_type);
  if (c.model_type.find("moe") != std::string::npos)
    throw Error(str(h.source(), ": model_type '", c.model_type, "' has experts; the plan knows dense decoders"),
                "model_type");
  c.vocab_size = h.get_int("vocab_size", c.vocab_size);
  c.hidden_size = h.get_int("hidden_size", c.hidden_size);
  c.intermediate_size = h.get_int("intermediate_size", c.intermediate_size);
  c.num_layers = h.get_int("num_hidden_layers", c.num_layers);
  c.num_heads = h.get_int("num_attention_heads", c.num_heads);
  c.num_kv_heads = h.get_int("num_key_value_heads", h.has("num_attention_heads") ? c.num_heads : c.num_kv_heads);
  c.head_dim = h.get_int("head_dim", c.head_dim > 0 ? c.head_dim : c.hidden_size / std::max<int64_t>(1, c.num_heads));
  c.max_position_embeddings = h.get_int("max_position_embeddings", c.max_position_embeddings);
  c.tie_word_embeddings = h.get_bool("tie_word_embeddings", c.tie_word_embeddings);
  c.rope_theta = h.rope_theta(c.rope_theta);
  c.rope_parameters_json = h.rope_parameters_json();
  c.layer_types = h.layer_types(c.num_layers);
  for (int64_t v : {c.vocab_size, c.hidden_size, c.intermediate_size, c.num_layers, c.num_heads, c.num_kv_heads,
                    c.head_dim})
    if (v <= 0) throw Error(str(h.source(), ": a shape key is missing or not positive"), {}, "check config.json");
  return c;
}

}  // namespace

ModelConfig plan_model_config(const ModelSection& model, std::string* source) {
  namespace fs = std::filesystem;
  if (!model.path.empty() && fs::exists(fs::path(model.path) / "config.json")) {
    if (source) *source = (fs::path(model.path) / "config.json").string();
    return apply(HfConfig::load(model.path), ModelConfig{});
  }
  const std::string& init = model.init;
  if (!init.empty() && init.front() != '{') {
    if (auto c = qwen3_preset(init)) {
      if (source) *source = "preset " + init;
      return *c;
    }
    throw Error(str("[model] init '", init, "' is not a preset the plan knows"), "model.init",
                "use qwen3-0.6b, qwen3-1.7b, qwen3-4b, qwen3-8b, qwen3-14b, qwen3-32b, or a JSON object");
  }
  if (!init.empty()) {
    HfConfig h = HfConfig::parse(init, "[model] init");
    ModelConfig base = qwen3_small_default();
    if (h.has("preset")) {
      const std::string name = h.get_string("preset", "");
      auto c = qwen3_preset(name);
      if (!c) throw Error(str("[model] init: preset '", name, "' is not one the plan knows"), "model.init");
      base = *c;
    }
    if (source) *source = "[model] init";
    return apply(h, base);
  }
  if (!model.path.empty()) {
    // A plan is often made before the checkpoint is downloaded: a folder named after a public
    // model (models/Qwen3-8B) has that model's shape.
    std::string folder = fs::path(model.path).lexically_normal().filename().string();
    if (folder.empty()) folder = fs::path(model.path).lexically_normal().parent_path().filename().string();
    for (auto& ch : folder) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
    if (auto c = qwen3_preset(folder)) {
      if (source) *source = str("the public ", folder, " shape (", model.path, " has no config.json here)");
      return *c;
    }
    throw Error(str("[model] path '", model.path, "' has no config.json here, and the plan needs the model's shape"),
                "model.path",
                "point path at a model folder, or give a shape with --set model.path= --set model.init=qwen3-8b");
  }
  throw Error("the manifest names no model ([model] path or init)", "model",
              "set [model] path to a Hugging Face folder or [model] init to a preset such as qwen3-8b");
}

}  // namespace lcx
