// The ring's schedule of attention work (cp_ring.cpp's header comment explains the zigzag): which
// query rows of rank r's shard meet which key rows of the block in hand at each ring step. Shared
// by the plugin and tests/bench/cp_balance_bench.cpp, which times each rank's schedule alone.
#pragma once
#include <cstdint>
#include <vector>

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

}  // namespace lcx::cp_ring
