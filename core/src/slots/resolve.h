// Chooses the provider of each slot from the manifest: the plugins named in [plugins] load (less
// those --disable'd), the model module of [model] module, and core's default for any slot left.
#pragma once
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "config/manifest.h"
#include "lcx/loss.h"
#include "lcx/memory_strategy.h"
#include "lcx/mlp_strategy.h"
#include "lcx/model.h"
#include "lcx/parallelism.h"
#include "lcx/positional_encoding.h"
#include "plugin/loader.h"

namespace lcx {

struct SlotProvider {
  std::string name;
  std::string origin;  // "core default" or the plugin's path
  PluginInfo info;     // empty for core defaults
};

struct SlotSet {
  std::shared_ptr<Loss> loss;
  std::shared_ptr<PositionalEncoding> rope;
  std::shared_ptr<MemoryStrategy> memory;
  std::shared_ptr<Parallelism> parallel;
  std::shared_ptr<Model> model;  // null when the manifest names no model module
  std::shared_ptr<MlpStrategy> mlp;
  std::map<uint32_t, SlotProvider> providers;
};

// The names of core's default providers, by slot.
const char* default_provider_name(uint32_t slot);
// Core's rotary positions in place of the positional-encoding plugin `disabled` (--disable, an
// ablation): a checkpoint's scaled rope parameters are then ignored with one warning, where
// make_default_rope() refuses them.
std::unique_ptr<PositionalEncoding> make_default_rope_in_place_of(const std::string& disabled);
// Which plugin names the manifest asks for, in order, after --disable.
std::vector<std::string> requested_plugins(const Manifest& m, const std::vector<std::string>& disabled);
// Describes without creating (for --dry-run): refuses two providers for one slot.
std::map<uint32_t, SlotProvider> plan_slots(const Manifest& m, const PluginLoader& loader,
                                            const std::vector<std::string>& disabled);
SlotSet resolve_slots(const Manifest& m, const PluginLoader& loader, const std::vector<std::string>& disabled,
                      Device device);

}  // namespace lcx
