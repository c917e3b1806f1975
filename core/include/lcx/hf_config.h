// Reading a Hugging Face config.json, model-agnostic: typed getters whose errors name the file and
// the key, plus the few rules transformers applies across model families (rope_theta and
// rope_parameters in transformers 5 against rope_theta and rope_scaling in transformers 4; layer
// types derived from the sliding-window keys; dtype against torch_dtype). A model module maps the
// values onto its ModelConfig and refuses what it does not implement.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace lcx {

class HfConfig {
 public:
  // `path` is a config.json or a folder holding one.
  static HfConfig load(const std::string& path);
  // JSON text from elsewhere (e.g. an init spec); `source` names it in errors.
  static HfConfig parse(const std::string& json_text, const std::string& source);

  const std::string& source() const;
  bool has(const std::string& key) const;  // present and not null
  std::vector<std::string> keys() const;

  int64_t require_int(const std::string& key) const;
  int64_t get_int(const std::string& key, int64_t def) const;
  double get_double(const std::string& key, double def) const;  // integers accepted
  bool get_bool(const std::string& key, bool def) const;
  std::string get_string(const std::string& key, const std::string& def) const;
  std::string raw(const std::string& key) const;  // the value as JSON text; "null" when absent

  // Throws naming the file and the value found when model_type is not `expected`.
  void expect_model_type(const std::string& expected) const;
  // rope_parameters.rope_theta (transformers 5), else top-level rope_theta (4), else `def`.
  double rope_theta(double def) const;
  // The rope parameters as JSON text: transformers 5's rope_parameters, or transformers 4's
  // rope_scaling with rope_theta merged in ("type" also given as "rope_type"); "{}" when none.
  std::string rope_parameters_json() const;
  // layer_types when present (length checked), else as transformers derives it: layers at or
  // above max_window_layers are "sliding_attention" when use_sliding_window and sliding_window.
  std::vector<std::string> layer_types(int64_t num_layers) const;
  // "dtype" (transformers 5) or "torch_dtype" (4), else `def`.
  std::string torch_dtype(const std::string& def) const;

 private:
  struct Impl;
  std::shared_ptr<const Impl> impl_;
};

}  // namespace lcx
