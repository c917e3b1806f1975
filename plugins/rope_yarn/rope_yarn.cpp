// rope_yarn: YaRN-rescaled rotary positions. Until its issue (8) lands it validates its table and
// delegates to core's plain rotary; --list-plugins says so.
#include <lcx/defaults.h>
#include <lcx/plugin.h>

namespace lcx {
namespace {

std::unique_ptr<Plugin> create(const PluginArgs& args) {
  double factor = args.config.get_double("factor", 1.0);
  if (factor < 1.0) args.config.fail("factor", "must be >= 1", "factor = target length / trained length");
  args.config.get_int("original_max_position_embeddings", 0);
  return make_default_rope();
}

}  // namespace
}  // namespace lcx

LCX_PLUGIN(LCX_SLOT_POSITIONAL_ENCODING, "rope_yarn", "0.1.0", "YaRN rescaled rotary positions",
           "delegates to rope", lcx::create)
