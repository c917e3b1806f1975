// The view through which a plugin (or a core section) reads its own TOML table. Every getter
// records the key as known; after a plugin is created the loader calls check_unknown(), so a
// misspelt key fails with its name and the list of valid ones, and no plugin can forget to check.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace lcx {

class ConfigView {
 public:
  struct Impl;
  ConfigView();  // an empty table named ""
  explicit ConfigView(std::shared_ptr<Impl> impl);
  ~ConfigView();
  ConfigView(const ConfigView&);
  ConfigView& operator=(const ConfigView&);

  const std::string& name() const;  // the table's name in the manifest, e.g. "qwen3"
  bool has(const std::string& key) const;

  // Defaults are returned when the key is absent; a present key of another type throws with
  // file:line, key, the type found and the type wanted.
  int64_t get_int(const std::string& key, int64_t def) const;
  double get_double(const std::string& key, double def) const;  // integers are accepted
  bool get_bool(const std::string& key, bool def) const;
  std::string get_string(const std::string& key, const std::string& def) const;
  std::vector<std::string> get_strings(const std::string& key,
                                       const std::vector<std::string>& def) const;
  // A key the plan may decide: absent or "auto" -> nullopt, else its integer; any other string
  // fails naming what was found, with `fix`. The caller checks the integer's range.
  std::optional<int64_t> get_int_or_auto(const std::string& key, const std::string& fix) const;
  // Required keys: absent -> error naming the key and the table.
  int64_t require_int(const std::string& key) const;
  std::string require_string(const std::string& key) const;
  // A sub-table of this one, e.g. rope_parameters inside a positional encoding's table.
  ConfigView table(const std::string& key) const;

  // The key's entry in the reference (`lcx-train config`, docs/config.md), declared beside its
  // read: one line of what it means, and its range or allowed values where there is one. The
  // getters record its type and default; `shown_default` stands for a default that is not a
  // constant (e.g. "[distributed] cp"). An empty argument keeps what an earlier call declared.
  // The reference refuses a key read without its line, so none goes undocumented.
  const ConfigView& describe(const std::string& key, const std::string& meaning, const std::string& values = {},
                             const std::string& shown_default = {}) const;

  // "file:line" of a key (or of the table when key is empty); "" when unknown (e.g. --set).
  std::string where(const std::string& key = {}) const;
  // Throws naming the first key nobody asked for and listing the keys that were asked for.
  void check_unknown() const;
  // A value problem the plugin found itself (range, combination): same format as type errors.
  [[noreturn]] void fail(const std::string& key, const std::string& message,
                         const std::string& fix = {}) const;

 private:
  std::shared_ptr<Impl> impl_;
};

}  // namespace lcx
