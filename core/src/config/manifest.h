// The run manifest: a TOML file, then --set overrides, then views of its tables for core and
// plugins. Errors name the file, the line and the key.
#pragma once
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <toml++/toml.h>

#include "lcx/config.h"


namespace lcx {

class Manifest {
 public:
  static Manifest load(const std::string& path);
  static Manifest parse(const std::string& text, const std::string& source_name);

  // "section.key=value" (deeper paths allowed). The value is TOML (numbers, true/false, arrays,
  // quoted or bare strings). An existing key keeps its type: a mismatch is an error.
  void set(const std::string& assignment);
  // `f` given the whole table to change in place (keys' source lines are kept).
  void edit(const std::function<void(toml::table&)>& f) { f(*root_); }
  ConfigView section(const std::string& name) const;
  std::vector<std::string> table_names() const;
  std::string to_toml() const;
  std::string to_json() const;
  const std::string& source() const { return source_; }

 private:
  std::shared_ptr<toml::table> root_;
  std::string source_;
  // Each --set key (dotted) and its assignment; copied on write, as views share it.
  std::shared_ptr<const std::map<std::string, std::string>> overrides_;
};

}  // namespace lcx
