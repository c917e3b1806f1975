// loss_chunked: linear + cross entropy over row chunks so the [T,V] logits never exist whole.
// Until the chunked kernels land (issue 7) the plugin validates its table and delegates to
// core's full-logits loss; --list-plugins says so.
#include <lcx/defaults.h>
#include <lcx/plugin.h>

namespace lcx {
namespace {

std::unique_ptr<Plugin> create(const PluginArgs& args) {
  int64_t rows = args.config.get_int("chunk_rows", 256);
  if (rows < 1) args.config.fail("chunk_rows", "must be >= 1", "256 is TRL's default");
  return make_full_logits_loss();
}

}  // namespace
}  // namespace lcx

LCX_PLUGIN(LCX_SLOT_LOSS, "loss_chunked", "0.1.0", "chunked linear + cross entropy, logits never whole",
           "delegates to nll", lcx::create)
