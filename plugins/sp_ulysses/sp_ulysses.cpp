// sp_ulysses: all-to-all from sequence shards to head shards. Until its issue (13) lands it
// accepts only sp = 1 and delegates to core's single-rank parallelism; --list-plugins says so.
#include <lcx/defaults.h>
#include <lcx/plugin.h>

namespace lcx {
namespace {

std::unique_ptr<Plugin> create(const PluginArgs& args) {
  int64_t sp = args.config.get_int("size", 1);
  if (sp != 1) args.config.fail("size", "Ulysses across ranks is not built yet", "use size = 1");
  return make_single_rank();
}

}  // namespace
}  // namespace lcx

LCX_PLUGIN(LCX_SLOT_PARALLELISM, "sp_ulysses", "0.1.0", "Ulysses all-to-all sequence parallelism",
           "delegates to single", lcx::create)
