// What a layout's work costs each rank, the balance's model (balance.h): a rank's masked work, or
// the pairs its rounds compute as the GPU's batches run them plus a cost per cuDNN call, per octave
// of a call's key rows and per query tile, in pairs.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <span>
#include <vector>

#include <lcx/attention_cost.h>
#include <lcx/rates.h>
#include <lcx/ops.h>

#include "layout.h"
#include "schedule.h"

namespace lcx::cp_ring {

// Masked causal attention's work for the queries at positions [a, b): a query at position p sees
// the p - s + 1 keys from its document's start s to itself, so it is the number of (query, key)
// pairs they compute. Exact integers, so every rank derives the same layout.
inline int64_t range_work(std::span<const int64_t> documents, int64_t a, int64_t b) {
  int64_t w = 0;
  for (auto d = std::upper_bound(documents.begin(), documents.end(), a) - 1; d + 1 < documents.end() && *d < b; ++d) {
    const int64_t s = d[0], lo = std::max(a, d[0]), hi = std::min(b, d[1]);
    if (hi > lo) w += (hi - lo) * (lo - s + 1 + hi - s) / 2;  // sum of lo-s+1 .. hi-s
  }
  return w;
}

// A sliding-window layer's work for the queries at positions [a, b): a query at position p sees
// min(W, p - s + 1) keys, s its document's start.
inline int64_t range_window_work(std::span<const int64_t> documents, int64_t a, int64_t b, int64_t window) {
  auto upto = [window](int64_t x) {  // sum of min(W, i) for i = 1 .. x
    return x <= window ? x * (x + 1) / 2 : window * (window + 1) / 2 + (x - window) * window;
  };
  if (documents.empty()) return upto(b) - upto(a);
  int64_t w = 0;
  for (auto d = std::upper_bound(documents.begin(), documents.end(), a) - 1; d + 1 < documents.end() && *d < b; ++d) {
    const int64_t s = d[0], lo = std::max(a, d[0]), hi = std::min(b, d[1]);
    if (hi > lo) w += upto(hi - s) - upto(lo - s);
  }
  return w;
}

// That work in each chunk of c rows.
inline std::vector<int64_t> chunk_work(std::span<const int64_t> documents, int64_t L, int64_t c) {
  std::vector<int64_t> w(static_cast<size_t>(L / c), 0);
  for (size_t i = 0; i < w.size(); ++i)
    w[i] = range_work(documents, static_cast<int64_t>(i) * c, static_cast<int64_t>(i + 1) * c);
  return w;
}

inline double work_spread(const ChunkLayout& layout, const std::vector<int64_t>& work) {
  std::vector<int64_t> load(static_cast<size_t>(layout.n), 0);
  for (int r = 0; r < layout.n; ++r)
    for (int64_t ch : layout.of(r)) load[static_cast<size_t>(r)] += work[static_cast<size_t>(ch)];
  const auto [mn, mx] = std::minmax_element(load.begin(), load.end());
  const double total = static_cast<double>(std::accumulate(load.begin(), load.end(), int64_t{0}));
  return total > 0 ? static_cast<double>(*mx - *mn) * layout.n / total : 0;
}

// What a round's work costs beyond its (query, key) pairs, in pairs: the rates the balance weighs.
// The defaults are the H200's fit (scripts/bench/cp_balance.sh prints it: each masked rank's time
// against the pairs its rounds compute, its calls, their octaves and its query tiles, least
// relative squares; 131,072 tokens, 32 query / 8 key-value heads of 128, book and short-document
// mixes, docs/PERF.md): a rank's forward + backward took 106.4 ms per 1e9 computed pairs, 0.060 ms
// a call, 0.022 ms a call octave and 4.2 us a query tile (median error 1.9%, p90 4.0%). Fewer heads
// make the pairs and tiles cheaper and the calls relatively dearer. call_pairs 0: the masked work
// alone (chunk_work), chunks of equal rows.
struct RingCosts {
  int64_t call_pairs = 570'000;       // a cuDNN call (0.060 ms over 106.4 ms per 1e9 pairs)
  double octave_calls = 0.36;         // in calls, each octave of a call's key rows above 512
                                      // (AttentionWork::call_octaves: 32,768 keys count 6)
  int64_t query_tile_pairs = 39'000;  // a tile of 128 query rows (AttentionWork::query_tiles: a
                                      // thread block of the forward, the backward's per-row passes)
  // The model's layers: full attention ones weigh their ring's cost, sliding-window ones (window
  // W) their windows' pairs (range_window_work); the balance weighs a layout by their sum.
  int64_t full_layers = 1, window_layers = 0, window = 0;
  bool timed() const { return call_pairs > 0; }
  // What the windowed layers add to the queries at positions [a, b).
  int64_t windowed(std::span<const int64_t> documents, int64_t a, int64_t b) const {
    return window_layers > 0 ? window_layers * range_window_work(documents, a, b, window) : 0;
  }
};

// The masked work alone ([cp_ring] balance = "work").
inline constexpr RingCosts kMaskedWorkOnly{0, 0.0, 0};

// The costs [cp_ring] balance = "time" weighs, from the rates row of the GPU the run plans for
// (share/lcx/rates.toml; `cp_ring_*` names), else the H200's fit above.
inline RingCosts ring_costs() {
  const RingCosts h200;
  return RingCosts{
      static_cast<int64_t>(device_rate("cp_ring_call_pairs", static_cast<double>(h200.call_pairs))),
      device_rate("cp_ring_octave_calls", h200.octave_calls),
      static_cast<int64_t>(device_rate("cp_ring_query_tile_pairs", static_cast<double>(h200.query_tile_pairs)))};
}

// The cost of work the GPU's batches run: its pairs, its calls and their key octaves, and its
// query tiles.
inline int64_t work_cost(const AttentionWork& w, const RingCosts& costs) {
  return w.pairs + costs.call_pairs * w.calls + costs.query_tile_pairs * w.query_tiles +
         static_cast<int64_t>(
             std::llround(costs.octave_calls * static_cast<double>(costs.call_pairs * w.call_octaves)));
}

// The work of the chunk pair (query chunk at position qg, key chunk at kg, c rows each) as the
// GPU runs it (lcx/attention_cost.h attention_work): the documents both chunks hold, causal on the
// diagonal (qg == kg) and full where the keys precede the queries.
inline AttentionWork pair_work(std::span<const int64_t> documents, int64_t qg, int64_t kg, int64_t c) {
  std::vector<int64_t> ql, kl;
  auto first = std::upper_bound(documents.begin(), documents.end(), std::min(qg, kg)) - 1;
  for (auto d = first; d + 1 < documents.end() && *d < std::max(qg, kg) + c; ++d) {
    const int64_t nq = std::min(d[1], qg + c) - std::max(d[0], qg), nk = std::min(d[1], kg + c) - std::max(d[0], kg);
    if (nq <= 0 || nk <= 0) continue;
    ql.push_back(nq);
    kl.push_back(nk);
  }
  return attention_work(ql, kl, qg == kg);
}

// Each chunk's cost for a layout to balance. Untimed costs: its masked work (chunk_work). Else the
// padded pairs of every chunk pair it is the query side of (the earlier chunks that hold part of
// its first document, and itself) plus their calls' cost (work_cost). Either depends on the chunk alone,
// not on which ranks hold it, so a rank's cost is the sum of its chunks'.
inline std::vector<int64_t> chunk_cost(std::span<const int64_t> documents, int64_t L, int64_t c,
                                       const RingCosts& costs) {
  std::vector<int64_t> w(static_cast<size_t>(L / c), 0);
  if (!costs.timed()) {
    w = chunk_work(documents, L, c);
    for (auto& x : w) x *= costs.full_layers;
  }
  for (size_t i = 0; i < w.size(); ++i) {
    const int64_t at = static_cast<int64_t>(i) * c;
    if (costs.timed()) {
      const int64_t start = *(std::upper_bound(documents.begin(), documents.end(), at) - 1);
      int64_t full = 0;
      for (int64_t j = start / c; j <= static_cast<int64_t>(i); ++j) full += work_cost(pair_work(documents, at, j * c, c), costs);
      w[i] = costs.full_layers * full;
    }
    w[i] += costs.windowed(documents, at, at + c);
  }
  return w;
}

// The work of a round as the GPU runs it (lcx/attention_cost.h attention_work): each block one
// document.
inline AttentionWork round_work(const Round& round) {
  std::vector<int64_t> ql, kl;
  ql.reserve(round.blocks.size());
  kl.reserve(round.blocks.size());
  for (const ops::AttentionBlock& b : round.blocks) {
    ql.push_back(b.q_rows);
    kl.push_back(b.k_rows);
  }
  return attention_work(ql, kl, round.causal);
}

// Rank r's predicted cost over the whole ring: every round's computed pairs plus its calls' cost
// (work_cost), times the full layers, plus the windowed layers' pairs on its chunks.
inline int64_t rank_cost(const ChunkLayout& layout, int r, std::span<const int64_t> documents,
                         const RingCosts& costs) {
  int64_t cost = 0;
  if (costs.full_layers > 0)
    for (int j = 0; j < layout.n; ++j)
      for (const Round& round : step_rounds(r, j, layout, true, documents)) {
        const AttentionWork w = round_work(round);
        cost += work_cost(w, costs);
      }
  cost *= costs.full_layers;
  for (int64_t ch : layout.of(r)) cost += costs.windowed(documents, layout.begin(ch), layout.begin(ch) + layout.rows(ch));
  return cost;
}

// Every rank's rank_cost under the layout.
inline std::vector<int64_t> ranks_cost(const ChunkLayout& layout, std::span<const int64_t> documents,
                                       const RingCosts& costs) {
  std::vector<int64_t> out(static_cast<size_t>(layout.n));
  for (int r = 0; r < layout.n; ++r) out[static_cast<size_t>(r)] = rank_cost(layout, r, documents, costs);
  return out;
}

// The layout's predicted spread, (max - min) / mean, of its ranks' costs.
inline void set_spread(ChunkLayout& layout, const std::vector<int64_t>& costs) {
  const auto [mn, mx] = std::minmax_element(costs.begin(), costs.end());
  const double total = static_cast<double>(std::accumulate(costs.begin(), costs.end(), int64_t{0}));
  layout.spread = total > 0 ? static_cast<double>(*mx - *mn) * layout.n / total : 0;
}

// Each rank's predicted cost of a layout: over its ring steps' rounds (rank_cost) when the costs
// are timed, else the sum of its chunks' masked work. Sets the layout's predicted spread.
inline std::vector<int64_t> rank_costs(ChunkLayout& layout, std::span<const int64_t> documents,
                                       const std::vector<int64_t>& chunk_costs, const RingCosts& costs) {
  std::vector<int64_t> out(static_cast<size_t>(layout.n), 0);
  if (costs.timed()) out = ranks_cost(layout, documents, costs);
  else
    for (int r = 0; r < layout.n; ++r)
      for (int64_t ch : layout.of(r)) out[static_cast<size_t>(r)] += chunk_costs[static_cast<size_t>(ch)];
  set_spread(layout, out);
  return out;
}

}  // namespace lcx::cp_ring
