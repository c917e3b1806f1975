// The qwen3 model module: Qwen3 (per-head q/k norms, no biases) and Qwen3-MoE on the shared
// decoder (models/common), with Qwen3's config.json.
#include "decoder_model.h"
#include "qwen3_config.h"

namespace lcx::qwen3 {
namespace {

std::unique_ptr<Plugin> create(const PluginArgs& args) {
  static const decoder::Family family{.name = "qwen3", .qk_norm = true, .experts = true, .from_hf = config_from_hf,
                                       .from_spec = config_from_spec, .to_json = config_to_json};
  return decoder::create_model(args, family);
}

}  // namespace
}  // namespace lcx::qwen3

LCX_PLUGIN(LCX_SLOT_MODEL, "qwen3", "0.1.0", "Qwen3 dense and MoE: exact forward/backward, HF checkpoints in and out",
           "ready", lcx::qwen3::create)
