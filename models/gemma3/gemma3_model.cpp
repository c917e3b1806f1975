// The gemma3_text model module: Gemma 3's language model (model_type "gemma3_text", and the
// text_config of a "gemma3" checkpoint, whose vision tower is left unread) on the shared decoder
// (models/common), as transformers 5.17's Gemma3ForCausalLM computes it: every RMSNorm reads its
// weight as (1 + w) in fp32, four norms a layer (the attention's and the MLP's outputs normed before
// their residuals), per-head q/k norms, the embedding scaled by sqrt(hidden_size), a GeGLU MLP
// (gelu_pytorch_tanh), scores scaled by query_pre_attn_scalar^-0.5, sliding_attention layers within
// sliding_window rotating with their own base (rope_local_base_freq), full layers with theirs and
// its scaling (linear 8 on the 4B and larger), the head tied to the 262k-token embedding.
#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>
#include <set>
#include <vector>

#include "decoder_config.h"
#include "decoder_model.h"
#include "lcx/error.h"

namespace lcx::gemma3 {
namespace {

using nlohmann::json;

constexpr const char* kSliding = "sliding_attention";
constexpr const char* kFull = "full_attention";

// transformers' Gemma3TextConfig defaults, for keys a config.json leaves out.
ModelConfig transformers_defaults() {
  ModelConfig c;
  c.model_type = "gemma3_text";
  c.vocab_size = 262208;
  c.hidden_size = 2304;
  c.intermediate_size = 9216;
  c.num_layers = 26;
  c.num_heads = 8;
  c.num_kv_heads = 4;
  c.head_dim = 256;
  c.max_position_embeddings = 131072;
  c.rope_theta = 1e6;
  c.rms_norm_eps = 1e-6;
  c.tie_word_embeddings = true;
  c.sliding_window = 4096;
  c.attention_scale = 1.0 / 16.0;  // query_pre_attn_scalar 256
  c.rope_parameters_json = json{{"rope_type", "default"}, {"rope_theta", 1e6}}.dump();
  c.sliding_rope_parameters_json = json{{"rope_type", "default"}, {"rope_theta", 10000.0}}.dump();
  c.torch_dtype = "bfloat16";
  return c;
}

// transformers' rule: every sliding_window_pattern-th layer full, the others sliding.
std::vector<std::string> pattern_layers(int64_t layers, int64_t pattern) {
  std::vector<std::string> t;
  for (int64_t i = 0; i < layers; ++i) t.push_back((i + 1) % pattern != 0 ? kSliding : kFull);
  return t;
}

double scale_of(double query_pre_attn_scalar) { return 1.0 / std::sqrt(query_pre_attn_scalar); }

// The public shapes (the language models of google/gemma-3-{1b,4b,12b,27b}-pt's config.json); a
// Hub folder's name (gemma-3-12b-pt, gemma-3-12b-it) names its shape.
ModelConfig preset(const std::string& spec) {
  std::string name = spec;
  for (const char* suffix : {"-pt", "-it"})
    if (name.size() > 3 && name.substr(name.size() - 3) == suffix) name.resize(name.size() - 3);
  ModelConfig c = transformers_defaults();
  c.head_dim = 256;
  c.attention_scale = scale_of(256);
  c.sliding_window = 1024;
  const json linear8 = {{"rope_type", "linear"}, {"factor", 8.0}, {"rope_theta", 1e6}};
  c.rope_parameters_json = linear8.dump();
  if (name == "gemma-3-1b") {
    c.vocab_size = 262144;
    c.hidden_size = 1152;
    c.intermediate_size = 6912;
    c.num_layers = 26;
    c.num_heads = 4;
    c.num_kv_heads = 1;
    c.sliding_window = 512;
    c.max_position_embeddings = 32768;
    c.rope_parameters_json = json{{"rope_type", "default"}, {"rope_theta", 1e6}}.dump();
  } else if (name == "gemma-3-4b") {
    c.hidden_size = 2560;
    c.intermediate_size = 10240;
    c.num_layers = 34;
    c.num_heads = 8;
    c.num_kv_heads = 4;
  } else if (name == "gemma-3-12b") {
    c.hidden_size = 3840;
    c.intermediate_size = 15360;
    c.num_layers = 48;
    c.num_heads = 16;
    c.num_kv_heads = 8;
  } else if (name == "gemma-3-27b") {
    c.hidden_size = 5376;
    c.intermediate_size = 21504;
    c.num_layers = 62;
    c.num_heads = 32;
    c.num_kv_heads = 16;
    c.head_dim = 128;
    c.attention_scale = scale_of(168);
  } else {
    throw Error(str("model init '", spec, "' is neither a preset nor a JSON object"), "model.init",
                "use gemma-3-1b, gemma-3-4b, gemma-3-12b, gemma-3-27b, or {\"hidden_size\": 256, ...}");
  }
  c.layer_types = pattern_layers(c.num_layers, 6);
  return c;
}

// Small enough for a CPU test, shaped like the real thing (GQA 2, windows, both layer kinds).
ModelConfig small_default() {
  ModelConfig c = transformers_defaults();
  c.vocab_size = 1024;
  c.hidden_size = 128;
  c.intermediate_size = 384;
  c.num_layers = 2;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 32;
  c.attention_scale = scale_of(32);
  c.sliding_window = 16;
  c.layer_types = {kSliding, kFull};
  return c;
}

const std::set<std::string>& known_keys() {
  static const std::set<std::string> keys = {
      "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
      "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
      "rope_theta", "rope_parameters", "rope_scaling", "rope_local_base_freq", "layer_types", "sliding_window",
      "sliding_window_pattern", "query_pre_attn_scalar", "hidden_activation", "hidden_act", "attention_bias",
      "attention_dropout", "final_logit_softcapping", "attn_logit_softcapping", "use_bidirectional_attention",
      "cache_implementation", "torch_dtype", "dtype", "initializer_range", "use_cache", "model_type", "architectures",
      "bos_token_id", "eos_token_id", "pad_token_id", "transformers_version", "partial_rotary_factor"};
  return keys;
}

// A rope object of config.json (transformers 5's per-layer-type entry): refused unless an object.
json rope_object(const HfConfig& c, const json& v, const char* key) {
  if (!v.is_object())
    throw Error(str(c.source(), ": ", key, " is ", v.dump(), ", not an object of rope parameters"), key,
                "give {\"rope_type\": \"default\", \"rope_theta\": ...}");
  return v;
}

// The two layer kinds' rope parameters as transformers' Gemma3TextConfig.convert_rope_params_to_dict
// reads them: rope_parameters per layer type (5), or rope_theta with rope_scaling for the full
// layers and rope_local_base_freq for the sliding ones (4).
void read_rope(const HfConfig& c, ModelConfig& m) {
  json full = json::parse(m.rope_parameters_json), sliding = json::parse(m.sliding_rope_parameters_json);
  if (c.has("rope_parameters")) {
    const json r = json::parse(c.raw("rope_parameters"));
    if (!r.is_object() || (!r.contains(kFull) && !r.contains(kSliding)))
      throw Error(str(c.source(), ": rope_parameters is not keyed by layer type"), "rope_parameters",
                  "give {\"sliding_attention\": {...}, \"full_attention\": {...}} as transformers 5 writes Gemma 3");
    full = json{{"rope_type", "default"}};
    sliding = json{{"rope_type", "default"}};
    if (r.contains(kFull) && !r[kFull].is_null()) full = rope_object(c, r[kFull], "rope_parameters.full_attention");
    if (r.contains(kSliding) && !r[kSliding].is_null())
      sliding = rope_object(c, r[kSliding], "rope_parameters.sliding_attention");
  }
  if (c.has("rope_scaling")) {
    const json s = rope_object(c, json::parse(c.raw("rope_scaling")), "rope_scaling");
    for (const auto& [k, v] : s.items()) full[k == "type" ? "rope_type" : k] = v;
  }
  if (!full.contains("rope_theta")) full["rope_theta"] = c.get_double("rope_theta", 1e6);
  if (!sliding.contains("rope_theta")) sliding["rope_theta"] = c.get_double("rope_local_base_freq", 10000.0);
  if (c.has("rope_theta") && !c.has("rope_parameters")) full["rope_theta"] = c.get_double("rope_theta", 1e6);
  if (c.has("rope_local_base_freq") && !c.has("rope_parameters"))
    sliding["rope_theta"] = c.get_double("rope_local_base_freq", 10000.0);
  if (!full.contains("rope_type")) full["rope_type"] = "default";
  if (!sliding.contains("rope_type")) sliding["rope_type"] = "default";
  if (sliding["rope_type"] != "default")
    throw Error(str(c.source(), ": the sliding layers' rope_type is ", sliding["rope_type"].dump(),
                    "; Gemma 3 rotates them with the default kind (rope_local_base_freq)"),
                "rope_parameters.sliding_attention.rope_type", "use rope_type \"default\" for sliding_attention");
  m.rope_parameters_json = full.dump();
  m.rope_theta = full["rope_theta"].get<double>();
  m.sliding_rope_parameters_json = sliding.dump();
}

// Reads every Gemma 3 text key over `base`, refusing the variants this module does not compute.
ModelConfig apply(const HfConfig& c, ModelConfig base) {
  ModelConfig m = std::move(base);
  m.vocab_size = c.get_int("vocab_size", m.vocab_size);
  m.hidden_size = c.get_int("hidden_size", m.hidden_size);
  m.intermediate_size = c.get_int("intermediate_size", m.intermediate_size);
  const bool layers_given = c.has("num_hidden_layers");
  m.num_layers = c.get_int("num_hidden_layers", m.num_layers);
  m.num_heads = c.get_int("num_attention_heads", m.num_heads);
  m.num_kv_heads = c.get_int("num_key_value_heads", m.num_kv_heads);
  m.head_dim = c.get_int("head_dim", m.head_dim);
  m.max_position_embeddings = c.get_int("max_position_embeddings", m.max_position_embeddings);
  m.rms_norm_eps = c.get_double("rms_norm_eps", m.rms_norm_eps);
  m.tie_word_embeddings = c.get_bool("tie_word_embeddings", m.tie_word_embeddings);
  m.torch_dtype = c.torch_dtype(m.torch_dtype);
  if (c.has("query_pre_attn_scalar")) {
    const double q = c.get_double("query_pre_attn_scalar", 256);
    if (!(q > 0))
      throw Error(str(c.source(), ": query_pre_attn_scalar is ", q, "; it must be positive"), "query_pre_attn_scalar");
    m.attention_scale = scale_of(q);
  }
  read_rope(c, m);
  if (c.has("layer_types")) {
    m.layer_types = c.layer_types(m.num_layers);
  } else if (c.has("sliding_window_pattern") || layers_given || m.layer_types.empty()) {
    const int64_t pattern = c.get_int("sliding_window_pattern", 6);
    if (pattern < 1)
      throw Error(str(c.source(), ": sliding_window_pattern is ", pattern, "; it must be positive"),
                  "sliding_window_pattern");
    m.layer_types = pattern_layers(m.num_layers, pattern);
  }
  if (c.has("sliding_window")) {
    m.sliding_window = c.get_int("sliding_window", m.sliding_window);
  } else {
    const std::vector<std::string> keys = c.keys();
    if (std::find(keys.begin(), keys.end(), "sliding_window") != keys.end()) m.sliding_window = 0;  // null: none
  }

  const std::string act = c.get_string("hidden_activation", "gelu_pytorch_tanh");
  if (act != "gelu_pytorch_tanh")
    throw Error(str(c.source(), ": hidden_activation is '", act, "'; the Gemma 3 MLP here is GeGLU with gelu_pytorch_tanh"),
                "hidden_activation", "use gelu_pytorch_tanh, as every Gemma 3 checkpoint does");
  for (const char* key : {"attn_logit_softcapping", "final_logit_softcapping"})
    if (c.has(key))
      throw Error(str(c.source(), ": ", key, " is ", c.raw(key), "; Gemma 3 has none (Gemma 2's tanh soft-capping) and "
                      "this module does not compute it"),
                  key, "set it to null");
  if (c.get_bool("use_bidirectional_attention", false))
    throw Error(str(c.source(), ": use_bidirectional_attention is true (an encoder's mask); this module trains the "
                    "causal language model"),
                "use_bidirectional_attention", "set it to false");
  if (c.get_bool("attention_bias", false))
    throw Error(str(c.source(), ": attention_bias is true; this module computes Gemma 3 without projection biases"),
                "attention_bias", "use a checkpoint with attention_bias false");
  if (c.get_double("partial_rotary_factor", 1.0) != 1.0)
    throw Error(str(c.source(), ": partial_rotary_factor is ", c.get_double("partial_rotary_factor", 1.0),
                    "; Gemma 3 rotates every dimension of a head"),
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

void validate(const ModelConfig& c, const std::string& source) {
  decoder::validate_common(c, source, "Gemma 3");
  for (const auto& t : c.layer_types)
    if (t == kSliding && c.sliding_window <= 0)
      throw Error(str(source, ": layers are sliding_attention but sliding_window is ", c.sliding_window),
                  "sliding_window", "give sliding_window (Gemma 3: 512 for 1B, 1024 for 4B and larger)");
}

// A "gemma3" checkpoint (Gemma3ForConditionalGeneration): its language model is text_config; the
// vision tower (vision_config) is not computed here and its weights stay unread.
HfConfig text_config_of(const HfConfig& c) {
  if (!c.has("text_config"))
    throw Error(str(c.source(), ": model_type gemma3 without text_config; the language model's keys are in it"),
                "text_config", "use the checkpoint's config.json as transformers wrote it, or model_type gemma3_text");
  json text = json::parse(c.raw("text_config"));
  if (!text.is_object()) throw Error(str(c.source(), ": text_config is not an object"), "text_config");
  // Gemma3Config carries the head's tie at the top; transformers 4's text_config may leave it out.
  if (!text.contains("tie_word_embeddings") && c.has("tie_word_embeddings"))
    text["tie_word_embeddings"] = c.get_bool("tie_word_embeddings", true);
  if (!text.contains("model_type")) text["model_type"] = "gemma3_text";
  return HfConfig::parse(text.dump(), c.source() + " text_config");
}

ModelConfig config_from_hf(const HfConfig& outer) {
  const std::string type = outer.get_string("model_type", "");
  const HfConfig c = type == "gemma3" ? text_config_of(outer) : outer;
  c.expect_model_type("gemma3_text");
  ModelConfig m = apply(c, transformers_defaults());
  validate(m, c.source());
  return m;
}

ModelConfig config_from_spec(const std::string& spec, double* init_std) {
  static const decoder::SpecReader reader{"Gemma 3", &known_keys(), preset, small_default, apply, validate};
  return decoder::config_from_spec(spec, init_std, reader);
}

// Gemma3ForConditionalGeneration's names (transformers 5's "model.language_model.*" and 4's
// "language_model.model.*", the head under either) onto Gemma3ForCausalLM's; the vision tower's
// and the projector's are left unread.
std::string checkpoint_name(const std::string& stored) {
  auto starts = [&](const char* prefix) { return stored.rfind(prefix, 0) == 0; };
  if (starts("vision_tower.") || starts("model.vision_tower.") || starts("multi_modal_projector.") ||
      starts("model.multi_modal_projector."))
    return "";
  for (const std::string prefix : {"model.language_model.", "language_model.model."})
    if (stored.rfind(prefix, 0) == 0) return "model." + stored.substr(prefix.size());
  if (stored == "language_model.lm_head.weight") return "lm_head.weight";
  return stored;
}

std::string config_to_json(const ModelConfig& c, const std::string& rope_parameters_json, DType dtype) {
  json full = json::parse(rope_parameters_json.empty() ? c.rope_parameters_json : rope_parameters_json);
  if (!full.contains("rope_type")) full["rope_type"] = "default";
  if (!full.contains("rope_theta")) full["rope_theta"] = c.rope_theta;
  const json sliding = json::parse(c.sliding_rope_parameters_json.empty() ? json{{"rope_type", "default"}, {"rope_theta", 10000.0}}.dump()
                                                                          : c.sliding_rope_parameters_json);
  const double scalar = c.attention_scale > 0 ? 1.0 / (c.attention_scale * c.attention_scale) : static_cast<double>(c.head_dim);
  nlohmann::ordered_json j;
  j["architectures"] = {"Gemma3ForCausalLM"};
  j["model_type"] = "gemma3_text";
  j["vocab_size"] = c.vocab_size;
  j["hidden_size"] = c.hidden_size;
  j["intermediate_size"] = c.intermediate_size;
  j["num_hidden_layers"] = c.num_layers;
  j["num_attention_heads"] = c.num_heads;
  j["num_key_value_heads"] = c.num_kv_heads;
  j["head_dim"] = c.head_dim;
  j["hidden_activation"] = "gelu_pytorch_tanh";
  j["max_position_embeddings"] = c.max_position_embeddings;
  j["rms_norm_eps"] = c.rms_norm_eps;
  j["tie_word_embeddings"] = c.tie_word_embeddings;
  // An integer where it is one (every Gemma 3's is): transformers 5's config class types it int.
  const double whole = std::round(scalar);
  if (std::abs(scalar - whole) < 1e-6 * whole)
    j["query_pre_attn_scalar"] = static_cast<int64_t>(whole);
  else
    j["query_pre_attn_scalar"] = scalar;
  j["sliding_window"] = c.sliding_window > 0 ? json(c.sliding_window) : json(nullptr);
  j["layer_types"] = c.layer_types;
  j["rope_parameters"] = {{kSliding, sliding}, {kFull, full}};
  // transformers 4 reads these instead.
  j["rope_theta"] = full["rope_theta"];
  j["rope_local_base_freq"] = sliding["rope_theta"];
  if (full["rope_type"] != "default") {
    json scaling = full;
    scaling.erase("rope_theta");
    j["rope_scaling"] = scaling;
  } else {
    j["rope_scaling"] = nullptr;
  }
  j["attention_bias"] = false;
  j["attention_dropout"] = 0.0;
  j["attn_logit_softcapping"] = nullptr;
  j["final_logit_softcapping"] = nullptr;
  j["use_bidirectional_attention"] = false;
  j["initializer_range"] = 0.02;
  j["pad_token_id"] = 0;
  j["eos_token_id"] = 1;
  j["bos_token_id"] = 2;
  j["use_cache"] = true;
  j["dtype"] = decoder::hf_dtype_name(dtype);
  return j.dump(2) + "\n";
}

std::unique_ptr<Plugin> create(const PluginArgs& args) {
  static const decoder::Family family{.name = "gemma3_text",
                                       .qk_norm = true,
                                       .sliding_window = true,
                                       .unit_offset_norms = true,
                                       .sandwich_norms = true,
                                       .scaled_embedding = true,
                                       .activation = ops::GateActivation::gelu_tanh,
                                       .checkpoint_name = checkpoint_name,
                                       .from_hf = config_from_hf,
                                       .from_spec = config_from_spec,
                                       .to_json = config_to_json};
  return decoder::create_model(args, family);
}

}  // namespace
}  // namespace lcx::gemma3

LCX_PLUGIN(LCX_SLOT_MODEL, "gemma3_text", "0.1.0",
           "Gemma 3's language model (gemma3_text, and gemma3 checkpoints' text_config): exact forward/backward, HF "
           "checkpoints in and out",
           "ready", lcx::gemma3::create)
