// lcx-train --plan: the memory plan of a manifest, with no GPU work and no weights loaded: a Run
// of its slots and the model's shape, planned for the GPU given. The verdict comes first, then
// the recipe chosen, the fixes to paste, the breakdown and the candidates; the terms behind the
// sums with --verbose.
#include "app/plan_cmd.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <optional>

#include "kernels/attention/dispatch.h"
#include "lcx/error.h"
#include "plan/plan.h"
#include "plan/rates.h"
#include "train/run.h"
#include "util/text.h"

namespace lcx {
namespace {

// "fits, 25.34 GiB to spare" or "short by 2.82 GiB".
std::string against(int64_t need, int64_t budget) {
  return need <= budget ? str("fits, ", format_bytes(budget - need), " to spare")
                        : str("short by ", format_bytes(need - budget));
}

// "fits", or the budgets a candidate lacks: "short (GPU)", "short (host)", "short (GPU, host)".
std::string verdict_of(const RecipeOption& o, int64_t gpu_bytes, int64_t host_bytes) {
  if (o.fits) return "fits";
  const bool gpu = o.gpu_peak > gpu_bytes, host = host_bytes >= 0 && o.host_node > host_bytes;
  return str("short (", gpu ? "GPU" : "", gpu && host ? ", " : "", host ? "host" : "", ")");
}

// The --set line that applies a fix: its plugins added to [plugins] load, its keys set.
std::string set_line(const PlanKnob& k, const std::vector<std::string>& loaded) {
  std::vector<std::string> parts;
  if (!k.loads.empty()) {
    std::vector<std::string> load;
    for (const std::vector<std::string>* names : {&loaded, &k.loads})
      for (const std::string& n : *names)
        if (std::find(load.begin(), load.end(), "\"" + n + "\"") == load.end()) load.push_back("\"" + n + "\"");
    parts.push_back("--set 'plugins.load=[" + join(load, ",") + "]'");
  }
  for (const auto& [key, value] : k.sets) parts.push_back(str("--set ", key, "=", value));
  return join(parts, " ");
}

}  // namespace

int run_plan_command(const Manifest& m, const CoreConfig& cfg, const PluginLoader& loader,
                     const std::vector<std::string>& disabled, const std::string& gpu_memory,
                     const std::string& host_memory, const std::string& gpu_name, bool verbose) {
  int64_t gpu_bytes = 0;
  std::string gpu_source;
  if (!gpu_memory.empty()) {
    gpu_bytes = parse_memory_size(gpu_memory);
    gpu_source = "--gpu-memory";
  } else if (cfg.run.gpu_memory != "auto") {
    gpu_bytes = parse_memory_size(cfg.run.gpu_memory, "run.gpu_memory");
    gpu_source = "run.gpu_memory";
  } else if (auto local = local_gpu_memory()) {
    gpu_bytes = *local;
    gpu_source = "this machine's GPU";
  } else {
    throw Error("--plan needs the GPU's memory, and this machine has no GPU to ask", "--gpu-memory",
                "give it, e.g. --gpu-memory 80GB (H100) or --gpu-memory 141GB (H200)");
  }
  const RatesTable::Choice rates = use_rates_for(gpu_name.empty() ? cfg.run.gpu_name : gpu_name, gpu_bytes);
  Run run(cfg, resolve_slots(m, loader, disabled, Device::cpu(), configured_mesh(cfg.distributed)), Device::cpu(), {},
          "the plan needs the model's shape");
  std::string model_source;
  const ModelConfig model = plan_model_config(cfg.model, run.model(), &model_source);
  const int64_t host_bytes = host_memory_budget(host_memory, cfg.run);
  run.check_parallelism();
  run.plan_step(model, cfg.data.seq_len, gpu_bytes, host_bytes);
  const PlanInputs& in = run.planned();
  const PlanSlots ps = run.plan_slots();
  const int64_t unit = plan_seq_unit(in, cfg.data.pad_to_multiple_of);
  const std::vector<RecipeOption> options = rank_recipes(in, ps, gpu_bytes, host_bytes, cfg.train.checkpoint_every);
  const MemoryPlan plan = build_plan(in, ps);
  const int64_t gpu_peak = plan.peak().bytes, host_node = node_host_bytes(plan, in);
  const bool gpu_fits = gpu_peak <= gpu_bytes, host_fits = host_bytes < 0 || host_node <= host_bytes;

  std::printf("# %s, model shape from %s\n", m.source().c_str(), model_source.c_str());
  std::printf("verdict: %s\n", gpu_fits && host_fits ? "fits" : "does NOT fit");
  std::printf("  GPU:  peak %s of %s (%s): %s\n", format_bytes(gpu_peak).c_str(), format_bytes(gpu_bytes).c_str(),
              gpu_source.c_str(), against(gpu_peak, gpu_bytes).c_str());
  // Planning another machine (--gpu-memory) with this one's host figure says so.
  const std::string host_source = host_memory_source(host_memory, cfg.run);
  const bool this_host = host_memory.empty() && cfg.run.host_memory == "auto";
  const std::string host_note =
      this_host && !gpu_memory.empty() ? "; another machine's: --host-memory SIZE" : std::string();
  const std::string pinned =
      str(format_bytes(host_node), " pinned", in.local_ranks > 1 ? str(" (", in.local_ranks, " ranks on one node)") : "");
  if (host_bytes < 0)
    std::printf("  host: %s, not checked (%s is unknown; --host-memory SIZE checks it)\n", pinned.c_str(),
                host_source.c_str());
  else
    std::printf("  host: %s of %s (%s%s): %s\n", pinned.c_str(), format_bytes(host_bytes).c_str(), host_source.c_str(),
                host_note.c_str(), against(host_node, host_bytes).c_str());
  const int64_t longest = longest_fitting_seq(in, ps, gpu_bytes, host_bytes, unit, cfg.train.checkpoint_every);
  std::printf("  longest sequence: %s (the longest at which some recipe fits both budgets, with this model, mesh and "
              "providers; in steps of %lld)\n",
              longest ? str(with_commas(longest), " tokens").c_str() : "none",
              static_cast<long long>(unit));

  // The rates that time the recipes below.
  std::printf("# rates: the '%s' row (%s%s)%s%s\n", rates.row.device.c_str(),
              rates.row.basis.empty() ? "" : (rates.row.basis + ", ").c_str(), rates.row.source.c_str(),
              rates.note.empty() ? "" : "; ", rates.note.c_str());
  // Which attention kernels the run's calls take on that GPU (its compute capability from the row;
  // sm_90 where the row does not give one), with cuDNN loaded.
  {
    const std::optional<ops::attention::Choice> choice = ops::attention::parse_choice(cfg.run.attention);
    const double cc = rates.row.get(rate_name::compute_capability, 9.0);
    const int major = static_cast<int>(cc), minor = static_cast<int>(std::lround((cc - major) * 10));
    std::printf("# attention ([run] attention = %s, on sm_%d%d with cuDNN):\n", cfg.run.attention.c_str(), major, minor);
    const std::vector<std::string>& types = in.model.layer_types;
    const int64_t window =
        std::find(types.begin(), types.end(), "sliding_attention") != types.end() ? in.model.sliding_window : 0;
    for (const std::string& line : ops::attention::plan_lines(choice.value_or(ops::attention::Choice::automatic),
                                                              in.weight_dtype, in.model.head_dim, in.tokens_per_rank,
                                                              ops::attention::caps_of(major, minor), window))
      std::printf("  %s\n", line.c_str());
    ops::attention::DeviceCaps bare = ops::attention::caps_of(major, minor);
    bare.cudnn = false;
    try {
      ops::attention::check_fast_attention(choice.value_or(ops::attention::Choice::automatic), bare);
    } catch (const Error& e) {
      std::printf("  without cuDNN: refused (%s)\n", e.fix().c_str());
    }
  }
  std::printf("\nrecipe: %s, predicted step %.1f s (keys set in the manifest win)\n",
              gpu_fits && host_fits ? "the fastest that fits" : "the leanest (nothing fits)",
              predicted_step_seconds(plan.work));
  for (const DeclaredKnob& d : declared_knobs(in, ps, cfg.train.checkpoint_every)) {
    const std::optional<int64_t> v = in.recipe.find(d.provider, d.knob.name);
    const std::string name = str(d.provider, ".", d.knob.name, " = ",
                                 v ? knob_value_text(*v, d.knob.boolean) : std::string("(its provider's rule)"));
    std::printf("  %-40s %s\n", name.c_str(), d.knob.means.c_str());
  }

  if (!gpu_fits || !host_fits) {
    std::printf("\nfixes (each alone; paste one):\n");
    std::vector<std::string> loaded;
    for (const std::string& name : cfg.plugins.load)
      if (std::find(disabled.begin(), disabled.end(), name) == disabled.end()) loaded.push_back(name);
    size_t fixes = 0;
    if (!gpu_fits)
      for (const PlanKnob& k : plan_knobs(in, ps, &loader, gpu_bytes, unit)) {
        // A shorter sequence alone is the longest above, where the run chooses its recipe again.
        if (k.loads.empty() &&
            std::any_of(k.sets.begin(), k.sets.end(), [](const auto& kv) { return kv.first == "data.seq_len"; }))
          continue;
        std::printf("  %s  %s: GPU peak %s (%s)\n", set_line(k, loaded).c_str(), k.fits ? "fits" : "short",
                    format_bytes(k.peak).c_str(), k.action.c_str());
        ++fixes;
      }
    if (longest > 0 && longest < in.seq_len) {
      std::printf("  --set data.seq_len=%lld  fits: the longest sequence above\n", static_cast<long long>(longest));
      ++fixes;
    }
    if (!gpu_fits && fixes == 0) std::printf("  (none found: a smaller model, or more GPUs per sequence)\n");
    if (!host_fits) std::printf("  host: %s\n", kHostMemoryFix);
  }

  std::printf("\n%s", format_plan(plan, in, ps, 0, -1, verbose).c_str());
  if (!verbose) std::printf("  (the %zu terms behind these sums, per phase: --verbose)\n", plan.terms.size());

  std::printf("\ncandidates (fastest first by the cost model; the first that fits is taken):\n");
  // The choice and its runners-up: the fastest candidates, the chosen one wherever it ranks.
  constexpr size_t kShown = 12;
  size_t shown = 0, fit_hidden = 0;
  for (const RecipeOption& o : options) {
    const bool is_chosen = o.recipe == in.recipe;
    if (shown >= kShown && !is_chosen) {
      fit_hidden += o.fits ? 1 : 0;
      continue;
    }
    ++shown;
    std::printf("  %-17s %7.1f s  GPU %10s  host %10s  %s%s\n", verdict_of(o, gpu_bytes, host_bytes).c_str(), o.seconds,
                format_bytes(o.gpu_peak).c_str(), format_bytes(o.host_node).c_str(), recipe_name(o.recipe).c_str(),
                is_chosen ? "   <- chosen" : "");
  }
  if (options.size() > shown)
    std::printf("  (%zu slower candidates not shown, %zu of them fit)\n", options.size() - shown, fit_hidden);
  return gpu_fits && host_fits ? 0 : 1;
}

}  // namespace lcx
