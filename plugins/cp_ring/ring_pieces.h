// The ring's schedule of attention work (cp_ring.cpp's header comment explains the zigzag): which
// query rows of rank r's shard meet which key rows of the block in hand at each ring step, and,
// with packed documents, which chunks of the sequence each rank holds. Shared by the plugin and
// tests/bench/cp_balance_bench.cpp, which times each rank's schedule alone.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <numeric>
#include <span>
#include <tuple>
#include <vector>

#include <lcx/attention_cost.h>
#include <lcx/ops.h>

namespace lcx::cp_ring {

// One query-rows x key-rows piece of a ring step, in the rank's local rows.
struct Piece {
  int64_t q_begin, q_end, k_begin, k_end;
  bool causal;  // a diagonal chunk pair: equal positions, mask above the diagonal
};

// The pieces of rank r's queries against the block of rank j; c is one chunk's length.
inline std::vector<Piece> pieces_for(int r, int j, int64_t c, bool causal) {
  if (!causal) return {{0, 2 * c, 0, 2 * c, false}};
  if (j == r) return {{0, c, 0, c, true}, {c, 2 * c, 0, c, false}, {c, 2 * c, c, 2 * c, true}};
  if (j < r) return {{0, 2 * c, 0, c, false}};
  return {{c, 2 * c, 0, 2 * c, false}};
}

// Which chunks of the sequence each rank holds: the sequence cut into 2 n k chunks, rank r holding
// 2k of them, in position order, as its rows [0, L / n). k = 1 with rank r holding chunks r and
// 2n-1-r is the zigzag. Chunks are c rows each unless a balanced layout moved their bounds
// (even_bounds): then `bounds` holds where each starts, the sequence's end last, and each rank's
// chunks still sum to 2kc rows, so K/V blocks stay equal-sized.
struct ChunkLayout {
  int n = 1;
  int64_t k = 1, c = 0;
  std::vector<int64_t> chunks;  // rank r's chunk indices at [2kr, 2k(r+1)), ascending
  double spread = 0;            // predicted (max - min) / mean of the ranks' work (chunk_work)
  std::vector<int64_t> bounds;  // 2nk + 1 chunk starts and the end; empty: c rows each

  std::span<const int64_t> of(int r) const {
    return std::span<const int64_t>(chunks).subspan(static_cast<size_t>(2 * k * r), static_cast<size_t>(2 * k));
  }
  int64_t begin(int64_t ch) const { return bounds.empty() ? ch * c : bounds[static_cast<size_t>(ch)]; }
  int64_t rows(int64_t ch) const {
    return bounds.empty() ? c : bounds[static_cast<size_t>(ch) + 1] - bounds[static_cast<size_t>(ch)];
  }
  // The position in the sequence of rank r's local row.
  int64_t position(int r, int64_t row) const {
    for (int64_t ch : of(r)) {
      if (row < rows(ch)) return begin(ch) + row;
      row -= rows(ch);
    }
    return -1;  // past the rank's rows
  }
};

inline ChunkLayout zigzag_layout(int64_t L, int n) {
  ChunkLayout z{n, 1, L / (2 * n), {}, 0, {}};
  for (int r = 0; r < n; ++r) z.chunks.insert(z.chunks.end(), {r, 2 * n - 1 - r});
  return z;
}

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
// Nor more than 2 kMaxK chunks a rank: the cost model put the best k at most 8 for issue 23's
// length mixes from 131,072 to 1,048,576 tokens on 2 to 8 ranks, and costing layouts of hundreds
// of chunks a rank took most of a second of host time a sequence.
inline constexpr int64_t kMaxK = 32;

// What a round's work costs beyond its pairs, in (query, key) pairs: a fixed cost a cuDNN call,
// kCallCostPairs, and kOctaveCalls times that for each octave of the call's key rows above 512
// (AttentionWork::call_octaves: a call of 32,768 keys counts 6, one of 512 or fewer none); and
// kQueryTilePairs for each tile of 128 query rows (AttentionWork::query_tiles: a thread block of
// the forward, and the backward's passes over each query row), which short documents' small
// blocks pay far more of per pair than books. Fitted on the H200 (scripts/bench/cp_balance.sh
// prints the fit: each masked rank's time against the pairs its rounds compute, its calls, their
// octaves and its query tiles, least relative squares; 131,072 tokens, 32 query / 8 key-value
// heads of 128, book and short-document mixes, seeds 1-3, two runs, docs/PERF.md): a rank's
// forward + backward took 106.4 ms per 1e9 computed pairs, 0.060 ms a call, 0.022 ms a call
// octave and 4.2 us a query tile over 279 rank times (median error 1.9%, p90 4.0%). Without the
// tiles (the fit before it), two layouts of short documents on 8 ranks, predicted within 6% of
// even, ran 12% and 14% apart. Fewer heads make the pairs and tiles cheaper and the calls
// relatively dearer.
inline constexpr int64_t kCallCostPairs = 570'000;
inline constexpr double kOctaveCalls = 0.36;
inline constexpr int64_t kQueryTilePairs = 39'000;

// The cost of work the GPU's batches run: its pairs, its calls at call_cost each plus their key
// octaves, and its query tiles.
inline int64_t work_cost(const AttentionWork& w, int64_t call_cost) {
  return w.pairs + call_cost * w.calls + kQueryTilePairs * w.query_tiles +
         static_cast<int64_t>(std::llround(kOctaveCalls * static_cast<double>(call_cost * w.call_octaves)));
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

// Each chunk's cost for a layout to balance. call_cost 0: its masked work (chunk_work). Else the
// padded pairs of every chunk pair it is the query side of (the earlier chunks that hold part of
// its first document, and itself) plus their calls' cost (work_cost). Either depends on the chunk alone,
// not on which ranks hold it, so a rank's cost is the sum of its chunks'.
inline std::vector<int64_t> chunk_cost(std::span<const int64_t> documents, int64_t L, int64_t c, int64_t call_cost) {
  if (call_cost == 0) return chunk_work(documents, L, c);
  std::vector<int64_t> w(static_cast<size_t>(L / c), 0);
  for (size_t i = 0; i < w.size(); ++i) {
    const int64_t at = static_cast<int64_t>(i) * c;
    const int64_t start = *(std::upper_bound(documents.begin(), documents.end(), at) - 1);
    for (int64_t j = start / c; j <= static_cast<int64_t>(i); ++j) {
      const AttentionWork pw = pair_work(documents, at, j * c, c);
      w[i] += work_cost(pw, call_cost);
    }
  }
  return w;
}

inline int64_t max_rank_cost(const ChunkLayout& layout, const std::vector<int64_t>& cost) {
  int64_t most = 0;
  for (int r = 0; r < layout.n; ++r) {
    int64_t sum = 0;
    for (int64_t ch : layout.of(r)) sum += cost[static_cast<size_t>(ch)];
    most = std::max(most, sum);
  }
  return most;
}

// A layout replaces the one in hand only when it lowers the slowest rank's cost by more than this
// share: the model's error on the H200 was a few percent.
inline constexpr double kMinGain = 0.01;
// balanced_layout stops trying finer chunks once a layout's slowest rank costs this much more than
// the best so far.
inline constexpr double kStopAbove = 1.25;
// Of the layouts tried, those whose slowest rank costs at most this much more than the best's are
// taken as equally fast, and the most even of them is chosen.
inline constexpr double kSpreadBand = 0.02;

// A piece with the positions in the sequence of its first query row and first key row.
struct PlacedPiece {
  Piece piece;
  int64_t q_pos, k_pos;
};

// With packed documents (cumulative bounds over the sequence): rank r's pieces against rank j's
// block, one per chunk pair (one query chunk, one key chunk, each contiguous in the sequence)
// placed at their positions, so the bounds apply as they are; a pair whose chunks share no
// document, or whose keys all follow its queries, is left out, since none of its queries sees any
// of its keys.
inline std::vector<PlacedPiece> document_pieces(int r, int j, const ChunkLayout& layout, bool causal,
                                                std::span<const int64_t> documents) {
  auto document = [&](int64_t pos) { return std::upper_bound(documents.begin(), documents.end(), pos) - documents.begin(); };
  std::vector<PlacedPiece> out;
  const std::span<const int64_t> qs = layout.of(r), ks = layout.of(j);
  // Each key chunk's first and last documents, looked up once rather than once per query chunk
  // (this runs for every rank pair of every layout balanced_layout costs).
  out.reserve(qs.size() * ks.size());
  std::vector<int64_t> kfirst(ks.size()), klast(ks.size());
  for (size_t i = 0; i < ks.size(); ++i) {
    const int64_t kg = layout.begin(ks[i]);
    kfirst[i] = document(kg);
    klast[i] = document(kg + layout.rows(ks[i]) - 1);
  }
  int64_t qa = 0;  // local rows where the chunks start
  for (const int64_t qc : qs) {
    const int64_t qg = layout.begin(qc), qn = layout.rows(qc);
    const int64_t qfirst = document(qg), qlast = document(qg + qn - 1);
    int64_t kb = 0;
    for (size_t i = 0; i < ks.size(); ++i) {
      const int64_t kg = layout.begin(ks[i]), kn = layout.rows(ks[i]);
      if (!(causal && kg > qg) && qlast >= kfirst[i] && klast[i] >= qfirst)
        out.push_back({{qa, qa + qn, kb, kb + kn, causal && kg == qg}, qg, kg});
      kb += kn;
    }
    qa += qn;
  }
  return out;
}

// A ring step's work with packed documents as few calls (ops::attention_forward_blocks): each
// document's rows in a query chunk against its rows in a key chunk, for every chunk pair of the
// step (document_pieces), is one block, in rank r's local rows and the block's rows; the blocks go
// into rounds, each one call, in which no two blocks share a query row or a key row. Rows of
// different documents never meet, so only one document's blocks can clash: the block of its i-th
// query chunk and j-th key chunk (among those it has in this step, in order) goes to round
// j - i + (its query chunks - 1), one diagonal of its grid of chunk pairs. A diagonal's blocks
// ascend in query rows and in key rows together, as do the documents one after another, so each
// round's blocks ascend on both sides, the layout cuDNN's packed callers give its ragged offsets
// (a Latin square, round (i + j) mod m, would need fewer rounds for a book across many chunks but
// puts blocks in descending key order). A document inside one chunk pair has one block; one
// split across two key chunks two rounds. The diagonal blocks (a chunk against itself, causal
// within each document) are a round of their own.
// Before, each chunk pair was its own call: with short documents and 2k chunks a rank, up to 4k^2
// calls a step, each with its batches, table upload and merge.
struct Round {
  bool causal = false;
  std::vector<ops::AttentionBlock> blocks;
};

inline std::vector<Round> step_rounds(int r, int j, const ChunkLayout& layout, bool causal,
                                      std::span<const int64_t> documents) {
  struct Tagged {
    int64_t doc, qa, kb;
    ops::AttentionBlock block;
  };
  std::vector<Tagged> full;
  Round diagonal{true, {}};
  for (const PlacedPiece& pp : document_pieces(r, j, layout, causal, documents)) {
    const Piece& p = pp.piece;
    const int64_t q_end = pp.q_pos + p.q_end - p.q_begin, k_end = pp.k_pos + p.k_end - p.k_begin;
    auto d = std::upper_bound(documents.begin(), documents.end(), std::min(pp.q_pos, pp.k_pos)) - 1;
    for (; d + 1 < documents.end() && *d < std::max(q_end, k_end); ++d) {
      const int64_t qb = std::max(d[0], pp.q_pos), qe = std::min(d[1], q_end);
      const int64_t kb = std::max(d[0], pp.k_pos), ke = std::min(d[1], k_end);
      if (qe <= qb || ke <= kb) continue;
      const ops::AttentionBlock b{p.q_begin + qb - pp.q_pos, qe - qb, p.k_begin + kb - pp.k_pos, ke - kb};
      if (p.causal) diagonal.blocks.push_back(b);
      else full.push_back({d - documents.begin(), p.q_begin, p.k_begin, b});
    }
  }
  std::vector<Round> out;
  if (!diagonal.blocks.empty()) out.push_back(std::move(diagonal));
  // Per document, its query chunks and key chunks in order: its grid's rows and columns.
  std::map<int64_t, std::pair<std::vector<int64_t>, std::vector<int64_t>>> chunks_of;
  for (const Tagged& t : full) {
    auto& [qs, ks] = chunks_of[t.doc];
    if (std::find(qs.begin(), qs.end(), t.qa) == qs.end()) qs.push_back(t.qa);
    if (std::find(ks.begin(), ks.end(), t.kb) == ks.end()) ks.push_back(t.kb);
  }
  for (auto& [doc, qk] : chunks_of) {
    std::sort(qk.first.begin(), qk.first.end());
    std::sort(qk.second.begin(), qk.second.end());
  }
  const size_t first_full = out.size();
  for (const Tagged& t : full) {
    const auto& [qs, ks] = chunks_of[t.doc];
    const size_t i = static_cast<size_t>(std::lower_bound(qs.begin(), qs.end(), t.qa) - qs.begin());
    const size_t jj = static_cast<size_t>(std::lower_bound(ks.begin(), ks.end(), t.kb) - ks.begin());
    const size_t round = first_full + jj + qs.size() - 1 - i;
    if (out.size() <= round) out.resize(round + 1);
    out[round].blocks.push_back(t.block);
  }
  std::erase_if(out, [](const Round& x) { return x.blocks.empty(); });  // diagonals no document reached
  return out;
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
// (work_cost).
inline int64_t rank_cost(const ChunkLayout& layout, int r, std::span<const int64_t> documents, int64_t call_cost) {
  int64_t cost = 0;
  for (int j = 0; j < layout.n; ++j)
    for (const Round& round : step_rounds(r, j, layout, true, documents)) {
      const AttentionWork w = round_work(round);
      cost += work_cost(w, call_cost);
    }
  return cost;
}

// Every rank's rank_cost under the layout.
inline std::vector<int64_t> ranks_cost(const ChunkLayout& layout, std::span<const int64_t> documents, int64_t call_cost) {
  std::vector<int64_t> costs(static_cast<size_t>(layout.n));
  for (int r = 0; r < layout.n; ++r) costs[static_cast<size_t>(r)] = rank_cost(layout, r, documents, call_cost);
  return costs;
}

// The layout's predicted spread, (max - min) / mean, of its ranks' costs.
inline void set_spread(ChunkLayout& layout, const std::vector<int64_t>& costs) {
  const auto [mn, mx] = std::minmax_element(costs.begin(), costs.end());
  const double total = static_cast<double>(std::accumulate(costs.begin(), costs.end(), int64_t{0}));
  layout.spread = total > 0 ? static_cast<double>(*mx - *mn) * layout.n / total : 0;
}

// Each rank's predicted cost of a layout: over its ring steps' rounds (rank_cost) when call_cost
// is positive, else the sum of its chunks' masked work. Sets the layout's predicted spread.
inline std::vector<int64_t> rank_costs(ChunkLayout& layout, std::span<const int64_t> documents,
                                       const std::vector<int64_t>& chunk_costs, int64_t call_cost) {
  std::vector<int64_t> costs(static_cast<size_t>(layout.n), 0);
  if (call_cost > 0) costs = ranks_cost(layout, documents, call_cost);
  else
    for (int r = 0; r < layout.n; ++r)
      for (int64_t ch : layout.of(r)) costs[static_cast<size_t>(r)] += chunk_costs[static_cast<size_t>(ch)];
  set_spread(layout, costs);
  return costs;
}

// A greedy layout balances each chunk's own cost, but a rank's steps share their cuDNN calls
// (rounds), so the ranks' costs as they run differ from those sums. Refined against them: the swap
// of a chunk of the slowest rank with a chunk of another rank that lowers the larger of the two
// ranks' costs the most, while one lowers the slowest rank's cost; then the swap of a chunk of the
// fastest rank that lifts the smaller of the two the most without reaching the slowest. At most
// kRefinePasses swaps in all, each of 4 k^2 (n - 1) pairs costed, and only for layouts of up to
// kRefineMaxChunks chunks a rank, where one chunk is a large share of a rank's work and costing
// stays cheap: balanced_layout runs on the host once per sequence (with even_bounds, at most
// 0.3 s at 131,072 tokens and 1.0 s at 1,048,576 of issue 23's mixes, on one core of the CI
// machine). A swap moves where keys arrive for other ranks too, so every rank is recosted after
// each and a swap that raises the slowest is undone. On the model, short documents on 8 ranks: 4
// chunks a rank refined from a 37% spread to 2.5% (docs/PERF.md).
inline constexpr int kRefinePasses = 16;
inline constexpr int64_t kRefineMaxChunks = 8;

inline void refine_layout(ChunkLayout& layout, std::span<const int64_t> documents, int64_t call_cost,
                          std::vector<int64_t>& costs) {
  const int n = layout.n;
  const int64_t per = 2 * layout.k;
  if (call_cost <= 0 || per > kRefineMaxChunks || n < 2) return;
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
          const int64_t s = score(rank_cost(t, of, documents, call_cost), rank_cost(t, b, documents, call_cost));
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
    // waits for the slower neighbour, and the spread is what issue 23 measures).
    int of = top;
    Swap sw = best_swap(top, -most, [](int64_t x, int64_t y) { return -std::max(x, y); });
    if (sw.b < 0) {
      of = low;
      sw = best_swap(low, least, [most](int64_t x, int64_t y) { return std::max(x, y) < most ? std::min(x, y) : 0; });
    }
    if (sw.b < 0) return;
    ChunkLayout t = swapped(layout, of, sw.ia, sw.b, sw.ib);
    std::vector<int64_t> c = ranks_cost(t, documents, call_cost);
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
// ones are evened by refine_layout's swaps. On the model (docs/PERF.md), issue 23's mixes at
// 131,072 tokens on 2-8 ranks went from spreads up to 10.9% to at most 2.3%, and the slowest rank
// up to 12% faster; balanced_layout then takes at most 0.3 s of host time at 131,072 tokens and
// 1.0 s at 1,048,576 (one core of the CI machine), once per sequence, in shard().
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

inline void even_bounds(ChunkLayout& layout, std::span<const int64_t> documents, int64_t call_cost,
                        std::vector<int64_t>& costs) {
  const int n = layout.n;
  const int64_t per = 2 * layout.k, m = per * n;
  if (call_cost <= 0 || per > kSlideMaxChunks || n < 2 || layout.c < 2 * kBoundStep) return;
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
      const std::vector<int64_t> cu = u_ok ? ranks_cost(up, documents, call_cost) : costs;
      const std::vector<int64_t> cd = d_ok ? ranks_cost(down, documents, call_cost) : costs;
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
      std::vector<int64_t> c = ranks_cost(u, documents, call_cost);
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
          std::vector<int64_t> c = ranks_cost(u, documents, call_cost);
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
// chunks keep at least kMinChunkRows rows and divide L; for time, k at most kMaxK and until one
// costs kStopAbove times the best), the one whose slowest rank costs least. The greedy layouts balance
// chunk_cost (additive, so a chunk's cost is its own), then refine_layout and even_bounds even
// them by what each rank's ring steps run; the choice between them weighs that too (rank_cost:
// every round's computed pairs, query tiles and call_cost per cuDNN call, since a step's chunk
// pairs share calls), each larger k kept only for a gain over kMinGain. call_cost 0 balances and
// chooses by the masked work alone (any gain counts; chunks stay equal). The zigzag always
// without documents or with one. Every rank holds 2k chunks of 2kc rows in all, so K/V blocks
// stay equal-sized. `spread` is the chosen layout's predicted spread of that cost.
inline ChunkLayout balanced_layout(std::span<const int64_t> documents, int64_t L, int n,
                                   int64_t call_cost = kCallCostPairs) {
  ChunkLayout best = zigzag_layout(L, n);
  if (n == 1 || documents.size() <= 2) return best;
  const std::vector<int64_t> cost = chunk_cost(documents, L, best.c, call_cost);
  auto slowest = [](const std::vector<int64_t>& costs) { return *std::max_element(costs.begin(), costs.end()); };
  int64_t best_max = slowest(rank_costs(best, documents, cost, call_cost));
  std::vector<std::pair<ChunkLayout, int64_t>> tried{{best, best_max}};
  for (int64_t k = 1; L % (2 * n * k) == 0 && (k == 1 || L / (2 * n * k) >= kMinChunkRows) &&
                     (call_cost == 0 || k <= kMaxK);
       k *= 2) {
    const int64_t c = L / (2 * n * k);
    const std::vector<int64_t> ck = k == 1 ? cost : chunk_cost(documents, L, c, call_cost);
    ChunkLayout g = greedy_layout(ck, n, k, c);
    std::vector<int64_t> costs = rank_costs(g, documents, ck, call_cost);
    refine_layout(g, documents, call_cost, costs);  // hands back the refined layout's costs
    even_bounds(g, documents, call_cost, costs);     // and so does this
    set_spread(g, costs);
    const int64_t m = slowest(costs);
    const double gain = call_cost > 0 ? kMinGain : 0.0;  // balanced for work alone, any gain counts
    if (call_cost > 0) tried.emplace_back(g, m);
    if (static_cast<double>(m) < (1.0 - gain) * static_cast<double>(best_max)) best = std::move(g), best_max = m;
    // Past the best k the calls and cut documents only add up: stop well above it (costing a
    // layout of many small chunks is most of this function's time at a million tokens).
    else if (call_cost > 0 && static_cast<double>(m) > kStopAbove * static_cast<double>(best_max)) break;
  }
  // Layouts whose slowest rank is within kSpreadBand of the best are as fast on the model (its
  // error is a few percent): of those, the one whose ranks are most even.
  for (auto& [l, m] : tried)
    if (static_cast<double>(m) <= (1.0 + kSpreadBand) * static_cast<double>(best_max) && l.spread < best.spread)
      best = std::move(l);
  return best;
}

}  // namespace lcx::cp_ring
