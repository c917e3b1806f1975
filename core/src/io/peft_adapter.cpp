#include "lcx/peft.h"

#include <cblas.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <sstream>
#include <thread>
#include <tuple>

#include "lcx/error.h"
#include "lcx/hf_config.h"
#include "lcx/safetensors.h"

namespace fs = std::filesystem;
using json = nlohmann::ordered_json;

namespace lcx::peft {

namespace {

constexpr const char* kConfigFile = "adapter_config.json";
constexpr const char* kWeightsFile = "adapter_model.safetensors";
constexpr const char* kPrefix = "base_model.model.";

// An adapter whose weights are not finite would write a model of NaN (merge) or train from it
// (init_from): refused by the tensor's name and element.
void refuse_nonfinite(const std::string& where, const std::string& name, const Tensor& t) {
  if (!is_floating(t.dtype())) return;
  const std::vector<float> v = t.to_floats();
  for (size_t i = 0; i < v.size(); ++i)
    if (!std::isfinite(v[i]))
      throw Error(str(where, ": ", name, " element ", i, " is ", v[i], ": the adapter's weights are not finite"), name,
                  "use an adapter saved before its training diverged (an earlier checkpoint)");
}

// "0-2, 5" for {0, 1, 2, 5}.
std::string layer_ranges(const std::set<int64_t>& layers) {
  std::vector<std::string> parts;
  for (auto it = layers.begin(); it != layers.end();) {
    const int64_t first = *it;
    int64_t last = first;
    for (++it; it != layers.end() && *it == last + 1; ++it) last = *it;
    parts.push_back(first == last ? str(first) : str(first, "-", last));
  }
  std::string out;
  for (const auto& p : parts) out += (out.empty() ? "" : ", ") + p;
  return out.empty() ? "none" : out;
}

std::string read_text(const fs::path& p, const std::string& key, const std::string& fix) {
  std::ifstream in(p, std::ios::binary);
  if (!in) throw Error(str("cannot read ", p.string()), key, fix);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

int module_rank(const std::string& m) {
  const auto& all = lora_modules();
  const auto it = std::find(all.begin(), all.end(), m);
  return it == all.end() ? -1 : static_cast<int>(it - all.begin());
}

std::string joined(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : " ") + x;
  return s;
}

// The names in first-seen order, each once.
std::string joined_once(const std::vector<std::string>& v) {
  std::vector<std::string> once;
  for (const auto& x : v)
    if (std::find(once.begin(), once.end(), x) == once.end()) once.push_back(x);
  return joined(once);
}

// "model.layers.3.self_attn.q_proj.lora_A.weight" -> layer 3, "q_proj", 'A'; false when `rest` is
// not of that form.
bool parse_lora_name(const std::string& rest, int64_t& layer, std::string& module, char& which, int64_t& expert) {
  expert = -1;
  const std::string head = "model.layers.";
  if (rest.rfind(head, 0) != 0) return false;
  size_t at = head.size(), end = at;
  while (end < rest.size() && std::isdigit(static_cast<unsigned char>(rest[end]))) ++end;
  if (end == at || end - at > 6 || end >= rest.size() || rest[end] != '.') return false;
  layer = std::stoll(rest.substr(at, end - at));
  const std::string tail = rest.substr(end + 1);
  for (const char w : {'A', 'B'}) {
    const std::string suffix = str(".lora_", w, ".weight");
    if (tail.size() <= suffix.size() || tail.compare(tail.size() - suffix.size(), suffix.size(), suffix) != 0)
      continue;
    std::string path = tail.substr(0, tail.size() - suffix.size());
    // One expert of a sparse layer: "mlp.experts.5.gate_proj" (transformers' Hub names).
    const std::string experts = "mlp.experts.";
    if (path.rfind(experts, 0) == 0) {
      size_t e0 = experts.size(), e1 = e0;
      while (e1 < path.size() && std::isdigit(static_cast<unsigned char>(path[e1]))) ++e1;
      if (e1 > e0 && e1 - e0 <= 6 && e1 < path.size() && path[e1] == '.') {
        const std::string m = path.substr(e1 + 1);
        if (module_rank(m) >= 4) {
          expert = std::stoll(path.substr(e0, e1 - e0));
          module = m;
          which = w;
          return true;
        }
      }
    }
    for (const auto& m : lora_modules())
      if (path == module_path(m)) {
        module = m;
        which = w;
        return true;
      }
    // Any other module by its path; a standard projection's short name under another path
    // ("mlp.experts.5.q_proj" is no q_proj) is refused by its path too.
    module = path;
    which = w;
    return true;
  }
  return false;
}

}  // namespace

const std::vector<std::string>& lora_modules() {
  static const std::vector<std::string> m = {"q_proj", "k_proj", "v_proj", "o_proj",
                                             "gate_proj", "up_proj", "down_proj"};
  return m;
}

double AdapterConfig::scale() const {
  return use_rslora ? lora_alpha / std::sqrt(static_cast<double>(r)) : lora_alpha / static_cast<double>(r);
}

bool saved_module(const std::vector<std::string>& modules_to_save, const std::string& tensor) {
  const size_t dot = tensor.rfind('.');
  const std::string module = dot == std::string::npos ? tensor : tensor.substr(0, dot);
  for (const auto& m : modules_to_save)
    if (module.ends_with(m)) return true;
  return false;
}

std::string module_path(const std::string& module, int64_t expert) {
  const size_t dot = module.rfind('.');
  if (dot != std::string::npos) return expert < 0 ? module : str(module.substr(0, dot + 1), expert, module.substr(dot));
  if (expert >= 0) return str("mlp.experts.", expert, ".", module);
  return (module_rank(module) < 4 ? "self_attn." : "mlp.") + module;
}

TargetModules::TargetModules(const AdapterConfig& config) : names_(config.target_modules), all_(config.all_linear) {
  if (!config.target_pattern.empty()) pattern_ = std::make_shared<const std::regex>(config.target_pattern);
}

bool TargetModules::entry_matches(const std::string& entry, const std::string& module_name) {
  return module_name == entry || (module_name.size() > entry.size() && module_name.ends_with(entry) &&
                                  module_name[module_name.size() - entry.size() - 1] == '.');
}

bool TargetModules::matches(const std::string& module_name) const {
  if (pattern_) return std::regex_match(module_name, *pattern_);
  if (all_) return true;
  return std::any_of(names_.begin(), names_.end(), [&](const std::string& e) { return entry_matches(e, module_name); });
}

std::string module_name(int64_t layer, const std::string& module, int64_t expert) {
  return str("model.layers.", layer, ".", module_path(module, expert));
}

std::string base_weight_name(int64_t layer, const std::string& module, int64_t expert) {
  return module_name(layer, module, expert) + ".weight";
}

// "mlp.experts" of "mlp.experts.gate_up_proj".
std::string parameter_module(const std::string& parameter) {
  const size_t dot = parameter.rfind('.');
  return dot == std::string::npos ? std::string() : parameter.substr(0, dot);
}

std::string parameter_lora_key(int64_t layer, const AdapterConfig& config, const std::string& parameter, char which) {
  const std::string module = parameter_module(parameter);
  int64_t outer = 0;  // target parameters of the same module listed after this one: its wrappers
  bool seen = false;
  for (const std::string& t : config.target_parameters) {
    if (t == parameter) seen = true;
    else if (seen && parameter_module(t) == module) ++outer;
  }
  std::string path = module;
  for (int64_t i = 0; i < outer; ++i) path += ".base_layer";
  return str(kPrefix, "model.layers.", layer, ".", path, ".lora_", which, ".weight");
}

std::string bias_key(const Adapter& adapter, const std::string& base_name) {
  const size_t dot = base_name.rfind('.');
  if (dot == std::string::npos) return kPrefix + base_name;
  const std::string module = base_name.substr(0, dot);
  // PEFT wraps each adapted module once (its tensors then under ".base_layer"), and a module of
  // target parameters once per parameter it adapts there.
  int64_t wraps = 0;
  for (const LoraPair& p : adapter.pairs) {
    if (p.parameter.empty() && p.expert < 0 && module_name(p.layer, p.module) == module) wraps = std::max<int64_t>(wraps, 1);
  }
  for (const std::string& t : adapter.config.target_parameters)
    for (const LoraPair& p : adapter.pairs)
      if (p.parameter == t && str("model.layers.", p.layer, ".", parameter_module(t)) == module) {
        ++wraps;
        break;
      }
  std::string key = kPrefix + module;
  for (int64_t i = 0; i < wraps; ++i) key += ".base_layer";
  return key + base_name.substr(dot);
}

void add_expert_low_rank(float* w, const float* a, const float* b, int64_t e, int64_t E, int64_t in, int64_t out,
                         int64_t r, float scale) {
  for (int64_t j = 0; j < r; ++j) {
    const float* aj = a + (e * r + j) * in;
    for (int64_t i = 0; i < in; ++i) {
      const float s = scale * aj[i];
      float* wi = w + i * out;
      for (int64_t o = 0; o < out; ++o) wi[o] += s * b[o * r * E + j * E + e];
    }
  }
}

std::string lora_key(int64_t layer, const std::string& module, char which, int64_t expert) {
  return str(kPrefix, "model.layers.", layer, ".", module_path(module, expert), ".lora_", which, ".weight");
}

AdapterConfig parse_config(const std::string& json_text, const std::string& source) {
  json j;
  try {
    j = json::parse(json_text);
  } catch (const json::exception& e) {
    throw Error(str(source, " is not valid JSON: ", e.what()), kConfigFile, "give the adapter_config.json PEFT wrote");
  }
  if (!j.is_object()) throw Error(str(source, " is not a JSON object"), kConfigFile, "give the adapter_config.json PEFT wrote");
  auto bad = [&](const std::string& key, const std::string& what, const std::string& fix) {
    const std::string found = j.contains(key) ? j[key].dump() : "absent";
    return Error(str(source, ": ", key, " ", what, " (found ", found, ")"), key, fix);
  };
  AdapterConfig c;
  if (!j.contains("peft_type") || !j["peft_type"].is_string() || j["peft_type"] != "LORA")
    throw bad("peft_type", "must be \"LORA\": lcx reads LoRA adapters only", "give a LoRA adapter (peft_type \"LORA\")");
  if (j.contains("task_type") && !j["task_type"].is_null() && j["task_type"] != "CAUSAL_LM")
    throw bad("task_type", "must be \"CAUSAL_LM\"", "give an adapter trained for causal language modeling");
  if (!j.contains("r") || !j["r"].is_number_integer() || j["r"].get<int64_t>() < 1)
    throw bad("r", "must be an integer of at least 1", "set r to the adapter's rank, e.g. 16");
  c.r = j["r"].get<int64_t>();
  if (j.contains("lora_alpha") && !j["lora_alpha"].is_null()) {
    if (!j["lora_alpha"].is_number()) throw bad("lora_alpha", "must be a number", "set lora_alpha, e.g. 32");
    c.lora_alpha = j["lora_alpha"].get<double>();
  }
  if (j.contains("lora_dropout") && !j["lora_dropout"].is_null()) {
    if (!j["lora_dropout"].is_number() || j["lora_dropout"].get<double>() < 0 || j["lora_dropout"].get<double>() >= 1)
      throw bad("lora_dropout", "must be a number in [0, 1)", "set lora_dropout to e.g. 0.05");
    c.lora_dropout = j["lora_dropout"].get<double>();
  }
  if (j.contains("use_rslora") && !j["use_rslora"].is_null()) {
    if (!j["use_rslora"].is_boolean()) throw bad("use_rslora", "must be true or false", "set use_rslora to true or false");
    c.use_rslora = j["use_rslora"].get<bool>();
  }
  if (j.contains("bias") && !j["bias"].is_null()) {
    const std::string bias = j["bias"].is_string() ? j["bias"].get<std::string>() : std::string();
    if (bias != "none" && bias != "all" && bias != "lora_only")
      throw bad("bias", "must be \"none\", \"all\" or \"lora_only\"", "train the adapter with one of PEFT's bias settings");
    c.bias = bias;
  }
  if (j.contains("use_dora") && j["use_dora"].is_boolean() && j["use_dora"].get<bool>())
    throw bad("use_dora", "is not supported: a DoRA adapter rescales W, which lcx does not implement",
              "give a plain LoRA adapter (use_dora false)");
  if (j.contains("fan_in_fan_out") && j["fan_in_fan_out"].is_boolean() && j["fan_in_fan_out"].get<bool>())
    throw bad("fan_in_fan_out", "must be false: lcx's linear modules hold W as nn.Linear does, [out, in]", "set fan_in_fan_out to false");
  for (const char* key : {"rank_pattern", "alpha_pattern"})
    if (j.contains(key) && !j[key].is_null() && !(j[key].is_object() && j[key].empty()))
      throw bad(key, "is not supported: lcx uses one r and one lora_alpha for every module",
                str("give an adapter with an empty ", key));
  const std::string examples = "the layers' linear modules, e.g. q_proj v_proj";
  if (!j.contains("target_modules") || j["target_modules"].is_null())
    throw bad("target_modules", "must be given", str("set target_modules to a list of ", examples, ", or \"all-linear\""));
  const json& t = j["target_modules"];
  std::set<int> chosen;
  std::vector<std::string> others;
  if (t.is_string() && t != "all-linear") {
    c.target_pattern = t.get<std::string>();
    try {
      std::regex check(c.target_pattern);
    } catch (const std::regex_error& e) {
      throw bad("target_modules", str("'", c.target_pattern, "' is not a regex (", e.what(), ")"),
                str("list ", examples, ", give \"all-linear\", or a regex of module names"));
    }
  } else if (t.is_string()) {
    c.all_linear = true;
    for (size_t i = 0; i < lora_modules().size(); ++i) chosen.insert(static_cast<int>(i));
  } else if (t.is_array() && !t.empty()) {
    for (const auto& m : t) {
      const std::string name = m.is_string() ? m.get<std::string>() : std::string();
      // The output head is no layer's module: lcx trains it whole (modules_to_save) or not at all.
      if (name.empty() || TargetModules::entry_matches(name, "lm_head") || name.ends_with(".lm_head"))
        throw Error(str(source, ": target_modules names ", m.dump(), ", which is not a linear module of a layer lcx adapts"),
                    "target_modules", str("keep only ", examples, " (the head trains whole through modules_to_save)"));
      const int rank = module_rank(name);
      if (rank >= 0) chosen.insert(rank);
      else if (std::find(others.begin(), others.end(), name) == others.end()) others.push_back(name);
    }
  } else {
    throw bad("target_modules", "must be a non-empty list or \"all-linear\"",
              str("set target_modules to a list of ", examples, ", or \"all-linear\""));
  }
  for (const int i : chosen) c.target_modules.push_back(lora_modules()[static_cast<size_t>(i)]);
  c.target_modules.insert(c.target_modules.end(), others.begin(), others.end());
  if (j.contains("target_parameters") && !j["target_parameters"].is_null()) {
    const json& tp = j["target_parameters"];
    if (!tp.is_array())
      throw bad("target_parameters", "must be null or a list of parameter names", "e.g. [\"mlp.experts.gate_up_proj\"]");
    for (const auto& x : tp) {
      if (!x.is_string() || parameter_module(x.get<std::string>()).empty())
        throw bad("target_parameters", str("names ", x.dump(), ", not a parameter of a module"),
                  "name parameters as PEFT does: \"mlp.experts.gate_up_proj\", \"mlp.experts.down_proj\"");
      c.target_parameters.push_back(x.get<std::string>());
    }
    if (!c.target_parameters.empty() && c.lora_dropout != 0)
      throw bad("lora_dropout", "must be 0 with target_parameters (PEFT's ParamWrapper cannot drop its input)",
                "set lora_dropout to 0");
  }
  if (j.contains("base_model_name_or_path") && j["base_model_name_or_path"].is_string())
    c.base_model_name_or_path = j["base_model_name_or_path"].get<std::string>();
  if (j.contains("modules_to_save") && !j["modules_to_save"].is_null()) {
    if (!j["modules_to_save"].is_array())
      throw bad("modules_to_save", "must be null or a list of module names", "set modules_to_save to null or a list");
    std::vector<std::string> m;
    for (const auto& x : j["modules_to_save"]) {
      if (!x.is_string()) throw bad("modules_to_save", "must list names", "set modules_to_save to e.g. [\"lm_head\"]");
      m.push_back(x.get<std::string>());
    }
    c.modules_to_save = m;
  }
  return c;
}

std::string config_json(const AdapterConfig& c) {
  json j;
  j["alpha_pattern"] = json::object();
  j["auto_mapping"] = nullptr;
  j["base_model_name_or_path"] = c.base_model_name_or_path.empty() ? json(nullptr) : json(c.base_model_name_or_path);
  j["bias"] = c.bias;
  j["fan_in_fan_out"] = false;
  j["inference_mode"] = true;
  j["init_lora_weights"] = true;
  j["layers_pattern"] = nullptr;
  j["layers_to_transform"] = nullptr;
  if (c.lora_alpha == std::floor(c.lora_alpha) && std::abs(c.lora_alpha) < 1e15)
    j["lora_alpha"] = static_cast<int64_t>(c.lora_alpha);
  else
    j["lora_alpha"] = c.lora_alpha;
  j["lora_dropout"] = c.lora_dropout;
  j["modules_to_save"] = c.modules_to_save ? json(*c.modules_to_save) : json(nullptr);
  j["peft_type"] = "LORA";
  j["r"] = c.r;
  j["rank_pattern"] = json::object();
  j["revision"] = nullptr;
  j["target_modules"] = c.all_linear                  ? json("all-linear")
                        : !c.target_pattern.empty() ? json(c.target_pattern)
                                                    : json(c.target_modules);
  j["target_parameters"] = c.target_parameters.empty() ? json(nullptr) : json(c.target_parameters);
  j["task_type"] = "CAUSAL_LM";
  j["use_dora"] = false;
  j["use_rslora"] = c.use_rslora;
  return j.dump(2) + "\n";
}

void write_adapter(const std::string& dir, const Adapter& adapter, DType dtype) {
  // Validates what is written the way read_adapter would, so a folder written is one it reads.
  parse_config(config_json(adapter.config), "the adapter being written");
  fs::create_directories(dir);
  std::vector<safetensors::NamedTensor> tensors;
  for (const auto& p : adapter.pairs) {
    if (!p.parameter.empty()) {
      tensors.push_back({parameter_lora_key(p.layer, adapter.config, p.parameter, 'A'), p.a});
      tensors.push_back({parameter_lora_key(p.layer, adapter.config, p.parameter, 'B'), p.b});
      continue;
    }
    tensors.push_back({lora_key(p.layer, p.module, 'A', p.expert), p.a});
    tensors.push_back({lora_key(p.layer, p.module, 'B', p.expert), p.b});
  }
  for (const auto& [name, t] : adapter.saved) tensors.push_back({kPrefix + name, t});
  for (const auto& [name, t] : adapter.biases) tensors.push_back({bias_key(adapter, name), t});
  safetensors::write_file((fs::path(dir) / kWeightsFile).string(), tensors, dtype);
  std::ofstream(fs::path(dir) / kConfigFile) << config_json(adapter.config);
}

Adapter read_adapter(const std::string& dir) {
  const fs::path config_path = fs::path(dir) / kConfigFile, weights_path = fs::path(dir) / kWeightsFile;
  const std::string fix = "give the folder PEFT's save_pretrained wrote (adapter_config.json, adapter_model.safetensors)";
  if (!fs::is_regular_file(config_path)) throw Error(str(config_path.string(), " does not exist"), "--adapter", fix);
  if (!fs::is_regular_file(weights_path)) throw Error(str(weights_path.string(), " does not exist"), "--adapter", fix);
  Adapter a;
  a.config = parse_config(read_text(config_path, "--adapter", fix), config_path.string());
  const AdapterConfig& c = a.config;
  const auto ckpt = safetensors::Checkpoint::open(weights_path.string());
  // By layer, expert (-1: none), the standard projections' order (the others after them), module.
  std::map<std::tuple<int64_t, int64_t, int>, std::map<std::string, LoraPair>> pairs;
  const std::string where = weights_path.string();
  const TargetModules targets(c);
  auto targeted = [&](int64_t layer, const std::string& module, int64_t expert) {
    return targets.matches(module_name(layer, module, expert));
  };
  std::map<std::pair<int64_t, std::string>, LoraPair> parameter_pairs;
  for (const auto& name : ckpt.names()) {
    if (name.rfind(kPrefix, 0) != 0)
      throw Error(str(where, ": ", name, " is not a PEFT key (they begin with ", kPrefix, ")"), name,
                  "give an adapter PEFT saved for a causal LM");
    const std::string rest = name.substr(std::string(kPrefix).size());
    // A target parameter's factor: its key as parameter_lora_key writes it for the key's layer.
    std::string parameter;
    char which = 0;
    int64_t layer = 0;
    {
      std::string module;
      int64_t expert = -1;
      if (!c.target_parameters.empty() && parse_lora_name(rest, layer, module, which, expert))
        for (const std::string& t : c.target_parameters)
          if (parameter_lora_key(layer, c, t, which) == name) parameter = t;
    }
    if (!parameter.empty()) {
      const Shape& s = ckpt.info(name).shape;
      const bool ok = s.size() == 2 && s[0] > 0 && s[1] > 0 && (which == 'A' ? s[0] % c.r == 0 : s[1] % c.r == 0);
      if (!ok)
        throw Error(str(where, ": ", name, " has shape ", shape_str(s), ", but a target parameter's lora_", which, " is ",
                        which == 'A' ? "[r * experts, in]" : "[out, r * experts]", " with r = ", c.r),
                    name, "give the adapter_config.json saved with these weights (its r)");
      LoraPair& p = parameter_pairs[{layer, parameter}];
      p.layer = layer;
      p.parameter = parameter;
      (which == 'A' ? p.a : p.b) = ckpt.load(name, DType::f32);
      refuse_nonfinite(where, name, which == 'A' ? p.a : p.b);
      continue;
    }
    std::string module;
    int64_t expert = -1;
    if (parse_lora_name(rest, layer, module, which, expert)) {
      // A standard projection's short name under another path than its own is none of them.
      const int rank = module_rank(module);
      const bool misplaced = module.find('.') != std::string::npos && module_rank(module.substr(module.rfind('.') + 1)) >= 0;
      if (misplaced || !targeted(layer, module, expert))
        throw Error(str(where, ": ", name, " adapts ", module, ", which target_modules (",
                        c.target_pattern.empty() ? joined(c.target_modules) : "'" + c.target_pattern + "'", ") does not match"),
                    name, "give the adapter_config.json saved with these weights");
      const Shape& s = ckpt.info(name).shape;
      const bool ok = s.size() == 2 && (which == 'A' ? s[0] == c.r : s[1] == c.r) && s[0] > 0 && s[1] > 0;
      if (!ok)
        throw Error(str(where, ": ", name, " has shape ", shape_str(s), ", but lora_", which, " is ",
                        which == 'A' ? "[r, in]" : "[out, r]", " with r = ", c.r),
                    name, "give the adapter_config.json saved with these weights (its r)");
      LoraPair& p = pairs[{layer, expert, rank >= 0 ? rank : static_cast<int>(lora_modules().size())}][module];
      p.layer = layer;
      p.expert = expert;
      p.module = module;
      (which == 'A' ? p.a : p.b) = ckpt.load(name, DType::f32);
      refuse_nonfinite(where, name, which == 'A' ? p.a : p.b);
      continue;
    }
    // A trained bias (bias "all" or "lora_only"): the base's tensor, under the module PEFT wrapped.
    if (c.bias != "none" && rest.find("bias") != std::string::npos) {
      std::string base = rest;
      for (size_t at; (at = base.find(".base_layer.")) != std::string::npos;) base.erase(at, 11);
      a.biases.emplace_back(base, ckpt.load(name, DType::f32));
      refuse_nonfinite(where, name, a.biases.back().second);
      continue;
    }
    const bool saved = c.modules_to_save && saved_module(*c.modules_to_save, rest);
    if (!saved)
      throw Error(str(where, ": ", name, " is neither a LoRA key of a target module nor a tensor of modules_to_save"),
                  name, "give an adapter PEFT saved for a causal LM");
    const std::string dtype = ckpt.info(name).dtype;
    a.saved.emplace_back(rest, ckpt.load(name, dtype_from_name(dtype)));
    refuse_nonfinite(where, name, a.saved.back().second);
  }
  for (auto& [k, p] : parameter_pairs) {
    if (!p.a.data() || !p.b.data() || p.a.shape()[0] != p.b.shape()[1])
      throw Error(str(where, ": ", parameter_lora_key(p.layer, c, p.parameter, 'A'), " and its lora_B do not pair (",
                      p.a.data() ? shape_str(p.a.shape()) : "absent", ", ", p.b.data() ? shape_str(p.b.shape()) : "absent", ")"),
                  parameter_lora_key(p.layer, c, p.parameter, p.a.data() ? 'B' : 'A'), "give the adapter's whole safetensors file");
    a.pairs.push_back(std::move(p));
  }
  for (auto& [k, by_module] : pairs)
    for (auto& [m, p] : by_module) {
      if (!p.a.data() || !p.b.data()) {
        const char missing = p.a.data() ? 'B' : 'A';
        throw Error(str(where, ": ", lora_key(p.layer, p.module, missing == 'A' ? 'B' : 'A', p.expert), " has no lora_", missing),
                    lora_key(p.layer, p.module, missing, p.expert), "give the adapter's whole safetensors file");
      }
      a.pairs.push_back(std::move(p));
    }
  if (a.pairs.empty())
    throw Error(str(where, " holds no LoRA weights"), "--adapter", fix);
  return a;
}

void check_against_base(const Adapter& adapter, int64_t num_layers,
                        const std::function<std::optional<Shape>(const std::string&)>& base_shape) {
  const std::string fix = "merge the adapter into the base it was trained on";
  for (const auto& p : adapter.pairs) {
    if (!p.parameter.empty()) {  // [E, in, out]: a [r*E, in], b [out, r*E]
      const std::string key = parameter_lora_key(p.layer, adapter.config, p.parameter, 'A');
      const std::string base = str("model.layers.", p.layer, ".", p.parameter);
      if (p.layer >= num_layers)
        throw Error(str(key, " names layer ", p.layer, ", but the base has ", num_layers, " layers"), key, fix);
      const auto s = base_shape(base);
      if (!s) throw Error(str(key, ": the base has no ", base), key, fix);
      const int64_t r = adapter.config.r;
      if (s->size() != 3 || p.a.shape() != Shape{(*s)[0] * r, (*s)[1]} || p.b.shape() != Shape{(*s)[2], (*s)[0] * r})
        throw Error(str(key, " and its lora_B are ", shape_str(p.a.shape()), " and ", shape_str(p.b.shape()), ", but the base's ",
                        base, " is ", shape_str(*s), ": they must be [r * experts, in] and [out, r * experts]"),
                    key, fix);
      continue;
    }
    const std::string key = lora_key(p.layer, p.module, 'A', p.expert);
    if (p.layer >= num_layers)
      throw Error(str(key, " names layer ", p.layer, ", but the base has ", num_layers, " layers"), key, fix);
    const auto s = base_shape(base_weight_name(p.layer, p.module, p.expert));
    if (!s)
      throw Error(str(key, ": the base has no ", base_weight_name(p.layer, p.module, p.expert)), key, fix);
    if (s->size() != 2 || p.a.shape()[1] != (*s)[1])
      throw Error(str(key, " has shape ", shape_str(p.a.shape()), ", but the base's ", base_weight_name(p.layer, p.module, p.expert),
                      " is ", shape_str(*s), ": lora_A must be [r, ", s->size() == 2 ? (*s)[1] : 0, "]"),
                  key, fix);
    const std::string bkey = lora_key(p.layer, p.module, 'B', p.expert);
    if (p.b.shape()[0] != (*s)[0])
      throw Error(str(bkey, " has shape ", shape_str(p.b.shape()), ", but the base's ", base_weight_name(p.layer, p.module, p.expert),
                      " is ", shape_str(*s), ": lora_B must be [", (*s)[0], ", r]"),
                  bkey, fix);
  }
  for (const auto& [name, t] : adapter.biases) {
    const auto s = base_shape(name);
    if (!s || *s != t.shape())
      throw Error(str(bias_key(adapter, name), " (bias \"", adapter.config.bias, "\") has shape ", shape_str(t.shape()),
                      ", but the base ", s ? "has " + shape_str(*s) + " for " + name : "has no " + name),
                  bias_key(adapter, name), fix);
  }
  for (const auto& [name, t] : adapter.saved) {
    const auto s = base_shape(name);
    if (!s || *s != t.shape())
      throw Error(str(kPrefix, name, " (modules_to_save) has shape ", shape_str(t.shape()), ", but the base ",
                      s ? "has " + shape_str(*s) : std::string("has no such tensor")),
                  kPrefix + name, fix);
  }
}

// The layers of the base whose tensors hold `module` (experts' or not): a mixture of experts has a
// dense MLP in some layers and experts in the others.
static std::set<int64_t> layers_holding(const std::vector<std::string>& base_names, const std::string& module, bool experts) {
  std::set<int64_t> out;
  for (const std::string& name : base_names) {
    const size_t at = name.find("layers.");
    if (at == std::string::npos || (name.find(".experts.") != std::string::npos) != experts) continue;
    if (name.find("." + module + ".") == std::string::npos) continue;
    int64_t l = 0;
    size_t i = at + 7;
    if (i >= name.size() || !std::isdigit(static_cast<unsigned char>(name[i]))) continue;
    for (; i < name.size() && std::isdigit(static_cast<unsigned char>(name[i])); ++i) l = l * 10 + (name[i] - '0');
    out.insert(l);
  }
  return out;
}

// Each adapted module has a pair in every layer PEFT adapts that holds it: those of
// adapter_config.json's layers_to_transform, else all of the base's. Fewer means the base is not the
// one it was trained on (a deeper model of the same widths) or the file lost layers: a merge of part
// of the layers would be a model neither of them is.
static void check_layers_adapted(const Adapter& adapter, const std::string& adapter_dir, const std::string& base_dir,
                          int64_t num_layers, const std::vector<std::string>& base_names) {
  const fs::path config_path = fs::path(adapter_dir) / kConfigFile;
  const json j = json::parse(read_text(config_path, "--adapter", "give the adapter's folder"), nullptr, false);
  std::set<int64_t> want;
  std::string whose = str("the base's ", num_layers, " layers (", base_dir, ")");
  const json none;
  const json& listed = j.is_object() && j.contains("layers_to_transform") ? j["layers_to_transform"] : none;
  if (listed.is_number_integer()) {
    want.insert(listed.get<int64_t>());
  } else if (listed.is_array()) {
    for (const auto& x : listed) {
      if (!x.is_number_integer())
        throw Error(str(config_path.string(), ": layers_to_transform holds ", x.dump(), ", not a layer index"),
                    "layers_to_transform", "give a list of layer indices, or null for every layer");
      want.insert(x.get<int64_t>());
    }
  } else if (!listed.is_null()) {
    throw Error(str(config_path.string(), ": layers_to_transform is ", listed.dump()), "layers_to_transform",
                "give a layer index, a list of them, or null for every layer");
  }
  if (!listed.is_null()) {
    whose = str("layers_to_transform of ", config_path.string());
    for (const int64_t l : want)
      if (l < 0 || l >= num_layers)
        throw Error(str(config_path.string(), ": layers_to_transform names layer ", l, ", but the base has ", num_layers,
                        " layers (", base_dir, ")"),
                    "--base", "merge the adapter into the base it was trained on");
  } else {
    for (int64_t l = 0; l < num_layers; ++l) want.insert(l);
  }
  std::map<std::string, std::set<int64_t>> layers;
  for (const auto& p : adapter.pairs)
    layers[!p.parameter.empty() ? "parameter." + p.parameter : p.expert >= 0 ? "experts." + p.module : p.module].insert(p.layer);
  for (const auto& [module, got] : layers) {
    const bool experts = module.starts_with("experts.");
    std::set<int64_t> held;
    if (module.starts_with("parameter.")) {  // a target parameter: the layers whose tensor it is
      const std::string parameter = module.substr(10);
      for (int64_t l = 0; l < num_layers; ++l)
        if (std::find(base_names.begin(), base_names.end(), str("model.layers.", l, ".", parameter)) != base_names.end())
          held.insert(l);
    } else {
      held = layers_holding(base_names, experts ? module.substr(8) : module, experts);
    }
    std::set<int64_t> want_here;
    for (const int64_t l : want)
      if (held.count(l)) want_here.insert(l);
    if (got != want_here)
      throw Error(str(adapter_dir, ": the adapter's ", module, " has LoRA weights for layers ", layer_ranges(got), ", but ",
                      whose, " holding it are ", layer_ranges(want_here), ": nothing is merged"),
                  "--base", "merge the adapter into the base it was trained on (the same num_hidden_layers)");
  }
}

void add_low_rank(float* w, const float* b, const float* a, int64_t out, int64_t in, int64_t r, float scale) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(out), static_cast<int>(in),
              static_cast<int>(r), scale, b, static_cast<int>(r), a, static_cast<int>(in), 1.f, w, static_cast<int>(in));
}

void merge(const std::string& base_dir, const std::string& adapter_dir, const std::string& out_dir,
           const MergeOptions& options) {
  if (!fs::is_directory(base_dir) || !fs::is_regular_file(fs::path(base_dir) / "config.json"))
    throw Error(str(base_dir, " is not a Hugging Face model folder (no config.json)"), "--base",
                "give the folder of the model the adapter was trained on");
  std::error_code ec;
  if (fs::exists(out_dir)) {
    if (!fs::is_directory(out_dir))
      throw Error(str(out_dir, " exists and is not a folder"), "--out", "give a new or empty folder");
    if (fs::equivalent(out_dir, base_dir, ec) || fs::equivalent(out_dir, adapter_dir, ec))
      throw Error(str(out_dir, " is the base or the adapter folder"), "--out", "write the merged model to another folder");
    if (!fs::is_empty(out_dir) && !options.overwrite)
      throw Error(str(out_dir, " exists and is not empty"), "--out", "give a new or empty folder, or pass --overwrite");
  }
  const Adapter adapter = read_adapter(adapter_dir);
  const HfConfig hf = HfConfig::load(base_dir);
  const int64_t num_layers = hf.require_int("num_hidden_layers");
  const auto ckpt = safetensors::Checkpoint::open(base_dir);
  check_against_base(adapter, num_layers, [&](const std::string& name) -> std::optional<Shape> {
    if (!ckpt.has(name)) return std::nullopt;
    return ckpt.info(name).shape;
  });
  check_layers_adapted(adapter, adapter_dir, base_dir, num_layers, ckpt.names());

  // The merged weights keep the base's dtype: the one most of its floating tensors have.
  std::map<std::string, size_t> dtype_count;
  for (const auto& name : ckpt.names()) {
    const DType d = dtype_from_name(ckpt.info(name).dtype);
    if (is_floating(d)) ++dtype_count[ckpt.info(name).dtype];
  }
  std::string dtype_name = "F32";
  size_t most = 0;
  for (const auto& [d, n] : dtype_count)
    if (n > most) most = n, dtype_name = d;
  const DType dtype = dtype_from_name(dtype_name);

  // Untouched tensors are written from the base's mapped files, never copied into memory.
  std::map<std::string, std::shared_ptr<safetensors::File>> files;
  std::map<std::string, Tensor> by_name;
  for (const auto& name : ckpt.names()) {
    const std::string& path = ckpt.file_of(name);
    auto& f = files[path];
    if (!f) f = std::make_shared<safetensors::File>(path);
    const safetensors::TensorInfo* info = f->find(name);
    LCX_CHECK(info != nullptr);
    by_name[name] = Tensor::borrow(const_cast<uint8_t*>(f->bytes(*info)), info->shape, dtype_from_name(info->dtype),
                                   Device::cpu());
  }

  const float scale = static_cast<float>(adapter.config.scale());
  std::map<int64_t, std::pair<size_t, std::vector<std::string>>> per_layer;  // done count, modules
  // An expert's matrix shows once per layer as "experts.gate_proj", however many experts.
  for (const auto& p : adapter.pairs)
    per_layer[p.layer].second.push_back(!p.parameter.empty() ? p.parameter : p.expert >= 0 ? "experts." + p.module : p.module);
  auto base_name = [](const LoraPair& p) {
    return p.parameter.empty() ? base_weight_name(p.layer, p.module, p.expert) : str("model.layers.", p.layer, ".", p.parameter);
  };
  std::vector<Tensor> merged(adapter.pairs.size());
  std::atomic<size_t> next{0};
  std::mutex mu;
  size_t layers_done = 0;
  std::string failure;
  auto work = [&] {
    for (size_t i; (i = next.fetch_add(1)) < adapter.pairs.size();) {
      try {
        const LoraPair& p = adapter.pairs[i];
        const std::string name = base_name(p);
        Tensor w = ckpt.load(name, DType::f32);
        if (!p.parameter.empty()) {  // [E, in, out], each expert its own delta
          const int64_t E = w.shape()[0], in = w.shape()[1], out = w.shape()[2];
          for (int64_t e = 0; e < E; ++e)
            add_expert_low_rank(w.data_as<float>() + e * in * out, p.a.data_as<float>(), p.b.data_as<float>(), e, E, in, out,
                                adapter.config.r, scale);
        } else {
          add_low_rank(w.data_as<float>(), p.b.data_as<float>(), p.a.data_as<float>(), w.shape()[0], w.shape()[1],
                       adapter.config.r, scale);
        }
        merged[i] = w.to(dtype);
        std::lock_guard<std::mutex> lock(mu);
        auto& [done, modules] = per_layer[p.layer];
        if (++done == modules.size() && options.progress) {
          ++layers_done;
          std::fprintf(stderr, "merge: layer %lld (%s) done, %zu of %zu layers\n", static_cast<long long>(p.layer),
                       joined_once(modules).c_str(), layers_done, per_layer.size());
        }
      } catch (const std::exception& e) {
        std::lock_guard<std::mutex> lock(mu);
        if (failure.empty()) failure = e.what();
        next = adapter.pairs.size();
      }
    }
  };
  // Each worker holds one fp32 matrix (200 MB for Qwen3-8B's MLP): a bound on the cores used keeps
  // that small on a many-core host, where BLAS threads each GEMM anyway.
  const unsigned cores = std::clamp(std::thread::hardware_concurrency(), 1u, 16u);
  const size_t threads = std::min<size_t>(options.threads > 0 ? static_cast<size_t>(options.threads) : cores,
                                          adapter.pairs.size());
  std::vector<std::thread> pool;
  for (size_t t = 1; t < threads; ++t) pool.emplace_back(work);
  work();
  for (auto& t : pool) t.join();
  if (!failure.empty()) throw Error(str("merge failed: ", failure));
  for (size_t i = 0; i < adapter.pairs.size(); ++i)
    by_name[base_name(adapter.pairs[i])] = merged[i];
  for (const auto& [name, t] : adapter.saved) by_name[name] = t;
  for (const auto& [name, t] : adapter.biases) by_name[name] = t.to(dtype);

  std::vector<safetensors::NamedTensor> out;
  for (const auto& [name, t] : by_name) out.push_back({name, t});
  fs::create_directories(out_dir);
  if (options.progress) std::fprintf(stderr, "merge: writing %zu tensors (%s) to %s\n", out.size(), dtype_name.c_str(),
                                     out_dir.c_str());
  safetensors::write_checkpoint(out_dir, out, dtype);
  // What transformers and the tokenizer read beside the weights.
  for (const char* f : {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                        "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt", "chat_template.jinja"})
    if (fs::is_regular_file(fs::path(base_dir) / f))
      fs::copy_file(fs::path(base_dir) / f, fs::path(out_dir) / f, fs::copy_options::overwrite_existing);
  if (options.progress)
    std::fprintf(stderr, "merge: %zu matrices of %zu layers merged (scale %g) into %s\n", adapter.pairs.size(),
                 per_layer.size(), adapter.config.scale(), out_dir.c_str());
}

}  // namespace lcx::peft
