// The reference of the manifest's keys (`lcx-train config`, docs/config.md) and the resolved config
// of --dry-run, both printed from what the views recorded (config/manifest.h KeyRecord): each key's
// type and default from its getter, its line from the describe() beside its read.
#pragma once
#include <string>
#include <vector>

#include "config/manifest.h"
#include "loader/plugin_loader.h"

namespace lcx {

struct ReferenceTable {
  std::string name;   // the table: "train", or a plugin's name
  std::string title;  // "core" or the plugin's slot and summary
  std::vector<KeyRecord> keys;
};

// Reads core's sections and creates every plugin `loader` finds (on the CPU, with empty tables),
// so every key they read is recorded. Throws naming the first key read without its line.
// A plugin that cannot be created is left out, its reason in `skipped`.
std::vector<ReferenceTable> config_reference(const PluginLoader& loader, std::vector<std::string>* skipped = nullptr);
// The records of `m`'s views as tables: core's sections in their order, then the others as first
// asked.
std::vector<ReferenceTable> reference_tables(const Manifest& m);
// Throws naming the first key read without its line (ConfigView::describe), and the fix.
void require_described(const std::vector<ReferenceTable>& tables);
std::string format_reference(const std::vector<ReferenceTable>& tables, bool markdown);
// The config a run resolved: every key read, with its value (set, or the default marked so);
// `set_only`: the keys given in the manifest or by --set.
std::string format_resolved(const Manifest& m, bool set_only);

}  // namespace lcx
