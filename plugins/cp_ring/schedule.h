// The ring's schedule of attention work: which query rows of rank r's shard meet which key rows
// of the block in hand at each ring step, as pieces (whole sequences) or as rounds of blocks
// (packed documents). Shared by the plugin and tests/bench/cp_balance_bench.cpp, which times each
// rank's schedule alone.
#pragma once
#include <algorithm>
#include <cstdint>
#include <map>
#include <span>
#include <utility>
#include <vector>

#include <lcx/ops.h>

#include "layout.h"

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
// within each document) are a round of their own. A call per chunk pair instead would make up to
// 4k^2 calls a step with short documents, each with its batches, table upload and merge.
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

}  // namespace lcx::cp_ring
