// The recipe: the choices that trade memory for time (lcx/slots/model.h Recipe), made per run by the
// plan. Each candidate is planned (its bytes) and timed by the cost model (its providers' work,
// MemoryPlan::work, at the rates below); the fastest whose plan fits the GPU (and whose pinned
// host bytes, times the ranks of the node, fit the host) is taken. A key set in the manifest wins, since the providers read the
// recipe only where their key is "auto".
//
// The rates are what one H200 reached in the step trace of full-depth Qwen3-4B at 64k tokens
// (docs/PERF.md): cuBLASLt bf16 GEMMs, cuDNN's causal attention forward and backward, and the
// elementwise kernels' memory traffic. Host copies of tensors a memory strategy moves overlap
// compute and are not counted.
#include <algorithm>

#include "lcx/error.h"
#include "plan/plan.h"

namespace lcx {

double predicted_step_seconds(const StepWork& w) {
  constexpr double kGemmFlops = 640e12, kAttentionForwardFlops = 570e12, kAttentionBackwardFlops = 525e12,
                   kMemoryBytes = 2.4e12;
  // A head group's projections are 1/groups as wide: on the H200 eight groups ran them at about
  // half the full width's rate (the 64k step: 0.85 s more than one group, beside the attention).
  const double grouped_rate = kGemmFlops / (1.0 + static_cast<double>(std::max<int64_t>(w.head_groups, 1) - 1) / 7.0);
  return w.gemm_flops / kGemmFlops + w.grouped_gemm_flops / grouped_rate + w.attention_forward_flops / kAttentionForwardFlops +
         w.attention_backward_flops / kAttentionBackwardFlops + w.memory_bytes / kMemoryBytes;
}

std::string recipe_name(const Recipe& r) {
  return str(r.keep_attention ? "attention kept from the forward" : "attention recomputed", ", ",
             r.head_groups == 1 ? std::string("one head group") : str(r.head_groups, " head groups"));
}

std::vector<RecipeOption> rank_recipes(const PlanInputs& in, const PlanSlots& slots, int64_t gpu_bytes,
                                       int64_t host_bytes) {
  std::vector<RecipeOption> out;
  std::vector<int64_t> group_counts;
  for (int64_t g = 1; g <= std::max<int64_t>(1, in.model.num_kv_heads); g *= 2)
    if (in.model.num_kv_heads % g == 0) group_counts.push_back(g);
  for (bool keep : {true, false})
    for (int64_t groups : group_counts) {
      RecipeOption o;
      o.recipe.keep_attention = keep;
      o.recipe.head_groups = groups;
      PlanInputs with = in;
      with.recipe = o.recipe;
      const MemoryPlan plan = build_plan(with, slots);
      o.gpu_peak = plan.peak().bytes;
      o.host_peak = plan.host_peak();
      o.host_node = node_host_bytes(plan, with);
      o.fits = o.gpu_peak <= gpu_bytes && (host_bytes < 0 || o.host_node <= host_bytes);
      o.seconds = predicted_step_seconds(plan.work);
      out.push_back(o);
    }
  std::stable_sort(out.begin(), out.end(), [](const RecipeOption& a, const RecipeOption& b) { return a.seconds < b.seconds; });
  return out;
}

Recipe choose_recipe(const PlanInputs& in, const PlanSlots& slots, int64_t gpu_bytes, int64_t host_bytes) {
  const std::vector<RecipeOption> options = rank_recipes(in, slots, gpu_bytes, host_bytes);
  for (const RecipeOption& o : options)
    if (o.fits) return o.recipe;
  // Nothing fits: the leanest, so the run's own refusal or out-of-memory report speaks of the best
  // case: of those that fit the GPU (the host is short), the one pinning least; else the smallest GPU peak.
  auto leaner = [&](const RecipeOption& a, const RecipeOption& b) {
    const bool a_gpu = a.gpu_peak <= gpu_bytes, b_gpu = b.gpu_peak <= gpu_bytes;
    if (a_gpu != b_gpu) return a_gpu;
    return a_gpu ? a.host_node < b.host_node : a.gpu_peak < b.gpu_peak;
  };
  return std::min_element(options.begin(), options.end(), leaner)->recipe;
}

}  // namespace lcx
