// lcx-train --plan: the memory plan of a manifest, with no GPU work and no weights loaded: a Run
// of its slots and the model's shape, planned for the GPU given.
#include "app/plan_cmd.h"

#include <algorithm>
#include <cstdio>

#include "lcx/error.h"
#include "plan/plan.h"
#include "train/run.h"
#include "util/text.h"

namespace lcx {

int run_plan_command(const Manifest& m, const CoreConfig& cfg, const PluginLoader& loader,
                     const std::vector<std::string>& disabled, const std::string& gpu_memory,
                     const std::string& host_memory, const std::string& gpu_name) {
  int64_t gpu_bytes = 0;
  if (!gpu_memory.empty()) {
    gpu_bytes = parse_memory_size(gpu_memory);
  } else if (cfg.run.gpu_memory != "auto") {
    gpu_bytes = parse_memory_size(cfg.run.gpu_memory, "run.gpu_memory");
  } else if (auto local = local_gpu_memory()) {
    gpu_bytes = *local;
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
  std::printf("# %s, model shape from %s\n# rates: the '%s' row (%s)%s%s\n%s", m.source().c_str(),
              model_source.c_str(), rates.row.device.c_str(), rates.row.source.c_str(), rates.note.empty() ? "" : "; ",
              rates.note.c_str(), format_plan(plan, in, ps, gpu_bytes, unit, host_bytes).c_str());
  std::printf("\nrecipe (fastest first by the cost model; the first that fits is taken, keys set in the manifest win):\n");
  // The choice and its runners-up: the fastest candidates, the chosen one wherever it ranks.
  constexpr size_t kShown = 12;
  const std::string chosen = recipe_name(in.recipe);
  size_t shown = 0;
  for (const RecipeOption& o : options) {
    const bool is_chosen = recipe_name(o.recipe) == chosen;
    if (shown >= kShown && !is_chosen) continue;
    ++shown;
    std::printf("  %-6s %s: predicted step %.1f s, GPU %s, pinned host %s%s%s\n", o.fits ? "fits" : "short",
                recipe_name(o.recipe).c_str(), o.seconds, format_bytes(o.gpu_peak).c_str(), format_bytes(o.host_node).c_str(),
                in.local_ranks > 1 ? str(" (", in.local_ranks, " ranks)").c_str() : "", is_chosen ? "   <- chosen" : "");
  }
  if (options.size() > shown)
    std::printf("  (%zu slower candidates not shown, %zu of them fit)\n", options.size() - shown,
                static_cast<size_t>(std::count_if(options.begin() + static_cast<std::ptrdiff_t>(std::min(kShown, options.size())),
                                                  options.end(), [&](const RecipeOption& o) {
                                                    return o.fits && recipe_name(o.recipe) != chosen;
                                                  })));
  const int64_t longest = longest_fitting_seq(in, ps, gpu_bytes, host_bytes, unit, cfg.train.checkpoint_every);
  std::printf("\nlongest sequence that fits this machine (GPU %s, host %s, the recipe chosen at each length): %s\n",
              format_bytes(gpu_bytes).c_str(), host_bytes < 0 ? "not checked" : format_bytes(host_bytes).c_str(),
              longest ? str(with_commas(longest), " tokens").c_str() : "none");
  if (plan.peak().bytes > gpu_bytes) {
    std::printf("\nwhat would make it fit:\n");
    for (const auto& k : plan_knobs(in, ps, &loader, gpu_bytes, unit))
      std::printf("  %-6s %s: peak %s\n", k.fits ? "fits" : "short", k.action.c_str(), format_bytes(k.peak).c_str());
  }
  return 0;
}

}  // namespace lcx
