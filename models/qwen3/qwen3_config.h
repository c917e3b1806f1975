// Qwen3's config.json, both ways: read every key transformers 4 and 5 write (refusing what this
// module does not implement), build configs for random init from presets or explicit keys, and
// write the config.json that transformers' from_pretrained reads back.
#pragma once
#include <string>

#include "lcx/hf_config.h"
#include "lcx/slots/model.h"

namespace lcx::qwen3 {

// A checkpoint's config.json (HfConfig::load of the folder).
ModelConfig config_from_hf(const HfConfig& c);
// A preset name (qwen3-0.6b, qwen3-1.7b, qwen3-4b, qwen3-8b, qwen3-14b, qwen3-32b) or a JSON object of config.json keys
// over a small default shape; the object may name a "preset" to start from. `init_std` receives
// initializer_range (0.02 unless the spec sets it).
ModelConfig config_from_spec(const std::string& spec, double* init_std = nullptr);
// config.json text in transformers 5 form, with the legacy top-level rope_theta for older readers.
std::string config_to_json(const ModelConfig& c, const std::string& rope_parameters_json, DType dtype);
// Shape checks shared by every path (heads divide, head_dim even, sizes positive).
void validate(const ModelConfig& c, const std::string& source);

}  // namespace lcx::qwen3
