// Helpers shared by the test suites: temporary folders, files, and running lcx-train.
#pragma once
#include <sys/wait.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <functional>
#include <string>
#include <vector>

#include "config/manifest.h"
#include "lcx/error.h"
#include "lcx/knob.h"
#include "lcx/tensor.h"
#include "loader/plugin_loader.h"

namespace lcx::test {

// A recipe of knob values by the names the plan prints them with ("qwen3.keep_attention",
// "train.checkpoint_every").
inline Recipe recipe_of(std::initializer_list<std::pair<std::string, int64_t>> values) {
  Recipe r;
  for (const auto& [name, value] : values) {
    const size_t dot = name.find('.');
    r.set(name.substr(0, dot), name.substr(dot + 1), value);
  }
  return r;
}

inline std::filesystem::path temp_dir(const std::string& tag) {
  std::random_device rd;
  auto dir = std::filesystem::temp_directory_path() / ("lcx-test-" + tag + "-" + std::to_string(rd()));
  std::filesystem::create_directories(dir);
  return dir;
}

// t's values drawn from N(0, scale^2) by a generator seeded with `seed`, on t's device and dtype.
inline void fill_normal(Tensor& t, uint32_t seed, float scale) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> n(0.f, scale);
  std::vector<float> v(static_cast<size_t>(t.numel()));
  for (auto& x : v) x = n(rng);
  t.copy_from(Tensor::from_floats(v, t.shape(), t.dtype(), Device::cpu()).to(t.device()));
}

inline void write_file(const std::filesystem::path& p, const std::string& text) {
  std::filesystem::create_directories(p.parent_path());
  std::ofstream(p) << text;
}

// What `f` throws as one searchable line: "message | key: K | fix: F"; "(no error)" when it returns.
inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return std::string(e.what()) + " | key: " + e.key() + " | fix: " + e.fix();
  }
  return "(no error)";
}

// What `f` throws, field by field: an Error's message, key and fix (thrown is false when it
// returns), so that a test asserts on the key and the fix rather than on how the message reads.
struct Thrown {
  bool thrown = false;
  std::string message, key, fix;
};
inline Thrown thrown_by(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return {true, e.what(), e.key(), e.fix()};
  }
  return {};
}

struct CommandResult {
  int exit_code = -1;
  std::string output;  // stdout and stderr together
};

inline CommandResult run_command(const std::string& cmd) {
  CommandResult r;
  FILE* f = popen((cmd + " 2>&1").c_str(), "r");
  if (!f) return r;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, f)) > 0) r.output.append(buf, n);
  int status = pclose(f);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

inline std::string lcx_train() { return std::string(LCX_BUILD_DIR) + "/bin/lcx-train"; }
inline std::string build_plugin_dir() { return std::string(LCX_BUILD_DIR) + "/lib/lcx/plugins"; }
inline std::string qwen3_tokenizer() { return std::string(LCX_SOURCE_DIR) + "/data/qwen3/tokenizer.json"; }

// A plugin of the build's plugin folder, created as the trainer creates it, with `table` as the
// body of its own TOML table and `mesh` as [distributed]; throws when it does not implement `Slot`.
template <typename Slot = Plugin>
std::shared_ptr<Slot> make_plugin(const std::string& name, const std::string& table = {},
                                  Device device = Device::cpu(), PluginInfo* info = nullptr, MeshShape mesh = {}) {
  Manifest m = Manifest::parse("[" + name + "]\n" + table + "\n", "test manifest");
  PluginLoader loader({build_plugin_dir()});
  auto p = std::dynamic_pointer_cast<Slot>(loader.create(name, PluginArgs{name, m.section(name), device, mesh}, info));
  if (!p) throw Error(str("plugin ", name, " does not implement the asked slot"));
  return p;
}

// The manifest of a tiny random-init Qwen3 (vocabulary 256, 2 layers, hidden 32) trained on the
// CPU from a uint32 token file in sequences of 32 at lr 0.01. `train` adds lines to [train];
// `tables` adds whole tables after it ([plugins], [distributed], ...).
inline std::string tiny_run_manifest(const std::filesystem::path& output_dir, const std::filesystem::path& tokens,
                                     int seed, bool tied, const std::string& train, const std::string& tables = {}) {
  return "[run]\noutput_dir = \"" + output_dir.string() + "\"\nseed = " + std::to_string(seed) +
         "\ndevice = \"cpu\"\n[model]\nmodule = \"qwen3\"\n"
         "init = '{\"vocab_size\": 256, \"hidden_size\": 32, \"intermediate_size\": 64, \"num_hidden_layers\": 2, "
         "\"num_attention_heads\": 4, \"num_key_value_heads\": 2, \"head_dim\": 8, \"tie_word_embeddings\": " +
         (tied ? "true" : "false") + "}'\ndtype = \"fp32\"\n[data]\ntokenizer = \"" + qwen3_tokenizer() +
         "\"\nsource = \"" + tokens.string() + "\"\nseq_len = 32\ndrop_last = true\n[train]\nlr = 0.01\n" + train + tables;
}

// ||got - want|| / ||want||, the tests' distance; NaN anywhere gives infinity, and an all-zero
// `want` gives the absolute ||got||.
inline double rel_l2(const std::vector<float>& got, const std::vector<float>& want) {
  if (got.size() != want.size()) return INFINITY;
  double num = 0, den = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::isnan(got[i]) || std::isnan(want[i])) return INFINITY;
    const double d = static_cast<double>(got[i]) - want[i];
    num += d * d;
    den += static_cast<double>(want[i]) * want[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}
inline double rel_l2(const Tensor& got, const Tensor& want) { return rel_l2(got.to_floats(), want.to_floats()); }

}  // namespace lcx::test
