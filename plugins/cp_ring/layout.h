// Which chunks of the sequence each rank of the ring holds (cp_ring.cpp's header comment explains
// the zigzag; balance.h lays the chunks out for packed documents).
#pragma once
#include <cstdint>
#include <span>
#include <vector>

namespace lcx::cp_ring {

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

}  // namespace lcx::cp_ring
