// The recipe: the choices that trade memory for time (lcx/knob.h), made per run by the plan. Core
// declares its own knob (train.checkpoint_every) and asks every slot's provider for its own
// (Plugin::knobs); the search walks their product as each knob's KnobSearch says. Each candidate
// is planned (its bytes) and timed by the cost model (its providers' work, MemoryPlan::work, at
// the rates of the GPU planned for: plan/rates.h); the fastest whose plan fits the GPU (and whose pinned host bytes, times the
// ranks of the node, fit the host) is taken. A key set in the manifest wins, since a provider
// declares no knob for a choice its key has made.
//
// Host copies of tensors a memory strategy moves overlap compute and are not counted, except those
// it says the compute waits for (exposed_copy_bytes: nothing loaded ahead), at the pinned copy rate.
#include <algorithm>
#include <limits>
#include <optional>

#include "lcx/error.h"
#include "plan/plan.h"

namespace lcx {

std::string knob_value_text(int64_t value, bool boolean) {
  return boolean ? std::string(value ? "true" : "false") : std::to_string(value);
}

std::string recipe_name(const Recipe& r) {
  std::string name;
  for (const KnobValue& v : r.values())
    name += str(name.empty() ? "" : ", ", v.provider, ".", v.knob, " = ", knob_value_text(v.value, v.boolean));
  return name.empty() ? std::string("every provider's own rule") : name;
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

struct Planned {
  int64_t gpu_peak = 0, host_peak = 0, host_node = 0;
  double seconds = 0;
};

// The search of rank_recipes over the declared knobs' product: for each combination of the
// `every` knobs (in declaration order, the first outermost), the `until_fits` values in order until
// one fits, each with the `most_that_fits` knobs at their largest that fits the GPU and the
// `ranked` knobs at their leanest; where that fits, the fastest ranked values that fit beside it.
class Search {
 public:
  Search(const PlanInputs& in, const PlanSlots& slots, int64_t gpu_bytes, int64_t host_bytes, int64_t checkpoint_every,
         bool first_fit)
      : in_(in), slots_(slots), gpu_bytes_(gpu_bytes), host_bytes_(host_bytes), checkpoint_every_(checkpoint_every),
        first_fit_(first_fit) {}

  std::vector<RecipeOption> run() {
    rank_ranked();
    every_level(Recipe{}, 0);
    if (out_.empty() && refused_) throw *refused_;
    return std::move(out_);
  }

 private:
  std::vector<DeclaredKnob> declared(const Recipe& r, KnobSearch kind) const {
    PlanInputs at = in_;
    at.recipe = r;
    std::vector<DeclaredKnob> out;
    for (DeclaredKnob& d : declared_knobs(at, slots_, checkpoint_every_))
      if (d.knob.search == kind && !d.knob.values.empty()) out.push_back(std::move(d));
    return out;
  }

  Planned plan(const Recipe& r) const {
    PlanInputs with = in_;
    with.recipe = r;
    const MemoryPlan p = build_plan(with, slots_);
    return {p.peak().bytes, p.host_peak(), node_host_bytes(p, with), predicted_step_seconds(p.work)};
  }
  bool fits(const Planned& p) const {
    return p.gpu_peak <= gpu_bytes_ && (host_bytes_ < 0 || p.host_node <= host_bytes_);
  }

  // Each values vector is one combination of `knobs`, in their order.
  static void apply(Recipe& r, const std::vector<DeclaredKnob>& knobs, const std::vector<int64_t>& values) {
    for (size_t i = 0; i < knobs.size(); ++i) r.set(knobs[i].provider, knobs[i].knob.name, values[i], knobs[i].knob.boolean);
  }
  // Every combination of the knobs' values, the first knob's outermost.
  static std::vector<std::vector<int64_t>> product(const std::vector<DeclaredKnob>& knobs) {
    std::vector<std::vector<int64_t>> out{{}};
    for (const DeclaredKnob& d : knobs) {
      std::vector<std::vector<int64_t>> next;
      for (const std::vector<int64_t>& head : out)
        for (int64_t v : d.knob.values) {
          next.push_back(head);
          next.back().push_back(v);
        }
      out = std::move(next);
    }
    return out;
  }

  // The ranked knobs, declared on the plain recipe: their work adds to the rest of the step's, so
  // their combinations are ranked once there, fastest first by the cost model, the leaner first
  // among equals, and the leanest (each knob's first value: the least memory) last. A knob whose
  // first and last values plan alike (bytes of every phase and the predicted time) is left to its
  // provider: nothing to choose.
  void rank_ranked() {
    auto signature = [&](const DeclaredKnob& d, int64_t v) {
      PlanInputs with = in_;
      with.recipe.set(d.provider, d.knob.name, v, d.knob.boolean);
      const MemoryPlan p = build_plan(with, slots_);
      std::vector<double> sig{predicted_step_seconds(p.work)};
      for (const std::string& phase : MemoryPlan::phases()) sig.push_back(static_cast<double>(p.gpu_bytes(phase)));
      return sig;
    };
    for (DeclaredKnob& d : declared(Recipe{}, KnobSearch::ranked))
      if (d.knob.values.size() >= 2 && signature(d, d.knob.values.front()) != signature(d, d.knob.values.back()))
        ranked_.push_back(std::move(d));
    for (const DeclaredKnob& d : ranked_) leanest_.push_back(d.knob.values.front());
    std::vector<std::pair<double, std::vector<int64_t>>> timed;
    for (std::vector<int64_t>& values : product(ranked_))
      if (values != leanest_) {
        Recipe r;
        apply(r, ranked_, values);
        timed.push_back({plan(r).seconds, std::move(values)});
      }
    std::stable_sort(timed.begin(), timed.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
    for (auto& t : timed) faster_.push_back(std::move(t.second));
  }

  // The most_that_fits knobs at the largest value whose GPU peak fits, by bisection (the GPU peak
  // grows with the value); left to the provider where its lowest and highest values plan alike.
  void fill_most(Recipe& r) const {
    for (const DeclaredKnob& d : declared(r, KnobSearch::most_that_fits)) {
      const std::vector<int64_t>& v = d.knob.values;
      auto at = [&](size_t i) {
        r.set(d.provider, d.knob.name, v[i], d.knob.boolean);
        return plan(r);
      };
      const Planned none = at(0), all = at(v.size() - 1);
      if (all.host_peak == none.host_peak && all.gpu_peak == none.gpu_peak) {
        r.erase(d.provider, d.knob.name);
        continue;
      }
      if (all.gpu_peak <= gpu_bytes_) continue;
      size_t lo = 0, hi = v.size() - 1;  // hi does not fit; lo fits, or is the lowest
      while (hi - lo > 1) {
        const size_t mid = lo + (hi - lo) / 2;
        (at(mid).gpu_peak <= gpu_bytes_ ? lo : hi) = mid;
      }
      r.set(d.provider, d.knob.name, v[lo], d.knob.boolean);
    }
  }

  void every_level(const Recipe& r, size_t depth) {
    const std::vector<DeclaredKnob> every = declared(r, KnobSearch::every);
    if (depth >= every.size()) return candidate(r);
    const DeclaredKnob& d = every[depth];
    for (int64_t v : d.knob.values) {
      Recipe next = r;
      next.set(d.provider, d.knob.name, v, d.knob.boolean);
      every_level(next, depth + 1);
      if (done_) return;
    }
  }

  void candidate(const Recipe& base) {
    const std::vector<DeclaredKnob> until = declared(base, KnobSearch::until_fits);
    for (const std::vector<int64_t>& values : product(until)) {
      RecipeOption o;
      o.recipe = base;
      apply(o.recipe, until, values);
      apply(o.recipe, ranked_, leanest_);
      Planned p;
      try {
        fill_most(o.recipe);
        p = plan(o.recipe);
      } catch (const Error& e) {
        // A provider that refuses this combination (a key set against it) drops it; where every
        // candidate is refused, the first refusal is the answer.
        if (!refused_) refused_ = e;
        break;
      }
      // The leanest ranked values fit: the fastest that fit beside the rest, each with the
      // most_that_fits knobs at what they leave room for.
      if (fits(p) && !first_fit_)
        for (const std::vector<int64_t>& rows : faster_) {
          Recipe faster = o.recipe;
          apply(faster, ranked_, rows);
          fill_most(faster);
          const Planned q = plan(faster);
          if (fits(q)) {
            o.recipe = std::move(faster);
            p = q;
            break;
          }
        }
      // A value its provider does not take (a mesh that splits the heads, a key that wins) plans as
      // the candidate before it: listed once.
      if (!out_.empty() && out_.back().gpu_peak == p.gpu_peak && out_.back().host_node == p.host_node &&
          out_.back().seconds == p.seconds)
        break;
      o.gpu_peak = p.gpu_peak;
      o.host_peak = p.host_peak;
      o.host_node = p.host_node;
      o.fits = fits(p);
      o.seconds = p.seconds;
      out_.push_back(std::move(o));
      if (out_.back().fits) {
        done_ = first_fit_;
        break;
      }
    }
  }

  const PlanInputs& in_;
  const PlanSlots& slots_;
  const int64_t gpu_bytes_, host_bytes_, checkpoint_every_;
  const bool first_fit_;
  std::vector<DeclaredKnob> ranked_;
  std::vector<int64_t> leanest_;
  std::vector<std::vector<int64_t>> faster_;  // the ranked combinations but the leanest, fastest first
  std::vector<RecipeOption> out_;
  std::optional<Error> refused_;
  bool done_ = false;
};

}  // namespace

std::vector<DeclaredKnob> declared_knobs(const PlanInputs& in, const PlanSlots& slots, int64_t checkpoint_every) {
  std::vector<DeclaredKnob> out;
  Knob spacing;
  spacing.name = Recipe::kCheckpointEvery;
  spacing.values = checkpoint_every > 0 ? std::vector<int64_t>{checkpoint_every} : checkpoint_spacings(in.model.num_layers);
  spacing.default_value = std::max<int64_t>(1, checkpoint_every);
  spacing.means = "gradient checkpointing: every k-th layer's input saved, the others recomputed in the backward";
  out.push_back({Recipe::kCoreProvider, std::move(spacing)});
  // With k >= 3, how the backward rebuilds a segment's inputs: held all at once (faster) unless
  // that does not fit, then each from the saved one. [train] rebuild_each set is the one value.
  if (in.recipe.checkpoint_every() >= 3) {
    Knob each;
    each.name = Recipe::kRebuildEach;
    each.values = in.rebuild_each >= 0 ? std::vector<int64_t>{in.rebuild_each} : std::vector<int64_t>{0, 1};
    each.default_value = std::max<int64_t>(0, in.rebuild_each);
    each.search = KnobSearch::until_fits;
    each.boolean = true;
    each.means = "rebuild each recomputed input from the saved one: one held at a time, more forward";
    out.push_back({Recipe::kCoreProvider, std::move(each)});
  }
  for_each_slot([&]<class T>(const SlotRow<T>& row) {
    const T* provider = slots.get<T>();
    std::unique_ptr<T> standin;  // core's default for a slot the caller left empty
    if (!provider && row.make_default) provider = (standin = row.make_default()).get();
    if (!provider) return;
    for (Knob& k : provider->knobs(in)) out.push_back({slots.name_of<T>(), std::move(k)});
  });
  return out;
}

Recipe unplanned_recipe(const PlanInputs& in, const PlanSlots& slots, int64_t checkpoint_every) {
  Recipe r;
  r.set_checkpoint_every(std::max<int64_t>(1, checkpoint_every));
  PlanInputs at = in;
  at.recipe = r;
  for (const DeclaredKnob& d : declared_knobs(at, slots, checkpoint_every)) {
    r.set(d.provider, d.knob.name, d.knob.default_value, d.knob.boolean);
    at.recipe = r;
  }
  return r;
}

std::vector<RecipeOption> rank_recipes(const PlanInputs& in, const PlanSlots& slots, int64_t gpu_bytes,
                                       int64_t host_bytes, int64_t checkpoint_every) {
  std::vector<RecipeOption> out = Search(in, slots, gpu_bytes, host_bytes, checkpoint_every, false).run();
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
    const std::vector<RecipeOption> found = Search(at, slots, gpu_bytes, host_bytes, checkpoint_every, true).run();
    return !found.empty() && found.back().fits;
  });
}

}  // namespace lcx
