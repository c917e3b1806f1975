// PEFT's LoRA adapter folders (adapter_config.json + adapter_model.safetensors) read and written
// with PEFT's own key names, so an adapter moves between lcx and transformers + PEFT unchanged, and
// the merge of an adapter into its base Hugging Face checkpoint (W + scale * B @ A).
//
// Modules are named by their path under a layer ("self_attn.q_proj", "mlp.experts.gate_proj"); the
// standard decoder's seven projections may be named by their last part alone ("q_proj"), as PEFT's
// target_modules names them. Biases trained beside the factors (bias "all", "lora_only") are read and
// written under PEFT's keys. One rank and one alpha for every module; anything else is refused
// naming the adapter_config.json key or the tensor.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <regex>
#include <string>
#include <vector>

#include "lcx/tensor.h"

namespace lcx::peft {

// The standard decoder's projections, in the order a layer runs them: the short names a module
// path's last part may be given by.
const std::vector<std::string>& lora_modules();

struct AdapterConfig {
  int64_t r = 8;
  double lora_alpha = 8;
  double lora_dropout = 0;
  // The names listed (lora_modules() first, in their order, then any other in the order given).
  std::vector<std::string> target_modules;
  bool all_linear = false;                  // written back as the string "all-linear"
  // target_modules given as any other string: a regex a module's whole name must match
  // (module_name; PEFT's re.fullmatch), target_modules then empty.
  std::string target_pattern;
  bool use_rslora = false;
  std::string base_model_name_or_path;
  std::optional<std::vector<std::string>> modules_to_save;  // null when absent
  // PEFT's target_parameters: 3-D parameters adapted directly, by the end of their name
  // ("mlp.experts.gate_up_proj", "mlp.experts.down_proj": GPT-OSS's fused experts), as PEFT's
  // ParamWrapper does; in the order given (which sets their keys: parameter_lora_key).
  std::vector<std::string> target_parameters;
  // PEFT's bias: "none"; "all", every parameter of the base named with "bias" trained; "lora_only",
  // the biases of the adapted modules. Trained biases are saved whole beside the factors
  // (Adapter::biases).
  std::string bias = "none";
  // alpha / r, or alpha / sqrt(r) with use_rslora (PEFT's rank-stabilized scale).
  double scale() const;
};

// One adapted matrix: A [r, in] and B [out, r] in fp32 on the host.
struct LoraPair {
  int64_t layer = 0;
  std::string module;  // "q_proj" (a standard projection's short name), or the module's path
  Tensor a, b;
  // A sparse layer's expert (its gate_proj, up_proj or down_proj: "mlp.experts.5.gate_proj"), or
  // -1 for the layer's own projection.
  int64_t expert = -1;
  // A target parameter ("mlp.experts.gate_up_proj", module then empty) of E experts' [E, in, out]
  // weights, with a [r*E, in] and b [out, r*E] as PEFT's ParamWrapper stores them: expert e's delta
  // is scale * sum_j a[e*r + j, i] b[o, j*E + e] at [e, i, o].
  std::string parameter;
};

struct Adapter {
  AdapterConfig config;
  std::vector<LoraPair> pairs;  // sorted by layer, then expert (the layer's own first), then lora_modules() order
  // Whole tensors of modules_to_save, by the base's name ("lm_head.weight"), in their own dtype.
  std::vector<std::pair<std::string, Tensor>> saved;
  // The biases trained (AdapterConfig::bias), by the base's name ("model.layers.0.self_attn.q_proj.bias").
  // Stored under PEFT's keys: the base model's state_dict name, where a module PEFT wraps holds its
  // own tensors under ".base_layer" ("...self_attn.q_proj.base_layer.bias" of an adapted q_proj).
  std::vector<std::pair<std::string, Tensor>> biases;
};

// PEFT's key of a trained bias of the base (Adapter::biases) in an adapter of these pairs.
std::string bias_key(const Adapter& adapter, const std::string& base_name);

// PEFT's target_modules rule: a list takes a module whose full name ("model.layers.3.self_attn.q_proj")
// equals an entry or ends with "." + entry; "all-linear" every linear module but the output head;
// any other string is a regex the whole name must match (Python's re.fullmatch).
class TargetModules {
 public:
  explicit TargetModules(const AdapterConfig& config);
  bool matches(const std::string& module_name) const;
  // Whether one entry of a list takes `module_name`.
  static bool entry_matches(const std::string& entry, const std::string& module_name);

 private:
  std::vector<std::string> names_;
  bool all_ = false;
  std::shared_ptr<const std::regex> pattern_;
};

// Whether the base's tensor `tensor` ("model.norm.weight") belongs to a module of modules_to_save:
// as PEFT matches them, its module's name ("model.norm") ends with one of the names ("norm" holds
// every norm, "embed_tokens" the embedding).
bool saved_module(const std::vector<std::string>& modules_to_save, const std::string& tensor);
// A module's path under its layer: a path given ("mlp.experts.gate_proj") is itself, one of the
// standard projections' short names is its path ("self_attn.q_proj", "mlp.gate_proj"). With an
// expert (>= 0), that expert's module: its number before the path's last part
// ("mlp.experts.5.gate_proj"; a short name's: "mlp.experts.5." + name).
std::string module_path(const std::string& module, int64_t expert = -1);
// The module's name as PEFT matches target_modules against it: "model.layers.3.self_attn.q_proj"
// (an expert's: "model.layers.3.mlp.experts.5.gate_proj").
std::string module_name(int64_t layer, const std::string& module, int64_t expert = -1);
// The base checkpoint's name of the matrix: "model.layers.3.self_attn.q_proj.weight" (an expert's:
// "model.layers.3.mlp.experts.5.gate_proj.weight", as the Hub's Qwen3-MoE checkpoints store them).
std::string base_weight_name(int64_t layer, const std::string& module, int64_t expert = -1);
// PEFT's key: "base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight" (`which` 'A' or 'B');
// an expert's: "base_model.model.model.layers.3.mlp.experts.5.gate_proj.lora_A.weight".
std::string lora_key(int64_t layer, const std::string& module, char which, int64_t expert = -1);

// PEFT's key of a target parameter's factor. PEFT wraps the parameter's module once per target
// parameter of that module, each wrapper around the one before, so the first listed is innermost:
// "base_model.model.model.layers.3.mlp.experts.base_layer.lora_A.weight" for the first of two on
// mlp.experts, "...mlp.experts.lora_A.weight" for the last.
std::string parameter_lora_key(int64_t layer, const AdapterConfig& config, const std::string& parameter, char which);
// Expert e's delta of a target parameter's factors into w [in, out] (fp32, +=): scale * sum_j
// a[e*r + j, :]^T b[:, j*E + e]^T.
void add_expert_low_rank(float* w, const float* a, const float* b, int64_t e, int64_t E, int64_t in, int64_t out,
                         int64_t r, float scale);
// adapter_config.json's text to a config, validated; `source` names the file in errors.
AdapterConfig parse_config(const std::string& json_text, const std::string& source);
// The config as PEFT writes it (its other keys at PEFT's defaults).
std::string config_json(const AdapterConfig& config);

// Writes dir/adapter_config.json and dir/adapter_model.safetensors (tensors in `dtype`).
void write_adapter(const std::string& dir, const Adapter& adapter, DType dtype = DType::f32);
// Reads and validates a folder: the config, every key a PEFT LoRA key of a target module or a
// modules_to_save tensor, every A [r, in] with its B [out, r].
Adapter read_adapter(const std::string& dir);

// Checks the adapter against a base: `base_shape(name)` is the shape of the base's tensor `name`,
// or nullopt when the base has none; `num_layers` is its config's num_hidden_layers.
void check_against_base(const Adapter& adapter, int64_t num_layers,
                        const std::function<std::optional<Shape>(const std::string&)>& base_shape);

// W += scale * B @ A on fp32 host data: w [out, in], b [out, r], a [r, in].
void add_low_rank(float* w, const float* b, const float* a, int64_t out, int64_t in, int64_t r, float scale);

struct MergeOptions {
  bool overwrite = false;  // write into a non-empty out folder
  bool progress = true;    // a line per layer on stderr
  int threads = 0;         // 0: the machine's cores, at most 16
};

// Writes `out_dir`: the base's weights with every adapted matrix W + scale * B @ A (computed in
// fp32, stored in the base's dtype), modules_to_save replaced, and the base's config.json,
// generation_config.json and tokenizer files copied, so transformers loads it as the base.
void merge(const std::string& base_dir, const std::string& adapter_dir, const std::string& out_dir,
           const MergeOptions& options = {});

}  // namespace lcx::peft
