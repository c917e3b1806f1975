#include "lcx/hf_config.h"

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "lcx/error.h"
#include "util/file.h"

namespace lcx {

using nlohmann::json;

struct HfConfig::Impl {
  std::string source;
  json j;
};

namespace {

[[noreturn]] void bad(const std::string& source, const std::string& key, const std::string& what) {
  throw Error(str(source, ": ", key, ": ", what), key);
}

}  // namespace

HfConfig HfConfig::load(const std::string& path) {
  std::filesystem::path p(path);
  if (std::filesystem::is_directory(p)) p /= "config.json";
  return parse(read_file(p.string(), "model.path", "point at an HF model folder holding config.json"), p.string());
}

HfConfig HfConfig::parse(const std::string& json_text, const std::string& source) {
  auto impl = std::make_shared<Impl>();
  impl->source = source;
  try {
    impl->j = json::parse(json_text);
  } catch (const json::exception& e) {
    throw Error(str(source, ": not valid JSON: ", e.what()));
  }
  if (!impl->j.is_object()) throw Error(str(source, ": not a JSON object"));
  HfConfig c;
  c.impl_ = std::move(impl);
  return c;
}

const std::string& HfConfig::source() const { return impl_->source; }

bool HfConfig::has(const std::string& key) const {
  return impl_->j.contains(key) && !impl_->j.at(key).is_null();
}

std::vector<std::string> HfConfig::keys() const {
  std::vector<std::string> out;
  for (auto it = impl_->j.begin(); it != impl_->j.end(); ++it) out.push_back(it.key());
  return out;
}

int64_t HfConfig::require_int(const std::string& key) const {
  if (!has(key)) bad(impl_->source, key, "required key is missing");
  return get_int(key, 0);
}

int64_t HfConfig::get_int(const std::string& key, int64_t def) const {
  if (!has(key)) return def;
  const json& v = impl_->j.at(key);
  if (!v.is_number_integer()) bad(impl_->source, key, str("expected an integer, found ", v.dump()));
  return v.get<int64_t>();
}

double HfConfig::get_double(const std::string& key, double def) const {
  if (!has(key)) return def;
  const json& v = impl_->j.at(key);
  if (!v.is_number()) bad(impl_->source, key, str("expected a number, found ", v.dump()));
  return v.get<double>();
}

bool HfConfig::get_bool(const std::string& key, bool def) const {
  if (!has(key)) return def;
  const json& v = impl_->j.at(key);
  if (!v.is_boolean()) bad(impl_->source, key, str("expected true or false, found ", v.dump()));
  return v.get<bool>();
}

std::string HfConfig::get_string(const std::string& key, const std::string& def) const {
  if (!has(key)) return def;
  const json& v = impl_->j.at(key);
  if (!v.is_string()) bad(impl_->source, key, str("expected a string, found ", v.dump()));
  return v.get<std::string>();
}

std::string HfConfig::raw(const std::string& key) const {
  return impl_->j.contains(key) ? impl_->j.at(key).dump() : "null";
}

void HfConfig::expect_model_type(const std::string& expected) const {
  std::string found = get_string("model_type", "");
  if (found != expected)
    throw Error(str(impl_->source, ": model_type is '", found.empty() ? "(missing)" : found, "' but this module reads '",
                    expected, "'"),
                "model_type", str("load it with the model module for '", found, "', or point at a ", expected, " checkpoint"));
}

double HfConfig::rope_theta(double def) const {
  if (has("rope_parameters")) {
    const json& rp = impl_->j.at("rope_parameters");
    if (!rp.is_object()) bad(impl_->source, "rope_parameters", "expected an object");
    if (rp.contains("rope_theta")) {
      if (!rp["rope_theta"].is_number()) bad(impl_->source, "rope_parameters.rope_theta", "expected a number");
      return rp["rope_theta"].get<double>();
    }
  }
  return get_double("rope_theta", def);
}

std::string HfConfig::rope_parameters_json() const {
  if (has("rope_parameters")) {
    const json& rp = impl_->j.at("rope_parameters");
    if (!rp.is_object()) bad(impl_->source, "rope_parameters", "expected an object");
    return rp.dump();
  }
  if (!has("rope_scaling")) return "{}";
  json rs = impl_->j.at("rope_scaling");
  if (!rs.is_object()) bad(impl_->source, "rope_scaling", "expected an object or null");
  if (!rs.contains("rope_type") && rs.contains("type")) rs["rope_type"] = rs["type"];
  if (has("rope_theta") && !rs.contains("rope_theta")) rs["rope_theta"] = impl_->j.at("rope_theta");
  return rs.dump();
}

std::vector<std::string> HfConfig::layer_types(int64_t num_layers) const {
  std::vector<std::string> out;
  if (has("layer_types")) {
    const json& lt = impl_->j.at("layer_types");
    if (!lt.is_array() || static_cast<int64_t>(lt.size()) != num_layers)
      bad(impl_->source, "layer_types", str("expected a list of ", num_layers, " strings (one per layer)"));
    for (const json& t : lt) {
      if (!t.is_string()) bad(impl_->source, "layer_types", str("entry ", t.dump(), " is not a string"));
      out.push_back(t.get<std::string>());
    }
    return out;
  }
  const bool sliding = get_bool("use_sliding_window", false) && has("sliding_window");
  const int64_t first = get_int("max_window_layers", num_layers);
  for (int64_t i = 0; i < num_layers; ++i)
    out.push_back(sliding && i >= first ? "sliding_attention" : "full_attention");
  return out;
}

std::string HfConfig::torch_dtype(const std::string& def) const {
  if (has("dtype")) return get_string("dtype", def);
  return get_string("torch_dtype", def);
}

}  // namespace lcx
