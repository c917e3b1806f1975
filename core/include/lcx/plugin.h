// What a plugin library exports: the C description (abi.h) and a C++ factory, through one macro.
//
//   LCX_PLUGIN(LCX_SLOT_LOSS, "my_loss", "0.1.0", "one line", "ready", create_my_loss)
//
// where create_my_loss is `std::unique_ptr<lcx::Plugin> create_my_loss(const lcx::PluginArgs&)`.
// The object it returns must derive from the slot's interface (loss.h, model.h, ...).
#pragma once
#include <boost/config.hpp>
#include <boost/dll/alias.hpp>
#include <memory>
#include <string>

#include "lcx/abi.h"
#include "lcx/config.h"
#include "lcx/knob.h"
#include "lcx/memory.h"
#include "lcx/mesh_shape.h"

namespace lcx {

struct PlanInputs;

class Plugin {
 public:
  virtual ~Plugin() = default;
  // The choices this provider leaves to the plan for a step of `in` (lcx/knob.h), in the order the
  // search takes them; none where its keys have made them (a key set in the manifest wins).
  // in.recipe holds core's own knob (train.checkpoint_every) and the choices of the knobs before,
  // so a knob's values may follow them.
  virtual std::vector<Knob> knobs(const PlanInputs& /*in*/) const { return {}; }
  // The plan's recipe for the steps that follow: the step hands it to every slot's provider before
  // each step (and the evaluation before its forward). A provider reads its own knobs' values by
  // its name (Recipe::get); one that declares none ignores it.
  virtual void use_recipe(const Recipe& /*recipe*/) {}
  // What loading this provider, with its defaults, in place of its slot's core default would
  // save, as the phrase a plan that does not fit prints after "load <name>" (`--plan`, the
  // out-of-memory report); the planner then counts the plan with it. Empty: never offered.
  virtual std::string plan_offer() const { return {}; }
};

struct PluginArgs {
  std::string name;   // as the manifest names it
  ConfigView config;  // the plugin's own table ([name]); empty when absent
  Device device;      // where the run computes
  MeshShape mesh;     // [distributed] dp x cp x sp as configured (dp may still widen to the world)
  // This rank in the world; 0 where the provider is made for no rank (plans, checks). A model
  // that partitions parameters over [distributed] ep ranks learns from it (with `mesh`) which part
  // it builds, before any weight exists: a rank holds only its part, never the whole.
  int rank = 0;
};

using PluginFactory = std::unique_ptr<Plugin>(const PluginArgs&);

}  // namespace lcx

#define LCX_PLUGIN(SLOT, NAME, VERSION, SUMMARY, STATUS, FACTORY)                         \
  extern "C" BOOST_SYMBOL_EXPORT const struct lcx_plugin_description lcx_plugin_description;     \
  extern "C" BOOST_SYMBOL_EXPORT const struct lcx_plugin_description lcx_plugin_description = { \
      LCX_PLUGIN_MAGIC, LCX_ABI_MAJOR, LCX_ABI_MINOR, (SLOT),       (NAME),               \
      (VERSION),        LCX_COMPILER_ID, LCX_SDK_BUILD_ID, (SUMMARY), (STATUS)};            \
  BOOST_DLL_ALIAS(FACTORY, lcx_plugin_factory)
