// The recipe: the choices that trade memory for time (lcx/model.h Recipe), made per run by the
// plan. Candidates are ranked by what each saves of the step's work, fastest first, and the first
// whose plan fits the GPU (and whose pinned host bytes fit the host) is taken; a key set in the
// manifest wins, since the providers read the recipe only where their key is "auto".
//
// The ranking, from the step's arithmetic at long context where attention dominates: keeping the
// attention outputs from the forward saves one attention forward per layer (a third of the
// forward's attention work would otherwise run twice), and one head group instead of one per kv
// head gives the GEMMs their full width; the first weighs more than the second.
#include <fstream>
#include <sstream>

#include "lcx/error.h"
#include "plan/plan.h"

namespace lcx {

int64_t host_memory_available() {
  std::ifstream in("/proc/meminfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("MemAvailable:", 0) != 0) continue;
    std::istringstream fields(line.substr(13));
    int64_t kib = -1;
    fields >> kib;
    return kib < 0 ? -1 : kib * 1024;
  }
  return -1;
}

std::string recipe_name(const Recipe& r) {
  return str(r.keep_attention ? "attention kept from the forward" : "attention recomputed", ", ",
             r.head_groups == 1 ? "one head group" : "one head group per kv head");
}

std::vector<RecipeOption> rank_recipes(const PlanInputs& in, const PlanSlots& slots, int64_t gpu_bytes,
                                       int64_t host_bytes) {
  std::vector<RecipeOption> out;
  for (bool keep : {true, false})
    for (int64_t groups : {int64_t{1}, in.model.num_kv_heads}) {
      RecipeOption o;
      o.recipe.keep_attention = keep;
      o.recipe.head_groups = groups;
      PlanInputs with = in;
      with.recipe = o.recipe;
      const MemoryPlan plan = build_plan(with, slots);
      o.gpu_peak = plan.peak().bytes;
      o.host_peak = plan.host_peak();
      o.fits = o.gpu_peak <= gpu_bytes && (host_bytes < 0 || o.host_peak <= host_bytes);
      out.push_back(o);
    }
  return out;
}

Recipe choose_recipe(const PlanInputs& in, const PlanSlots& slots, int64_t gpu_bytes, int64_t host_bytes) {
  const std::vector<RecipeOption> options = rank_recipes(in, slots, gpu_bytes, host_bytes);
  for (const RecipeOption& o : options)
    if (o.fits) return o.recipe;
  // Nothing fits: the leanest, so the run's own out-of-memory report speaks of the best case.
  const RecipeOption* best = &options.front();
  for (const RecipeOption& o : options)
    if (o.gpu_peak < best->gpu_peak) best = &o;
  return best->recipe;
}

}  // namespace lcx
