// Knobs: the choices a provider leaves to the plan (a tile size, a placement, a spacing), and the
// recipe, the values the plan chose for one run. A provider declares its knobs (Plugin::knobs), the
// plan searches their product under the GPU's and the host's budgets and hands the chosen values
// back (Plugin::use_recipe, PlanInputs::recipe). Core knows a knob by its provider's name and its
// own, never by what it means; a key set in the manifest wins, since a provider declares no knob
// for a choice its key has made.
#pragma once
#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace lcx {

// How the plan searches a knob's values.
enum class KnobSearch : uint8_t {
  // Each value is a candidate of its own, timed by the cost model and listed by `--plan` (a trade
  // of time against memory the plan weighs).
  every,
  // The values in order, a later one only where the earlier do not fit (a fallback that costs time
  // only where it is needed).
  until_fits,
  // Ascending, each more GPU bytes (and less elsewhere) than the one before: the largest whose GPU
  // peak fits, found by bisection.
  most_that_fits,
  // Its work adds to the rest of the step's, whatever the other knobs: ranked once by time on the
  // plain recipe; the first value (the leanest) is tried first, then the fastest that fits.
  ranked,
};

struct Knob {
  std::string name;             // the provider's own key: printed and set as <provider>.<name>
  std::vector<int64_t> values;  // the candidates, in the order `search` takes them
  int64_t default_value = 0;    // what a run the plan does not size (on the host) takes
  KnobSearch search = KnobSearch::every;
  bool boolean = false;         // 0 and 1, printed false and true
  std::string means;            // what the knob is, in the words users know it by
};

// `tries` (ascending) cut to `most`, each once: row counts of a knob for a rank of `most` rows.
inline std::vector<int64_t> values_up_to(std::initializer_list<int64_t> tries, int64_t most) {
  std::vector<int64_t> out;
  for (int64_t n : tries)
    if (out.empty() || std::min(n, most) > out.back()) out.push_back(std::min(n, most));
  return out;
}

// One value the plan chose.
struct KnobValue {
  std::string provider;  // the name the manifest gives the provider (its table)
  std::string knob;
  int64_t value = 0;
  bool boolean = false;
  bool operator==(const KnobValue&) const = default;
};

// The plan's choices for one run. A provider reads its own by its name; a knob with no value
// leaves the provider to its plain rule. Core's own knobs are the step's: it saves the input of
// every train.checkpoint_every-th layer only (0, k, 2k, ...) and rebuilds those between in the
// backward, by one more forward of those layers (or, with train.rebuild_each, by forwards from the
// segment's saved input for each of them).
class Recipe {
 public:
  static constexpr const char* kCoreProvider = "train";
  static constexpr const char* kCheckpointEvery = "checkpoint_every";

  std::optional<int64_t> find(std::string_view provider, std::string_view knob) const {
    for (const KnobValue& v : values_)
      if (v.provider == provider && v.knob == knob) return v.value;
    return std::nullopt;
  }
  int64_t get(std::string_view provider, std::string_view knob, int64_t fallback) const {
    return find(provider, knob).value_or(fallback);
  }
  void set(std::string_view provider, std::string_view knob, int64_t value, bool boolean = false) {
    for (KnobValue& v : values_)
      if (v.provider == provider && v.knob == knob) {
        v.value = value;
        v.boolean = boolean;
        return;
      }
    values_.push_back({std::string(provider), std::string(knob), value, boolean});
  }
  void erase(std::string_view provider, std::string_view knob) {
    std::erase_if(values_, [&](const KnobValue& v) { return v.provider == provider && v.knob == knob; });
  }
  const std::vector<KnobValue>& values() const { return values_; }
  bool operator==(const Recipe&) const = default;

  int64_t checkpoint_every() const { return std::max<int64_t>(1, get(kCoreProvider, kCheckpointEvery, 1)); }
  void set_checkpoint_every(int64_t k) { set(kCoreProvider, kCheckpointEvery, k); }
  // Core's second knob, for k >= 3: the backward rebuilds each unsaved layer's input from its
  // segment's saved one and holds that one alone, rather than rebuilding the segment's inputs
  // once and holding them all (k - 1 of them): n (n - 1) / 2 layer forwards for a segment of n
  // layers instead of n - 1, for k - 2 fewer [T,H] on the device.
  static constexpr const char* kRebuildEach = "rebuild_each";
  bool rebuild_each() const { return checkpoint_every() >= 3 && get(kCoreProvider, kRebuildEach, 0) != 0; }
  // The layer forwards the backward runs again to rebuild unsaved inputs, over num_layers.
  int64_t rebuilt_forwards(int64_t num_layers) const {
    const int64_t k = checkpoint_every();
    int64_t n = 0;
    for (int64_t first = 0; first < num_layers; first += k) {
      const int64_t len = std::min(k, num_layers - first);
      n += rebuild_each() ? len * (len - 1) / 2 : len - 1;
    }
    return n;
  }
  bool saves(int64_t layer) const { return layer % checkpoint_every() == 0; }
  int64_t saved_layers(int64_t num_layers) const {
    const int64_t k = checkpoint_every();
    return (num_layers + k - 1) / k;
  }

 private:
  std::vector<KnobValue> values_;
};

}  // namespace lcx
