#include "slots/resolve.h"

#include <algorithm>
#include <set>

#include "lcx/error.h"
#include "util/text.h"

namespace lcx {

const char* default_provider_name(uint32_t slot) {
  const char* name = nullptr;
  for_each_slot([&](const auto& row) {
    if (row.id == slot) name = row.default_name;
  });
  return name ? name : "(none)";
}

std::vector<std::string> requested_plugins(const Manifest& m, const std::vector<std::string>& disabled) {
  ConfigView plugins = m.section("plugins");
  ConfigView model = m.section("model");
  std::vector<std::string> names = plugins.get_strings("load", {});
  std::set<std::string> seen;
  for (const auto& n : names)
    if (!seen.insert(n).second)
      throw Error(str(plugins.where("load"), ": plugins.load: '", n, "' is listed twice"), "plugins.load",
                  str("list each plugin once: remove the second \"", n, "\""));
  std::string module = model.get_string("module", "");
  if (!module.empty() && std::find(names.begin(), names.end(), module) != names.end())
    throw Error(str(plugins.where("load"), ": plugins.load: '", module, "' is also [model] module"), "plugins.load",
                str("name the model module only in [model] module: remove \"", module, "\" from [plugins] load"));
  if (!module.empty()) names.push_back(module);
  for (const auto& d : disabled)
    if (std::find(names.begin(), names.end(), d) == names.end())
      throw Error(str("--disable ", d, ": no plugin of that name is loaded by ", m.source()), "plugins.load",
                  str("loaded: ", names.empty() ? std::string("(none)") : join(names, ", ")));
  std::vector<std::string> out;
  for (const auto& n : names)
    if (std::find(disabled.begin(), disabled.end(), n) == disabled.end()) out.push_back(n);
  return out;
}

std::map<uint32_t, SlotProvider> plan_slots(const Manifest& m, const PluginLoader& loader,
                                            const std::vector<std::string>& disabled) {
  std::map<uint32_t, SlotProvider> providers;
  for (const auto& name : requested_plugins(m, disabled)) {
    PluginInfo info = loader.describe(name);
    auto it = providers.find(info.slot);
    if (it != providers.end() && it->second.name == info.name)
      throw Error(str("plugin '", info.name, "' is named twice (", it->second.origin, " and ", info.path, ")"),
                  "plugins.load", str("name '", info.name, "' once in [plugins] load"));
    // Two parallelism providers (one per sequence axis, cp and sp) are the two-dimensional mesh;
    // whether one stacks over the other is asked of the objects (resolve_slots).
    if (it != providers.end() && info.slot == LCX_SLOT_PARALLELISM && it->second.beneath.empty()) {
      it->second.beneath.push_back({info.name, info.path, info, {}});
      continue;
    }
    if (it != providers.end())
      throw Error(str("two providers for slot ", slot_name(info.slot), ": '", it->second.name, "' (",
                      it->second.origin, ") and '", info.name, "' (", info.path, ")"),
                  "plugins.load", str("keep one in [plugins] load, or --disable ", info.name));
    providers[info.slot] = {info.name, info.path, info, {}};
  }
  for_each_slot([&](const auto& row) {
    if (row.default_name && !providers.count(row.id)) providers[row.id] = {row.default_name, "core default", {}, {}};
  });
  return providers;
}

template <typename T>
static std::shared_ptr<T> as_slot(std::shared_ptr<Plugin> p, const PluginInfo& info) {
  auto out = std::dynamic_pointer_cast<T>(p);
  if (!out)
    throw Error(str("plugin '", info.name, "' (", info.path, ") says it provides slot ", slot_name(info.slot),
                    " but its object does not implement that interface"));
  return out;
}

// Two parallelism providers run only stacked: exactly one must stack over the other. The outer
// becomes the slot's provider (`created`, the providers entry) and gets the inner, returned.
static std::shared_ptr<Parallelism> stack_parallelism(const Manifest& m, const PluginLoader& loader, Device device,
                                                      const MeshShape& mesh, SlotProvider& par,
                                                      std::map<uint32_t, std::shared_ptr<Plugin>>& created) {
  SlotProvider second = par.beneath.front();
  PluginArgs args{second.info.name, m.section(second.info.name), device, mesh};
  auto a = as_slot<Parallelism>(created.at(LCX_SLOT_PARALLELISM), par.info);
  auto b = as_slot<Parallelism>(loader.create(second.origin, args, &second.info), second.info);
  const bool a_over_b = a->stacks_over(*b), b_over_a = b->stacks_over(*a);
  if (a_over_b == b_over_a)
    throw Error(str("two providers for slot ", slot_name(LCX_SLOT_PARALLELISM), ": '", par.name, "' (", par.origin,
                    ", axis ", a->mesh_axis().empty() ? std::string("none") : a->mesh_axis(), ") and '", second.name,
                    "' (", second.origin, ", axis ", b->mesh_axis().empty() ? std::string("none") : b->mesh_axis(),
                    "): ", a_over_b ? "each would stack over the other" : "neither stacks over the other",
                    ", so a mesh splitting a sequence over both axes has nothing that would run it"),
                "plugins.load",
                str("keep one in [plugins] load (or --disable ", second.name,
                    ") and set the other axis of [distributed] (cp or sp) to 1"));
  std::shared_ptr<Parallelism> outer = a_over_b ? a : b, inner = a_over_b ? b : a;
  if (!a_over_b) {
    par.beneath.front() = {par.name, par.origin, par.info, {}};
    par.name = second.name;
    par.origin = second.origin;
    par.info = second.info;
  }
  outer->set_inner(inner);
  created[LCX_SLOT_PARALLELISM] = outer;
  return inner;
}

SlotSet resolve_slots(const Manifest& m, const PluginLoader& loader, const std::vector<std::string>& disabled,
                      Device device, const MeshShape& mesh, int rank) {
  SlotSet s;
  s.providers = plan_slots(m, loader, disabled);
  std::map<uint32_t, std::shared_ptr<Plugin>> created;
  for (auto& [slot, prov] : s.providers) {
    if (prov.origin == "core default") continue;
    PluginArgs args{prov.info.name, m.section(prov.info.name), device, mesh, rank};
    created[slot] = loader.create(prov.origin, args, &prov.info);
  }
  SlotProvider& par = s.providers.at(LCX_SLOT_PARALLELISM);
  if (!par.beneath.empty()) s.parallel_inner = stack_parallelism(m, loader, device, mesh, par, created);
  for_each_slot([&]<class T>(const SlotRow<T>& row) {
    auto it = created.find(row.id);
    if (it != created.end())
      s.get<T>() = as_slot<T>(it->second, s.providers.at(row.id).info);
    else if (row.make_default)
      s.get<T>() = row.make_default();
  });
  // A positional-encoding provider dropped by --disable leaves core's rotary in its place, which
  // says once that the checkpoint's own scaling is being ignored.
  bool ablated = false;
  for (const auto& d : disabled)
    if (loader.describe(d).slot == LCX_SLOT_POSITIONAL_ENCODING) {
      s.positional = make_default_rope_in_place_of(d);
      ablated = true;
    }
  if (!ablated && !created.count(LCX_SLOT_POSITIONAL_ENCODING))
    s.positional = make_default_rope_offering([loader] {
      std::vector<std::pair<std::string, std::string>> offers;
      for (const PluginInfo& p : loader.discover())
        if (p.slot == LCX_SLOT_POSITIONAL_ENCODING) offers.emplace_back(p.name, p.summary);
      return offers;
    });
  return s;
}

}  // namespace lcx
