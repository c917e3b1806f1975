// The chunk layouts balanced for packed documents: a greedy layout per chunk count, refined by
// chunk swaps and by moving the bounds between chunks, each costed by the model of cost.h; the
// one whose slowest rank costs least is taken.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <span>
#include <tuple>
#include <utility>
#include <vector>

#include <lcx/attention_cost.h>

#include "cost.h"
#include "layout.h"

namespace lcx::cp_ring {

inline constexpr int kSwapPasses = 64;

// Longest processing time first under a cardinality cap: chunks by descending work, each to the
// least loaded rank that holds fewer than 2k (the lowest rank on ties). At k = 1 this pairs the
// heaviest chunk with the lightest, which is optimal for pairs.
inline ChunkLayout greedy_layout(const std::vector<int64_t>& work, int n, int64_t k, int64_t c) {
  std::vector<int64_t> order(work.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return work[static_cast<size_t>(a)] > work[static_cast<size_t>(b)]; });
  std::vector<int64_t> load(static_cast<size_t>(n), 0);
  std::vector<std::vector<int64_t>> held(static_cast<size_t>(n));
  for (int64_t ch : order) {
    size_t best = held.size();
    for (size_t r = 0; r < held.size(); ++r)
      if (static_cast<int64_t>(held[r].size()) < 2 * k && (best == held.size() || load[r] < load[best])) best = r;
    held[best].push_back(ch);
    load[best] += work[static_cast<size_t>(ch)];
  }
  // Then the best swap of a chunk of the most loaded rank with a lighter one of another rank, while
  // one lowers the larger of the two loads (at most kSwapPasses, each of 4 k^2 n comparisons).
  for (int pass = 0; pass < kSwapPasses; ++pass) {
    const size_t top = static_cast<size_t>(std::max_element(load.begin(), load.end()) - load.begin());
    int64_t best = load[top];
    size_t bs = 0, ba = 0, bb = 0;
    for (size_t s = 0; s < held.size(); ++s) {
      if (s == top) continue;
      for (size_t a = 0; a < held[top].size(); ++a)
        for (size_t b = 0; b < held[s].size(); ++b) {
          const int64_t d = work[static_cast<size_t>(held[top][a])] - work[static_cast<size_t>(held[s][b])];
          const int64_t worse = std::max(load[top] - d, load[s] + d);
          if (d > 0 && worse < best) best = worse, bs = s, ba = a, bb = b;
        }
    }
    if (best == load[top]) break;
    const int64_t d = work[static_cast<size_t>(held[top][ba])] - work[static_cast<size_t>(held[bs][bb])];
    std::swap(held[top][ba], held[bs][bb]);
    load[top] -= d;
    load[bs] += d;
  }
  ChunkLayout out{n, k, c, {}, 0, {}};
  for (auto& h : held) {
    std::sort(h.begin(), h.end());
    out.chunks.insert(out.chunks.end(), h.begin(), h.end());
  }
  out.spread = work_spread(out, work);
  return out;
}

// The smallest chunk a balanced layout cuts: pieces of fewer rows run the GPU's attention kernels
// below their rate, and each costs a kernel call.
inline constexpr int64_t kMinChunkRows = 512;
// Nor more than 2 kMaxK chunks a rank: the cost model put the best k at most 8 for the book and
// short-document mixes of docs/PERF.md from 131,072 to 1,048,576 tokens on 2 to 8 ranks, and
// costing layouts of hundreds of chunks a rank takes most of a second of host time a sequence.
inline constexpr int64_t kMaxK = 32;

// A layout replaces the one in hand only when it lowers the slowest rank's cost by more than this
// share: the model's error on the H200 was a few percent.
inline constexpr double kMinGain = 0.01;
// balanced_layout stops trying finer chunks once a layout's slowest rank costs this much more than
// the best so far.
inline constexpr double kStopAbove = 1.25;
// Of the layouts tried, those whose slowest rank costs at most this much more than the best's are
// taken as equally fast (the model's error is a few percent), and the most even of them is chosen:
// the least slowest alone can leave a rank idle a quarter of the ring (short documents on 8 ranks).
inline constexpr double kSpreadBand = 0.02;

// A greedy layout balances each chunk's own cost, but a rank's steps share their cuDNN calls
// (rounds), so the ranks' costs as they run differ from those sums. Refined against them: the swap
// of a chunk of the slowest rank with a chunk of another rank that lowers the larger of the two
// ranks' costs the most, while one lowers the slowest rank's cost; then the swap of a chunk of the
// fastest rank that lifts the smaller of the two the most without reaching the slowest. At most
// kRefinePasses swaps in all, each of 4 k^2 (n - 1) pairs costed, and only for layouts of up to
// kRefineMaxChunks chunks a rank, where one chunk is a large share of a rank's work and costing
// stays cheap (balanced_layout runs on the host once per sequence). A swap moves where keys arrive for other ranks too, so every rank is recosted after
// each and a swap that raises the slowest is undone. On the model, short documents on 8 ranks: 4
// chunks a rank refined from a 37% spread to 2.5% (docs/PERF.md).
inline constexpr int kRefinePasses = 16;
inline constexpr int64_t kRefineMaxChunks = 8;

inline void refine_layout(ChunkLayout& layout, std::span<const int64_t> documents, const RingCosts& model,
                          std::vector<int64_t>& costs) {
  const int n = layout.n;
  const int64_t per = 2 * layout.k;
  if (!model.timed() || per > kRefineMaxChunks || n < 2) return;
  auto swapped = [&](const ChunkLayout& l, int a, size_t ia, int b, size_t ib) {
    ChunkLayout t = l;
    std::swap(t.chunks[static_cast<size_t>(per * a) + ia], t.chunks[static_cast<size_t>(per * b) + ib]);
    for (int r : {a, b})
      std::sort(t.chunks.begin() + per * r, t.chunks.begin() + per * (r + 1));
    return t;
  };
  // The best swap of a chunk of rank `of` with one of another rank, by `score` of the two ranks'
  // costs after it (higher is better; only scores above `floor` count): -1 when none.
  struct Swap {
    int b = -1;
    size_t ia = 0, ib = 0;
  };
  auto best_swap = [&](int of, int64_t floor, auto score) {
    Swap best;
    for (int b = 0; b < n; ++b) {
      if (b == of) continue;
      for (size_t ia = 0; ia < static_cast<size_t>(per); ++ia)
        for (size_t ib = 0; ib < static_cast<size_t>(per); ++ib) {
          const ChunkLayout t = swapped(layout, of, ia, b, ib);
          const int64_t s = score(rank_cost(t, of, documents, model), rank_cost(t, b, documents, model));
          if (s > floor) floor = s, best = {b, ia, ib};
        }
    }
    return best;
  };
  for (int pass = 0; pass < kRefinePasses; ++pass) {
    const auto [lo, hi] = std::minmax_element(costs.begin(), costs.end());
    const int top = static_cast<int>(hi - costs.begin()), low = static_cast<int>(lo - costs.begin());
    const int64_t most = *hi, least = *lo;
    // First lower the slowest rank, whose time is the step's; when no swap does, lift the fastest
    // without raising the slowest: the step's time stays and the ranks even out (every ring step
    // waits for the slower neighbour).
    int of = top;
    Swap sw = best_swap(top, -most, [](int64_t x, int64_t y) { return -std::max(x, y); });
    if (sw.b < 0) {
      of = low;
      sw = best_swap(low, least, [most](int64_t x, int64_t y) { return std::max(x, y) < most ? std::min(x, y) : 0; });
    }
    if (sw.b < 0) return;
    ChunkLayout t = swapped(layout, of, sw.ia, sw.b, sw.ib);
    std::vector<int64_t> c = ranks_cost(t, documents, model);
    const auto [nlo, nhi] = std::minmax_element(c.begin(), c.end());
    if (*nhi > most || (*nhi == most && *nlo <= least)) return;
    layout = std::move(t);
    costs = std::move(c);
  }
}

// Whole chunks cannot always even the ranks out: with three books on 8 ranks, two chunks a rank
// left one rank 10% lighter than the rest, and finer chunks cost every rank more calls. So the
// bounds between chunks move, in whole tiles of kBoundStep rows. A slide takes two chunks of one
// rank and moves every bound between them by the same rows: the first grows at its end, the
// second shrinks at its start, the chunks between shift along the sequence, and every rank keeps
// its 2kc rows (so K/V blocks stay equal-sized). A layout scores by its slowest rank's cost, then
// the gap to its fastest, then the sum of squared costs; every rank is recosted for each slide,
// since where its keys and queries fall changes for many. First Newton steps on all ranks' slides
// at once (one rank's slide alone cannot lower several ranks tied at the slowest), then single
// slides, the best of each pass, to polish. A chunk keeps at least kBoundStep rows. For layouts of
// up to kSlideMaxChunks chunks a rank, where one chunk is a large share of a rank's work; finer
// ones are evened by refine_layout's swaps. On the model (docs/PERF.md), the book and
// short-document mixes at 131,072 tokens on 2-8 ranks spread at most 2.3% with moved bounds
// against up to 10.9% without, the slowest rank up to 12% faster; balanced_layout takes at most
// 0.3 s of host time at 131,072 tokens and 1.0 s at 1,048,576 (one core of the CI machine), once
// per sequence.
inline constexpr int64_t kBoundStep = kAttentionTileRows;
inline constexpr int kBoundPasses = 16;
inline constexpr int kNewtonSteps = 8;
inline constexpr int64_t kSlideMaxChunks = 4;

// even_bounds' Newton step: given J[r][v], rank r's cost change per row slid along slide v, the
// rows to slide along each so that every rank reaches one common cost, by least squares: minimize
// |costs + J d - goal|^2 + ridge |d|^2 over the slides d and the goal, through the normal
// equations (Gauss-Jordan with partial pivoting). The small ridge keeps the steps short where
// slides overlap (several reach the same bounds).
inline std::vector<double> common_cost_slides(const std::vector<std::vector<double>>& J,
                                              const std::vector<int64_t>& costs) {
  const size_t V = J.empty() ? 0 : J[0].size(), U = V + 1;  // the slides, then the goal
  std::vector<std::vector<double>> M(U, std::vector<double>(U + 1, 0));
  for (size_t r = 0; r < J.size(); ++r) {
    std::vector<double> row(J[r]);
    row.push_back(-1.0);
    for (size_t i = 0; i < U; ++i) {
      for (size_t j = 0; j < U; ++j) M[i][j] += row[i] * row[j];
      M[i][U] -= row[i] * static_cast<double>(costs[r]);
    }
  }
  double trace = 0;
  for (size_t v = 0; v < V; ++v) trace += M[v][v];
  const double ridge = trace > 0 ? 1e-3 * trace / static_cast<double>(V) : 1.0;
  for (size_t v = 0; v < V; ++v) M[v][v] += ridge;
  for (size_t i = 0; i < U; ++i) {
    size_t p = i;
    for (size_t j = i + 1; j < U; ++j)
      if (std::abs(M[j][i]) > std::abs(M[p][i])) p = j;
    std::swap(M[i], M[p]);
    if (std::abs(M[i][i]) < 1e-30) continue;
    const double pivot = M[i][i];
    for (double& x : M[i]) x /= pivot;
    for (size_t j = 0; j < U; ++j)
      if (j != i && M[j][i] != 0) {
        const double f = M[j][i];
        for (size_t k = i; k <= U; ++k) M[j][k] -= f * M[i][k];
      }
  }
  std::vector<double> d(V);
  for (size_t v = 0; v < V; ++v) d[v] = M[v][U];
  return d;
}

inline void even_bounds(ChunkLayout& layout, std::span<const int64_t> documents, const RingCosts& model,
                        std::vector<int64_t>& costs) {
  const int n = layout.n;
  const int64_t per = 2 * layout.k, m = per * n;
  if (!model.timed() || per > kSlideMaxChunks || n < 2 || layout.c < 2 * kBoundStep) return;
  ChunkLayout t = layout;
  if (t.bounds.empty())
    for (int64_t i = 0; i <= m; ++i) t.bounds.push_back(i * t.c);
  std::vector<std::pair<int64_t, int64_t>> slides;  // two chunks of one rank, in position order
  for (int r = 0; r < n; ++r)
    for (size_t x = 0; x < static_cast<size_t>(per); ++x)
      for (size_t y = x + 1; y < static_cast<size_t>(per); ++y) slides.emplace_back(t.of(r)[x], t.of(r)[y]);
  // Lower is better; the squares break ties of the first two (they fall as the ranks even out).
  auto score = [](const std::vector<int64_t>& c) {
    double squares = 0;
    for (int64_t x : c) squares += static_cast<double>(x) * static_cast<double>(x);
    const auto [lo, hi] = std::minmax_element(c.begin(), c.end());
    return std::tuple{*hi, *hi - *lo, squares};
  };
  // Slide chunks `first` .. `second` by s rows: false where a chunk would keep under kBoundStep.
  auto slide = [&](ChunkLayout& l, int64_t first, int64_t second, int64_t s) {
    if (l.rows(first) + s < kBoundStep || l.rows(second) - s < kBoundStep) return false;
    for (int64_t i = first + 1; i <= second; ++i) l.bounds[static_cast<size_t>(i)] += s;
    return true;
  };
  // Newton steps on the slides of each rank's neighbouring chunks (together they reach every way of
  // moving the bounds that keeps the ranks' rows): each slide's effect on every rank's cost
  // measured by moving it a quarter chunk, then the slides that bring all ranks to one cost
  // (common_cost_slides), rounded to tiles, and kept when the score improves (else the step
  // halved, twice). In doubles, unlike the integer costs: every rank runs the same build on the
  // same bounds, so all derive one layout.
  std::vector<std::pair<int64_t, int64_t>> axes;
  for (int r = 0; r < n; ++r)
    for (size_t x = 0; x + 1 < static_cast<size_t>(per); ++x) axes.emplace_back(t.of(r)[x], t.of(r)[x + 1]);
  const size_t V = axes.size();
  const int64_t probe = std::max(kBoundStep, t.c / 4 / kBoundStep * kBoundStep);
  for (int step = 0; step < kNewtonSteps; ++step) {
    // J[r][v]: rank r's cost change per row slid along axis v.
    std::vector<std::vector<double>> J(static_cast<size_t>(n), std::vector<double>(V, 0));
    for (size_t v = 0; v < V; ++v) {
      // Central differences where both ways are open: a slide's cost moves in small jumps where
      // bounds cross documents' ends, and the two sides average them out.
      ChunkLayout up = t, down = t;
      const bool u_ok = slide(up, axes[v].first, axes[v].second, probe);
      const bool d_ok = slide(down, axes[v].first, axes[v].second, -probe);
      if (!u_ok && !d_ok) continue;
      const std::vector<int64_t> cu = u_ok ? ranks_cost(up, documents, model) : costs;
      const std::vector<int64_t> cd = d_ok ? ranks_cost(down, documents, model) : costs;
      const double span = static_cast<double>(probe * (u_ok + d_ok));
      for (size_t r = 0; r < static_cast<size_t>(n); ++r) J[r][v] = static_cast<double>(cu[r] - cd[r]) / span;
    }
    const std::vector<double> rows = common_cost_slides(J, costs);
    bool kept = false;
    for (double scale : {1.0, 0.5, 0.25}) {
      ChunkLayout u = t;
      bool ok = true, any = false;
      for (size_t v = 0; v < V && ok; ++v) {
        const double slid = scale * rows[v];  // rows along slide v
        if (!(std::abs(slid) < static_cast<double>(t.bounds.back()))) {  // a singular system's answer
          ok = false;
          break;
        }
        const int64_t s = static_cast<int64_t>(std::llround(slid / static_cast<double>(kBoundStep))) * kBoundStep;
        if (s != 0) ok = slide(u, axes[v].first, axes[v].second, s), any = true;
      }
      if (!ok || !any) continue;
      std::vector<int64_t> c = ranks_cost(u, documents, model);
      if (!(score(c) < score(costs))) continue;
      t = std::move(u);
      costs = std::move(c);
      kept = true;
      break;
    }
    if (!kept) break;
  }
  // Then single slides of any two chunks of a rank, each step from half a chunk down to a tile,
  // both ways: the best of each pass while one improves the score.
  for (int pass = 0; pass < kBoundPasses; ++pass) {
    auto best_score = score(costs);
    ChunkLayout best;
    std::vector<int64_t> best_costs;
    for (const auto& [first, second] : slides)
      for (int64_t d = t.c / 2 / kBoundStep * kBoundStep; d >= kBoundStep; d /= 2)
        for (const int64_t s : {d, -d}) {
          ChunkLayout u = t;
          if (!slide(u, first, second, s)) continue;
          std::vector<int64_t> c = ranks_cost(u, documents, model);
          const auto sc = score(c);
          if (!(sc < best_score)) continue;
          best_score = sc;
          best = std::move(u);
          best_costs = std::move(c);
        }
    if (best_costs.empty()) break;
    t = std::move(best);
    costs = std::move(best_costs);
  }
  bool moved = false;
  for (int64_t i = 0; i <= m; ++i) moved = moved || t.bounds[static_cast<size_t>(i)] != i * t.c;
  if (!moved) t.bounds.clear();
  layout = std::move(t);
}

// The chunks each of n ranks holds for a sequence of L tokens (L a multiple of 2n) with packed
// documents' cumulative bounds: of the zigzag and the greedy layouts for k = 1, 2, 4, ... (while
// chunks keep at least kMinChunkRows rows and divide L; when timed, k at most kMaxK and until one
// costs kStopAbove times the best), the one whose slowest rank costs least. The greedy layouts
// balance chunk_cost (additive, so a chunk's cost is its own), then refine_layout and even_bounds
// even them by what each rank's ring steps run; the choice between them weighs that too
// (rank_cost: every round's computed pairs, query tiles and calls, since a step's chunk pairs share
// calls), each larger k kept only for a gain over kMinGain, and of those within kSpreadBand of the
// least slowest the most even. Untimed costs (kMaskedWorkOnly)
// balance and choose by the masked work alone (any gain counts; chunks stay equal). The zigzag
// always without documents or with one. Every rank holds 2k chunks of 2kc rows in all, so K/V
// blocks stay equal-sized. `spread` is the chosen layout's predicted spread of that cost.
inline ChunkLayout balanced_layout(std::span<const int64_t> documents, int64_t L, int n,
                                   const RingCosts& model = ring_costs()) {
  ChunkLayout best = zigzag_layout(L, n);
  if (n == 1 || documents.size() <= 2) return best;
  const std::vector<int64_t> cost = chunk_cost(documents, L, best.c, model);
  auto slowest = [](const std::vector<int64_t>& costs) { return *std::max_element(costs.begin(), costs.end()); };
  int64_t best_max = slowest(rank_costs(best, documents, cost, model));
  std::vector<std::pair<ChunkLayout, int64_t>> tried{{best, best_max}};
  for (int64_t k = 1; L % (2 * n * k) == 0 && (k == 1 || L / (2 * n * k) >= kMinChunkRows) &&
                     (!model.timed() || k <= kMaxK);
       k *= 2) {
    const int64_t c = L / (2 * n * k);
    const std::vector<int64_t> ck = k == 1 ? cost : chunk_cost(documents, L, c, model);
    ChunkLayout g = greedy_layout(ck, n, k, c);
    std::vector<int64_t> costs = rank_costs(g, documents, ck, model);
    refine_layout(g, documents, model, costs);  // hands back the refined layout's costs
    even_bounds(g, documents, model, costs);    // and so does this
    set_spread(g, costs);
    const int64_t m = slowest(costs);
    const double gain = model.timed() ? kMinGain : 0.0;  // balanced for work alone, any gain counts
    if (model.timed()) tried.emplace_back(g, m);
    if (static_cast<double>(m) < (1.0 - gain) * static_cast<double>(best_max)) best = std::move(g), best_max = m;
    // Past the best k the calls and cut documents only add up: stop well above it (costing a
    // layout of many small chunks is most of this function's time at a million tokens).
    else if (model.timed() && static_cast<double>(m) > kStopAbove * static_cast<double>(best_max)) break;
  }
  for (auto& [l, m] : tried)
    if (static_cast<double>(m) <= (1.0 + kSpreadBand) * static_cast<double>(best_max) && l.spread < best.spread)
      best = std::move(l);
  return best;
}

}  // namespace lcx::cp_ring
