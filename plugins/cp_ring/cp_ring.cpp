// cp_ring: ring attention over a zigzag-sharded sequence. Until its issue (12) lands it accepts
// only cp = 1 and delegates to core's single-rank parallelism; --list-plugins says so.
#include <lcx/defaults.h>
#include <lcx/plugin.h>

namespace lcx {
namespace {

std::unique_ptr<Plugin> create(const PluginArgs& args) {
  int64_t cp = args.config.get_int("size", 1);
  if (cp != 1) args.config.fail("size", "ring attention across ranks is not built yet", "use size = 1");
  return make_single_rank();
}

}  // namespace
}  // namespace lcx

LCX_PLUGIN(LCX_SLOT_PARALLELISM, "cp_ring", "0.1.0", "ring attention over a zigzag-sharded sequence",
           "delegates to single", lcx::create)
