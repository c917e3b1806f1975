// The ring's schedule of attention work (cp_ring.cpp's header comment explains the zigzag): which
// query rows of rank r's shard meet which key rows of the block in hand at each ring step. Shared
// by the plugin and tests/bench/cp_balance_bench.cpp, which times each rank's schedule alone.
#pragma once
#include <algorithm>
#include <cstdint>
#include <span>
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

// A piece with the positions in the sequence of its first query row and first key row.
struct PlacedPiece {
  Piece piece;
  int64_t q_pos, k_pos;
};

// With packed documents (cumulative bounds over the sequence): rank r's pieces against rank j's
// block on a ring of n, cut into chunk pairs (one query chunk, one key chunk, each contiguous in
// the sequence) placed at their positions, so the bounds apply as they are; a pair whose chunks
// share no document is left out, since none of its queries sees any of its keys.
inline std::vector<PlacedPiece> document_pieces(int r, int j, int n, int64_t c, bool causal,
                                                std::span<const int64_t> documents) {
  auto position = [&](int rank, int64_t h) { return (h == 0 ? rank : 2 * n - 1 - rank) * c; };
  auto document = [&](int64_t pos) { return std::upper_bound(documents.begin(), documents.end(), pos) - documents.begin(); };
  std::vector<PlacedPiece> out;
  for (const Piece& p : pieces_for(r, j, c, causal))
    for (int64_t qh = p.q_begin / c; qh < p.q_end / c; ++qh)
      for (int64_t kh = p.k_begin / c; kh < p.k_end / c; ++kh) {
        const int64_t qg = position(r, qh), kg = position(j, kh);
        if (causal && kg > qg) continue;
        if (document(qg + c - 1) < document(kg) || document(kg + c - 1) < document(qg)) continue;
        out.push_back({{qh * c, (qh + 1) * c, kh * c, (kh + 1) * c, causal && kg == qg}, qg, kg});
      }
  return out;
}

}  // namespace lcx::cp_ring
