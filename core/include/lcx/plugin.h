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
#include "lcx/memory.h"

namespace lcx {

class Plugin {
 public:
  virtual ~Plugin() = default;
};

struct PluginArgs {
  std::string name;   // as the manifest names it
  ConfigView config;  // the plugin's own table ([name]); empty when absent
  Device device;      // where the run computes
};

using PluginFactory = std::unique_ptr<Plugin>(const PluginArgs&);

}  // namespace lcx

#define LCX_PLUGIN(SLOT, NAME, VERSION, SUMMARY, STATUS, FACTORY)                         \
  extern "C" BOOST_SYMBOL_EXPORT const struct lcx_plugin_description lcx_plugin_description;     \
  extern "C" BOOST_SYMBOL_EXPORT const struct lcx_plugin_description lcx_plugin_description = { \
      LCX_PLUGIN_MAGIC, LCX_ABI_MAJOR, LCX_ABI_MINOR, (SLOT),       (NAME),               \
      (VERSION),        LCX_COMPILER_ID, LCX_SDK_BUILD_ID, (SUMMARY), (STATUS)};            \
  BOOST_DLL_ALIAS(FACTORY, lcx_plugin_factory)
