// Chooses the provider of each slot from the manifest: the plugins named in [plugins] load (less
// those --disable'd), the model module of [model] module, and core's default for any slot left.
#pragma once
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "config/manifest.h"
#include "lcx/mesh_shape.h"
#include "lcx/slots.h"
#include "loader/plugin_loader.h"

namespace lcx {

struct SlotProvider {
  std::string name;
  std::string origin;  // "core default" or the plugin's path
  PluginInfo info;     // empty for core defaults
  // The Parallelism slot may hold a second provider (another mesh axis) stacked beneath this one
  // (lcx/slots/parallelism.h: stacks_over); plan_slots lists it here, resolve_slots orders the pair.
  std::vector<SlotProvider> beneath;
};

// One provider per slot (lcx/slots.h); the model is null when the manifest names no model module.
struct SlotSet : SlotTuple<std::shared_ptr> {
  std::map<uint32_t, SlotProvider> providers;
  // The provider `parallel` stacks over (its providers entry's `beneath`); null without one.
  std::shared_ptr<Parallelism> parallel_inner;
};

// The names of core's default providers, by slot; "(none)" for a slot without one.
const char* default_provider_name(uint32_t slot);
// Core's rotary positions in place of the positional-encoding plugin `disabled` (--disable, an
// ablation): a checkpoint's scaled rope parameters are then ignored with one warning, where
// make_default_rope() refuses them.
std::unique_ptr<PositionalEncoding> make_default_rope_in_place_of(const std::string& disabled);
// The installed positional-encoding plugins (name, summary), asked only when a checkpoint's
// rope parameters need one: core's rotary then names the one that computes them as the fix.
using RopeOffers = std::function<std::vector<std::pair<std::string, std::string>>()>;
std::unique_ptr<PositionalEncoding> make_default_rope_offering(RopeOffers offers);
// Which plugin names the manifest asks for, in order, after --disable.
std::vector<std::string> requested_plugins(const Manifest& m, const std::vector<std::string>& disabled);
// Describes without creating (for --dry-run): refuses two providers for one slot, except a second
// Parallelism provider, kept beneath the first until resolve_slots asks which stacks over which.
std::map<uint32_t, SlotProvider> plan_slots(const Manifest& m, const PluginLoader& loader,
                                            const std::vector<std::string>& disabled);
// Creates the providers; `mesh` is the [distributed] shape the plugins are created for and `rank`
// the world rank they serve (PluginArgs).
SlotSet resolve_slots(const Manifest& m, const PluginLoader& loader, const std::vector<std::string>& disabled,
                      Device device, const MeshShape& mesh = {}, int rank = 0);

}  // namespace lcx
