// Finds plugin libraries by name, checks their C description before importing anything C++, and
// creates slot objects that keep their library loaded for as long as they live.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "lcx/abi.h"
#include "lcx/plugin.h"

namespace lcx {

const char* slot_name(uint32_t slot);  // "loss", "positional_encoding", ...

struct PluginInfo {
  std::string name;
  std::string version;
  std::string summary;
  std::string status;  // "ready" or "delegates to ..."
  std::string path;
  std::string sha256;
  std::string compiler;
  std::string sdk_build;
  uint32_t slot = 0;
  uint32_t abi_major = 0;
  uint32_t abi_minor = 0;
};

class PluginLoader {
 public:
  explicit PluginLoader(std::vector<std::string> search_dirs);
  // [plugins] dir (relative to the manifest's folder), the install's plugin folder next to the
  // executable, then each entry of LCX_PLUGIN_PATH (colon separated), in that order.
  static std::vector<std::string> default_search_dirs(const std::string& manifest_dir_entry);
  // The folder lib/lcx/plugins beside the running executable's bin/.
  static std::string install_plugin_dir();

  const std::vector<std::string>& search_dirs() const { return dirs_; }
  // Finds and checks one plugin; throws with the refusal's message.
  PluginInfo describe(const std::string& name_or_path) const;
  // Every lcx plugin in the search folders (first one found wins for a name); broken files are
  // reported through `problems`.
  std::vector<PluginInfo> discover(std::vector<std::string>* problems = nullptr) const;
  // Whether a plugin of this name is in the search folders (its file, not loaded).
  bool installed(const std::string& name) const;
  // Loads, checks and creates. The returned object holds its library.
  std::shared_ptr<Plugin> create(const std::string& name_or_path, const PluginArgs& args,
                                 PluginInfo* info = nullptr) const;

 private:
  std::string find(const std::string& name_or_path) const;
  std::vector<std::string> dirs_;
};

}  // namespace lcx
