// offload: checkpointed layer inputs wait in pinned host memory. Until its issue (9) lands it
// validates its table and delegates to core's on-device strategy; --list-plugins says so.
#include <lcx/defaults.h>
#include <lcx/plugin.h>

namespace lcx {
namespace {

std::unique_ptr<Plugin> create(const PluginArgs& args) {
  int64_t depth = args.config.get_int("prefetch", 2);
  if (depth < 0) args.config.fail("prefetch", "must be >= 0");
  return make_on_device_memory();
}

}  // namespace
}  // namespace lcx

LCX_PLUGIN(LCX_SLOT_MEMORY_STRATEGY, "offload", "0.1.0", "checkpointed activations in pinned host memory",
           "delegates to on_device", lcx::create)
