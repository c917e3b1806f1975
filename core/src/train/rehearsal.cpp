// The rehearsal (--rehearse): one step of the run with the attention math cut (the rehearsal's
// attention table: every allocation made, nothing computed), its measured peaks against the plan's.
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "kernels/attention_table.h"
#include "lcx/log.h"
#include "lcx/pinned.h"
#include "plan/plan.h"
#include "train/trainer_loop.h"

namespace lcx {
namespace {

// A measured peak agrees with the plan when equal to the byte (what the plan aims at) or within this
// fraction of it: a buffer the plan has not learned yet shows as a small difference, a recipe
// that does not fit as a large one.
constexpr double kRehearsalTolerance = 0.01;

// The plan's choices by <provider>.<knob>, for a shorter run to be given the same
// (scripts/bench/rehearse.sh).
nlohmann::json recipe_choices(const Recipe& recipe) {
  nlohmann::json out = nlohmann::json::object();
  for (const KnobValue& v : recipe.values())
    out[v.provider + "." + v.knob] = v.boolean ? nlohmann::json(v.value != 0) : nlohmann::json(v.value);
  return out;
}

}  // namespace

int Trainer::rehearse() {
  const Device device = run_.device();
  const ModelConfig& mc = run_.model().config();
  const std::string what = str("one step's allocations at ", run_.data().seq_len(), " tokens, ", mc.num_layers,
                               " layers, with the attention math cut");
  if (run_.lead())
    log::warn(str("REHEARSAL, not training (--rehearse): ", what, ". Its loss means nothing; no checkpoint, no metrics"));
  // Left installed: the process ends with the rehearsal, and thread-ranks share the table.
  ops::install_attention(ops::rehearsal_attention());
  allocator_for(device).reset_peak();  // on the GPU train_step resets it again after zero_grads
  const StepRecord r = train_step();
  bar_.finish();
  if (!run_.lead()) return 0;

  const MemoryPlan plan = build_plan(run_.planned(), run_.plan_slots());
  struct Row {
    const char* name;
    int64_t measured, planned;
    bool judged;
  };
  // On the CPU the device peak is the CPU allocator's, whose kernels allocate unlike the GPU's
  // that the plan counts: shown, not judged. The pinned pool is the same code on both.
  const Row rows[] = {{device.is_cuda() ? "GPU allocated peak (plan: without the reserve)"
                                        : "CPU allocator peak (plan: the GPU's, without the reserve)",
                       allocator_for(device).stats().peak_bytes, plan.peak(false).bytes, device.is_cuda()},
                      {"host bytes held (pinned pool + optimizer state in host memory)",
                       pinned_allocator().stats().peak_bytes + host_optimizer_bytes(device), plan.host_peak(), true}};
  bool agree = true;
  nlohmann::json report = {{"rehearsal", true},
                           {"note", "a rehearsal: the attention math was cut; the loss means nothing"},
                           {"device", device_name(device)},
                           {"seq_len", run_.data().seq_len()},
                           {"layers", mc.num_layers},
                           {"recipe", recipe_name(run_.planned().recipe)},
                           {"recipe_choices", recipe_choices(run_.planned().recipe)},
                           {"loss_meaningless", r.loss},
                           {"step_s", r.t_end - r.t_start},
                           {"optimizer_s", r.t_end - r.t_optimizer},  // real: the update is not cut
                           {"tolerance", kRehearsalTolerance}};
  std::vector<std::string> lines{str("REHEARSAL (not training): ", what, "; recipe ", recipe_name(run_.planned().recipe),
                                     "; step ", r.t_end - r.t_start, " s, loss ", r.loss, " (meaningless)")};
  for (const Row& row : rows) {
    const int64_t diff = row.measured - row.planned;
    const bool equal = diff == 0;
    const bool within = std::abs(static_cast<double>(diff)) <= kRehearsalTolerance * static_cast<double>(row.planned);
    const char* verdict = !row.judged ? "not judged on the CPU (the plan is the GPU's)"
                          : equal     ? "equal"
                          : within    ? "within 1% of the plan"
                                      : "DIFFERS by more than 1%";
    if (row.judged && !within) agree = false;
    lines.push_back(str("  ", row.name, ": measured ", row.measured, " B (", format_bytes(row.measured), "), plan ",
                        row.planned, " B (", format_bytes(row.planned), "), difference ", diff > 0 ? "+" : "", diff,
                        " B: ", verdict));
    report[row.judged ? "judged" : "shown"].push_back(
        {{"name", row.name}, {"measured_bytes", row.measured}, {"plan_bytes", row.planned}, {"difference_bytes", diff}});
  }
  lines.push_back(agree ? "rehearsal: the measured peaks agree with the plan"
                        : "rehearsal: the measured peaks do NOT agree with the plan (exit 1)");
  report["agree"] = agree;
  for (const std::string& l : lines) {
    log::info(l);
    std::printf("%s\n", l.c_str());
  }
  std::fflush(stdout);
  std::ofstream(std::filesystem::path(cfg_.run.output_dir) / "rehearsal.json") << report.dump(2) << "\n";
  return agree ? 0 : 1;
}

}  // namespace lcx
