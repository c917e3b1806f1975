// The recipe: the choices that trade memory for time (lcx/slots/model.h Recipe), made per run by the
// plan. Each candidate is planned (its bytes) and timed by the cost model (its providers' work,
// MemoryPlan::work, at the rates of the GPU planned for: plan/rates.h); the fastest whose plan
// fits the GPU (and whose pinned host bytes, times the ranks of the node, fit the host) is taken. A key set in the manifest wins, since the providers read the
// recipe only where their key is "auto".
//
// Host copies of tensors a memory strategy moves overlap compute and are not counted, except those
// it says the compute waits for (exposed_copy_bytes: nothing loaded ahead), at the pinned copy rate.
#include <algorithm>
#include <limits>
#include <optional>
#include <span>

#include "lcx/error.h"
#include "plan/plan.h"

namespace lcx {

std::string recipe_name(const Recipe& r) {
  std::string name = str(r.keep_attention ? "attention kept from the forward" : "attention recomputed", ", ",
                         r.head_groups == 1 ? std::string("one head group") : str(r.head_groups, " head groups"));
  if (r.checkpoint_every > 1) name += str(", every ", r.checkpoint_every, " layers one input saved");
  if (r.gpu_layers >= 0) name += str(", ", r.gpu_layers, " saved inputs on the GPU");
  if (r.prefetch == 0) name += ", nothing loaded ahead";
  if (r.mlp_tile_rows > 0) name += str(", MLP tiles of ", with_commas(r.mlp_tile_rows), " rows");
  if (r.loss_chunk_rows > 0) name += str(", loss chunks of ", with_commas(r.loss_chunk_rows), " rows");
  return name;
}

namespace {

// The checkpoint spacings the search tries: 1, 2, 3, 4, 6, 8, 12, ... up to 2 sqrt(L). Past that the
// k - 1 rebuilt inputs outweigh the L/k saved ones (their sum is least near k = sqrt(L)), and each
// step of k costs more forward.
std::vector<int64_t> checkpoint_spacings(int64_t layers) {
  std::vector<int64_t> out;
  for (int64_t k = 1; k == 1 || (k <= layers && k * k <= 4 * layers);
       k = k < 4 ? k + 1 : ((k & (k - 1)) == 0 ? k / 2 * 3 : k / 3 * 4))
    out.push_back(k);
  return out;
}

// The rows the search tries for the MLP slot's tiles and the Loss slot's chunks (Recipe::mlp_tile_rows,
// loss_chunk_rows), each cut to the rank's rows: a few sizes, from about where an H200's GEMMs stay
// busy to where the time gained flattens (the chunk_rows sweep, docs/PERF.md); the rank's rows are
// one tile more. A provider that does not cut rows, or whose key is set, plans them all alike.
constexpr int64_t kTileRows[] = {4096, 8192, 16384, 32768, std::numeric_limits<int64_t>::max()};
constexpr int64_t kChunkRows[] = {256, 1024, 4096};

struct Planned {
  int64_t gpu_peak = 0, host_peak = 0, host_node = 0;
  double seconds = 0;
};

Planned plan_recipe(const PlanInputs& in, const PlanSlots& slots, const Recipe& r) {
  PlanInputs with = in;
  with.recipe = r;
  const MemoryPlan plan = build_plan(with, slots);
  return {plan.peak().bytes, plan.host_peak(), node_host_bytes(plan, with), predicted_step_seconds(plan.work)};
}

// The most saved inputs the memory strategy may keep on the GPU within gpu_bytes, by bisection
// (the GPU peak grows with them, the host bytes shrink); -1 when the strategy places none by the
// recipe (its host bytes do not move: core's on_device, or a count set by its own key).
int64_t most_gpu_layers(const PlanInputs& in, const PlanSlots& slots, Recipe r, int64_t gpu_bytes) {
  const int64_t saved = r.saved_layers(in.model.num_layers);
  r.gpu_layers = 0;
  const Planned none = plan_recipe(in, slots, r);
  r.gpu_layers = saved;
  const Planned all = plan_recipe(in, slots, r);
  if (all.host_peak == none.host_peak) return -1;
  if (all.gpu_peak <= gpu_bytes) return saved;
  int64_t lo = 0, hi = saved;  // hi does not fit; lo fits, or is 0
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    r.gpu_layers = mid;
    (plan_recipe(in, slots, r).gpu_peak <= gpu_bytes ? lo : hi) = mid;
  }
  return lo;
}

// One pair of row counts for the MLP's tiles and the loss's chunks (0: the provider's own rule).
struct Rows {
  int64_t tile = 0, chunk = 0;
  bool operator==(const Rows&) const = default;
};

Recipe with_rows(Recipe r, Rows rows) {
  r.mlp_tile_rows = rows.tile;
  r.loss_chunk_rows = rows.chunk;
  return r;
}

// The candidate counts of one field, ascending and cut to the rank's rows; {0} where the provider
// plans the fewest and the most alike (bytes of every phase and the predicted time): nothing to choose.
std::vector<int64_t> row_candidates(const PlanInputs& in, const PlanSlots& slots, std::span<const int64_t> tries,
                                    int64_t Recipe::*field) {
  const int64_t T = std::max<int64_t>(in.tokens_per_rank, 1);
  std::vector<int64_t> out;
  for (int64_t n : tries)
    if (out.empty() || std::min(n, T) > out.back()) out.push_back(std::min(n, T));
  auto planned = [&](int64_t n) {
    PlanInputs with = in;
    with.recipe = Recipe{};  // every provider takes the plain recipe (a key may refuse another)
    with.recipe.*field = n;
    const MemoryPlan plan = build_plan(with, slots);
    std::vector<double> sig{predicted_step_seconds(plan.work)};
    for (const std::string& phase : MemoryPlan::phases()) sig.push_back(static_cast<double>(plan.gpu_bytes(phase)));
    return sig;
  };
  if (out.size() < 2 || planned(out.front()) == planned(out.back())) return {0};
  return out;
}

// Every pair of tile and chunk counts, fastest first by the cost model (their work adds to the rest
// of the step's, so they are ranked once, on the plain recipe), the leaner first among equals; the
// leanest pair (the fewest rows of each: the least memory) last. Where nothing is loaded ahead, a
// larger pair may leave fewer inputs on the GPU and expose more copies: the search takes the
// fastest rows that fit, then the most inputs on the GPU beside them.
std::vector<Rows> rows_fastest_first(const PlanInputs& in, const PlanSlots& slots, Rows* leanest) {
  const std::vector<int64_t> tiles = row_candidates(in, slots, kTileRows, &Recipe::mlp_tile_rows);
  const std::vector<int64_t> chunks = row_candidates(in, slots, kChunkRows, &Recipe::loss_chunk_rows);
  *leanest = {tiles.front(), chunks.front()};
  std::vector<std::pair<double, Rows>> timed;
  for (int64_t tile : tiles)
    for (int64_t chunk : chunks)
      if (!(Rows{tile, chunk} == *leanest)) {
        PlanInputs with = in;
        with.recipe = with_rows(Recipe{}, {tile, chunk});
        timed.push_back({predicted_step_seconds(build_plan(with, slots).work), {tile, chunk}});
      }
  std::stable_sort(timed.begin(), timed.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<Rows> out;
  for (const auto& t : timed) out.push_back(t.second);
  out.push_back(*leanest);
  return out;
}

// The candidates of rank_recipes; with first_fit, only until one fits both budgets (the longest
// sequence's search asks no more), its rows the leanest.
std::vector<RecipeOption> search_recipes(const PlanInputs& in, const PlanSlots& slots, int64_t gpu_bytes,
                                         int64_t host_bytes, int64_t checkpoint_every, bool first_fit) {
  std::vector<RecipeOption> out;
  std::vector<int64_t> group_counts;
  for (int64_t g = 1; g <= std::max<int64_t>(1, in.model.num_kv_heads); g *= 2)
    if (in.model.num_kv_heads % g == 0) group_counts.push_back(g);
  const std::vector<int64_t> spacings =
      checkpoint_every > 0 ? std::vector<int64_t>{checkpoint_every} : checkpoint_spacings(in.model.num_layers);
  Rows leanest;
  const std::vector<Rows> rows = rows_fastest_first(in, slots, &leanest);
  auto fits = [&](const Planned& p) { return p.gpu_peak <= gpu_bytes && (host_bytes < 0 || p.host_node <= host_bytes); };
  std::optional<Error> refused;
  for (int64_t k : spacings)
    for (bool keep : {true, false}) {
      if (keep && k > 1) continue;  // the layers between checkpoints keep nothing (train/step.cpp)
      for (int64_t groups : group_counts)
        // The strategy's own prefetch first; nothing loaded ahead only where that does not fit (it
        // frees the window's GPU bytes for more inputs there, and exposes each copy in).
        for (int64_t prefetch : {int64_t{-1}, int64_t{0}}) {
          RecipeOption o;
          o.recipe.keep_attention = keep;
          o.recipe.head_groups = groups;
          o.recipe.checkpoint_every = k;
          o.recipe.prefetch = prefetch;
          o.recipe = with_rows(o.recipe, leanest);
          try {
            o.recipe.gpu_layers = most_gpu_layers(in, slots, o.recipe, gpu_bytes);
          } catch (const Error& e) {
            // A provider that refuses this spacing (a key set against it) drops its candidates.
            if (k == 1) throw;
            if (!refused) refused = e;
            break;
          }
          Planned p = plan_recipe(in, slots, o.recipe);
          // The leanest rows fit: the fastest rows that fit beside the rest, each with the most saved
          // inputs on the GPU that they leave room for.
          if (fits(p) && !first_fit)
            for (const Rows& r : rows) {
              if (r == leanest) break;
              Recipe faster = with_rows(o.recipe, r);
              faster.gpu_layers = most_gpu_layers(in, slots, faster, gpu_bytes);
              const Planned q = plan_recipe(in, slots, faster);
              if (fits(q)) {
                o.recipe = faster;
                p = q;
                break;
              }
            }
          // A head group count the model does not take (a mesh that splits heads), or a prefetch the
          // strategy does not take (its key, or no strategy that loads ahead), plans the same as the
          // candidate before it: listed once.
          if (!out.empty() && out.back().recipe.keep_attention == keep && out.back().recipe.checkpoint_every == k &&
              out.back().gpu_peak == p.gpu_peak && out.back().host_node == p.host_node && out.back().seconds == p.seconds)
            break;
          o.gpu_peak = p.gpu_peak;
          o.host_peak = p.host_peak;
          o.host_node = p.host_node;
          o.fits = fits(p);
          o.seconds = p.seconds;
          out.push_back(o);
          if (o.fits) {
            if (first_fit) return out;
            break;
          }
        }
    }
  if (out.empty() && refused) throw *refused;
  return out;
}

}  // namespace

std::vector<RecipeOption> rank_recipes(const PlanInputs& in, const PlanSlots& slots, int64_t gpu_bytes,
                                       int64_t host_bytes, int64_t checkpoint_every) {
  std::vector<RecipeOption> out = search_recipes(in, slots, gpu_bytes, host_bytes, checkpoint_every, false);
  // Equal times (the same work, placed otherwise): the fewer pinned bytes first.
  std::stable_sort(out.begin(), out.end(), [](const RecipeOption& a, const RecipeOption& b) {
    return a.seconds != b.seconds ? a.seconds < b.seconds : a.host_node < b.host_node;
  });
  return out;
}

Recipe choose_recipe(const PlanInputs& in, const PlanSlots& slots, int64_t gpu_bytes, int64_t host_bytes,
                     int64_t checkpoint_every) {
  const std::vector<RecipeOption> options = rank_recipes(in, slots, gpu_bytes, host_bytes, checkpoint_every);
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

int64_t longest_fitting_seq(const PlanInputs& in, const PlanSlots& slots, int64_t gpu_bytes, int64_t host_bytes,
                            int64_t unit, int64_t checkpoint_every) {
  return longest_seq_where(in, unit, [&](const PlanInputs& at) {
    const std::vector<RecipeOption> found = search_recipes(at, slots, gpu_bytes, host_bytes, checkpoint_every, true);
    return !found.empty() && found.back().fits;
  });
}

}  // namespace lcx
