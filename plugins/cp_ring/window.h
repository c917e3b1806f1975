// A sliding-window layer under the ring (cp_ring.cpp): a query at position p sees only the keys at
// p - W + 1 .. p, so a rank's chunk starting at b needs, beside its own rows, the W - 1 positions
// before b (fewer where its first document starts later): its halo. Each rank fetches its chunks'
// halos from the ranks holding those positions, point to point, and runs one masked attention
// call a chunk over [halo; chunk] at their positions: no ring pass, the traffic W - 1 rows of K
// and V a chunk instead of every other rank's block. The backward returns the halo rows' dK/dV
// (fp32) to their owners the same way. Every rank derives every rank's halos from the same layout,
// so both sides of each exchange enumerate the same segments in the same order.
#pragma once
#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "layout.h"

namespace lcx::cp_ring {

// Positions [begin, begin + rows) that rank `requester` needs for its chunk `slot` (its index in
// layout.of(requester)), held by rank `owner` at its local rows [src, src + rows), going to row
// `dst` of the requester's halo of that chunk.
struct HaloSegment {
  int requester, owner;
  int64_t slot, begin, rows, src, dst;
};

// Rank r's chunks with their halos: query rows [row, row + rows) at positions [begin, begin +
// rows), the halo at positions [halo_begin, begin).
struct WindowChunk {
  int64_t row, rows, begin, halo_begin;
};

struct WindowPlan {
  std::vector<std::vector<WindowChunk>> chunks;  // per rank
  std::vector<HaloSegment> segments;             // requester, slot, position ascending
};

// The first position a chunk starting at `begin` reaches back to: W - 1 before it, not before its
// document's start.
inline int64_t halo_begin(int64_t begin, int64_t window, std::span<const int64_t> documents) {
  int64_t h = std::max<int64_t>(0, begin - (window - 1));
  if (!documents.empty()) h = std::max(h, *(std::upper_bound(documents.begin(), documents.end(), begin) - 1));
  return std::min(h, begin);
}

inline WindowPlan window_plan(const ChunkLayout& layout, int64_t window, std::span<const int64_t> documents) {
  const int64_t chunks = 2 * layout.n * layout.k;
  std::vector<int> owner(static_cast<size_t>(chunks));
  std::vector<int64_t> local(static_cast<size_t>(chunks));
  WindowPlan plan;
  plan.chunks.resize(static_cast<size_t>(layout.n));
  for (int r = 0; r < layout.n; ++r) {
    int64_t at = 0;
    for (int64_t ch : layout.of(r)) {
      owner[static_cast<size_t>(ch)] = r;
      local[static_cast<size_t>(ch)] = at;
      plan.chunks[static_cast<size_t>(r)].push_back(
          {at, layout.rows(ch), layout.begin(ch), halo_begin(layout.begin(ch), window, documents)});
      at += layout.rows(ch);
    }
  }
  for (int r = 0; r < layout.n; ++r) {
    const std::vector<WindowChunk>& mine = plan.chunks[static_cast<size_t>(r)];
    for (size_t slot = 0; slot < mine.size(); ++slot) {
      const WindowChunk& w = mine[slot];
      // The chunks holding [halo_begin, begin), in position order (chunk indices ascend with it).
      int64_t ch = 0;
      while (ch + 1 < chunks && layout.begin(ch + 1) <= w.halo_begin) ++ch;
      for (int64_t p = w.halo_begin; p < w.begin; ++ch) {
        const int64_t end = std::min(w.begin, layout.begin(ch) + layout.rows(ch));
        if (end <= p) continue;
        plan.segments.push_back({r, owner[static_cast<size_t>(ch)], static_cast<int64_t>(slot), p, end - p,
                                 local[static_cast<size_t>(ch)] + (p - layout.begin(ch)), p - w.halo_begin});
        p = end;
      }
    }
  }
  return plan;
}

}  // namespace lcx::cp_ring
