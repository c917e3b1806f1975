#include "train/run_summary.h"

#include <cmath>
#include <cstdio>
#include <filesystem>

#include "data/dataset.h"
#include "plan/plan.h"
#include "loader/plugin_loader.h"
#include "slots/resolve.h"
#include "train/run.h"
#include "util/text.h"

namespace lcx {
namespace {

// 596.05 M, 8.19 B: a parameter count as model cards write it.
std::string count_words(int64_t n) {
  char buf[32];
  const double v = static_cast<double>(n);
  if (v >= 1e9) std::snprintf(buf, sizeof buf, "%.2f B", v / 1e9);
  else if (v >= 1e6) std::snprintf(buf, sizeof buf, "%.2f M", v / 1e6);
  else std::snprintf(buf, sizeof buf, "%.1f K", v / 1e3);
  return buf;
}

// The recipe in the words of PyTorch and TRL users: core's own knob as gradient checkpointing,
// each provider's by the words its knob declares (the part before the colon of Knob::means),
// with its name and value beside them, and where the plan keeps what.
std::string recipe_words(const Run& run, const MemoryPlan& plan) {
  const PlanInputs& in = run.planned();
  const int64_t k = in.recipe.checkpoint_every();
  std::vector<std::string> parts{k > 1 ? str("gradient checkpointing (one layer input saved every ", k, " layers)")
                                       : std::string("gradient checkpointing (every layer's input saved)")};
  for (const DeclaredKnob& d : declared_knobs(in, run.plan_slots(), run.cfg().train.checkpoint_every)) {
    const std::optional<int64_t> v = in.recipe.find(d.provider, d.knob.name);
    // 0 leaves a count knob to its provider's own rule, as false leaves a switch off: neither is a choice.
    if (!v || d.provider == Recipe::kCoreProvider || *v == 0) continue;
    const std::string words = d.knob.means.substr(0, d.knob.means.find(':'));
    parts.push_back(d.knob.boolean ? str(words, " (", d.provider, ".", d.knob.name, ")")
                                   : str(words, " (", d.provider, ".", d.knob.name, " = ", with_commas(*v), ")"));
  }
  if (plan.category_bytes(PlanCategory::activations_host, true) > 0) parts.push_back("saved activations in pinned host memory");
  if (plan.category_bytes(PlanCategory::optimizer, true) > 0) parts.push_back("optimizer on the host");
  return join(parts, ", ");
}

}  // namespace

std::vector<std::string> run_summary(const Run& run, int64_t total_steps, int64_t sequences_per_step,
                                     int64_t steps_per_epoch) {
  const CoreConfig& cfg = run.cfg();
  const ModelConfig& mc = run.model().config();
  const MemoryPlan plan = build_plan(run.planned(), run.plan_slots());
  const MeshShape mesh = run.mesh_shape();
  const Dataset& data = run.data();
  std::vector<std::string> out;
  const std::string name = !cfg.model.path.empty()
                               ? std::filesystem::path(cfg.model.path).lexically_normal().filename().string()
                               : std::string("random init");
  out.push_back(str("model    ", cfg.model.module, " ", name.empty() ? cfg.model.path : name, ": ", mc.num_layers,
                    " layers, hidden ", mc.hidden_size, ", ", mc.num_heads, " query / ", mc.num_kv_heads,
                    " kv heads, vocab ", mc.vocab_size, "; ", count_words(plan.parameters), " parameters, ",
                    dtype_name(run.dtype()), " weights"));
  out.push_back(str("devices  ", device_name(run.device()), ", ", run.world_size(), run.world_size() == 1 ? " rank" : " ranks",
                    " (dp ", mesh.dp, " x cp ", mesh.cp, " x sp ", mesh.sp,
                    mesh.cp > 1 && mesh.sp > 1 ? str(", ", mesh_order_name(mesh.order)) : "", ")"));
  std::vector<std::string> plugins;
  for (const auto& [slot, first] : run.slots().providers)
    for (const SlotProvider* p = &first; p; p = p->beneath.empty() ? nullptr : &p->beneath.front())
      if (!p->info.path.empty()) plugins.push_back(str(p->name, " (", slot_name(slot), ")"));
  out.push_back(str("plugins  ", plugins.empty() ? std::string("none: core's default for every slot") : join(plugins, ", ")));
  out.push_back(str("recipe   ", recipe_words(run, plan), "; ", dtype_name(run.grad_dtype()),
                    " GEMM gradients",
                    run.device().is_cuda() ? str("; predicted step ", predicted_step_seconds(plan.work), " s") : std::string()));
  out.push_back(str("memory   planned per GPU: peak ", format_bytes(plan.peak(false).bytes), " (",
                    format_bytes(plan.peak(true).bytes), " with the reserve); pinned host ", format_bytes(plan.host_peak())));
  out.push_back(str("data     ", with_commas(data.num_sequences()), data.num_sequences() == 1 ? " sequence" : " sequences",
                    " of ", with_commas(data.seq_len()), " tokens (", with_commas(data.num_sequences() * data.seq_len()),
                    " tokens, ", with_commas(data.num_documents()), data.num_documents() == 1 ? " document" : " documents",
                    ") per epoch"));
  char epochs[32];
  std::snprintf(epochs, sizeof epochs, "%.3g", static_cast<double>(total_steps) / static_cast<double>(steps_per_epoch));
  out.push_back(str("steps    ", with_commas(total_steps), total_steps == 1 ? " step" : " steps", " of ", sequences_per_step,
                    sequences_per_step == 1 ? " sequence" : " sequences", " (", epochs, " epochs); details in ",
                    (std::filesystem::path(cfg.run.output_dir) / "log.jsonl").string()));
  return out;
}

}  // namespace lcx
