// config.json of a decoder family, the parts every family reads and writes alike: the shape,
// norms, rope, layer types and dtype keys, the variants no family here computes (another
// activation, partial rotary, quantized weights, attention dropout), the shape checks, init specs
// (a preset name or a JSON object of config keys over a small default) and the config.json text.
// A family's own reader adds its keys and its refusals around these.
#pragma once
#include <nlohmann/json.hpp>
#include <set>
#include <string>

#include "lcx/hf_config.h"
#include "lcx/slots/model.h"

namespace lcx::decoder {

// A mixture of experts (Qwen3-MoE's config.json keys; GPT-OSS's num_local_experts), the family part
// of a ModelConfig (ModelConfig::family_json): num_experts 0 for a dense model. A layer is sparse unless
// listed in mlp_only_layers, every decoder_sparse_step-th (transformers' rule); the others run the
// dense MLP of intermediate_size.
struct MoeConfig {
  int64_t num_experts = 0;
  int64_t num_experts_per_tok = 0;
  int64_t moe_intermediate_size = 0;
  bool norm_topk_prob = false;
  int64_t decoder_sparse_step = 1;
  std::vector<int64_t> mlp_only_layers;
  double router_aux_loss_coef = 0;
  bool output_router_logits = false;  // the load-balancing loss joins the trained loss
};
// c's experts (a dense config's: none).
const MoeConfig& moe(const ModelConfig& c);
// Writes e as c's experts.
void set_moe(ModelConfig& c, const MoeConfig& e);
bool sparse(const ModelConfig& c, int64_t layer);
int64_t sparse_layers(const ModelConfig& c);

// The keys every family's config.json may hold; a family adds its own.
const std::set<std::string>& common_keys();
// Reads the common keys over m. head_dim, when the config has none: m.head_dim where
// derive_head_dim is false (Qwen3's fixed default), else hidden_size / num_attention_heads.
// Refuses the variants named above; `display` names the family in messages ("Qwen3"). With
// mxfp4_experts a quantization_config of quant_method "mxfp4" passes (the family dequantizes its
// experts at load); any other is refused.
void read_common(const HfConfig& c, ModelConfig& m, const std::string& display, bool derive_head_dim,
                 bool mxfp4_experts = false);
// Whether config.json's quantization_config is MXFP4 ({"quant_method": "mxfp4", ...}).
bool quantized_mxfp4(const HfConfig& c);
// Shape checks (sizes positive, heads divide, head_dim even, layer types known); `source` names
// the config in messages.
void validate_common(const ModelConfig& c, const std::string& source, const std::string& display);

// How a family turns an init spec into a config.
struct SpecReader {
  std::string display;                          // "Qwen3"
  const std::set<std::string>* keys;            // every key a spec may use (plus "preset")
  ModelConfig (*preset)(const std::string& name);
  ModelConfig (*small_default)();               // a CPU test's shape, for a JSON spec without "preset"
  ModelConfig (*apply)(const HfConfig& c, ModelConfig base);  // the family's keys over base
  void (*validate)(const ModelConfig& c, const std::string& source);
};
// A preset name or a JSON object of config.json keys (which may name a "preset" to start from);
// init_std, when not null, receives initializer_range (0.02 unless the spec sets it).
ModelConfig config_from_spec(const std::string& spec, double* init_std, const SpecReader& r);

// "bfloat16", "float16", "float32".
const char* hf_dtype_name(DType t);
// config.json's leading keys, in transformers 5 form: architectures, model_type, the shape, the
// activation, the norms, the head's tie, rope_parameters (and the top-level rope_theta transformers
// 4 reads). The family adds the rest.
nlohmann::ordered_json common_json(const ModelConfig& c, const std::string& rope_parameters_json,
                                   const std::string& architecture, const std::string& model_type);

}  // namespace lcx::decoder
