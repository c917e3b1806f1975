// How document-masked attention on cuDNN groups a call's documents
// (kernels/attention/cudnn/documents.cpp). Kept apart from the CUDA code so that CI checks it on the CPU, and so
// that lcx/attention_cost.h attention_work reports the work the kernels do (padded_work below).
// cuDNN builds and caches one execution plan per shape, and a packed sequence's document lengths
// change every step, so the documents run as batches whose shapes come from a small set: each
// document's rows are padded to S, its length rounded up to its length class, and the documents of
// one S run as batches of B documents, B a power of two (13 documents of one S run as 8 + 4 + 1).
// The plan keys are then (2^i, S) pairs: a new mix of lengths reuses the plans of earlier steps.
// Two kinds of classes (LengthClasses), since what padding costs depends on how cuDNN reads the
// documents:
// - octave (powers of two, at least kMinPaddedRows): cuDNN reads each document in place through
//   its ragged offsets and skips the tiles past each element's real rows, forward and backward, so
//   padding costs no work and coarse classes mean fewer, larger calls and fewer plans. On the H200,
//   64 short documents in 131,072 tokens ran at 0.96 / 0.83 of the causal rate (forward / backward)
//   against 0.90 / 0.81 with the fine classes below, and two books at 1.03 / 0.97 either way.
// - fine (quarter steps of the octave: 1, 1.25, 1.5, 1.75 times a power of two, multiples of
//   kMinPaddedRows; past kFineFromRows a 32nd of the octave, under 3.2% padding): for documents
//   gathered into zero-padded buffers (a cuDNN without ragged plans), where cuDNN's forward computes
//   the padded query rows: a 70k-row book padded to 131,072 ran at 0.56 of the unpadded rate, and a
//   quarter step still cost a 66k-row book's forward 18%. A document that long fills the GPU alone,
//   so batching gains nothing there, and a plan per size costs little beside calls that long.
// A batch's padded rows B * S are capped at the call's real rows rounded up to a power of two (or
// one S), which bounds the memory plan's term (kernels/cudnn_sizes.h cudnn_document_batch_bytes:
// cuDNN's fp32 stats, dQ accumulator and workspace per padded row): calls run one after another,
// so their buffers never pass the rows of one unmasked call by more than that rounding.
#pragma once
#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <map>
#include <utility>
#include <vector>

#include "lcx/attention_cost.h"

namespace lcx::ops {

inline constexpr int64_t kMinPaddedRows = 128;
inline constexpr int64_t kFineFromRows = 4096;

enum class LengthClasses { octave, fine };

// A document of n > 0 rows padded: the least size of its class >= max(n, kMinPaddedRows).
inline int64_t padded_rows(int64_t n, LengthClasses classes = LengthClasses::fine) {
  const int64_t p = static_cast<int64_t>(std::bit_ceil(static_cast<uint64_t>(std::max(n, kMinPaddedRows))));
  if (classes == LengthClasses::octave) return p;
  // Quarter steps of the octave (32nd steps past kFineFromRows), multiples of kMinPaddedRows.
  const int64_t step = std::max(kMinPaddedRows, n > kFineFromRows ? p / 64 : p / 8);
  return (std::max(n, kMinPaddedRows) + step - 1) / step * step;
}

// The rows of a document of n > 0 rows that its batch computes: its padded rows where the padding
// is computed (fine classes, padded copies), its rows rounded up to whole kMinPaddedRows tiles where
// cuDNN skips the tiles past the real rows (octave classes, read in place).
inline int64_t computed_rows(int64_t n, LengthClasses classes) {
  if (classes == LengthClasses::fine) return padded_rows(n, classes);
  return (std::max(n, int64_t{1}) + kMinPaddedRows - 1) / kMinPaddedRows * kMinPaddedRows;
}

struct DocumentBatch {
  int64_t rows = 0;           // S: each document's padded rows
  std::vector<std::size_t> docs;   // indices into the lengths given; a power-of-two count
};

// Every document of positive length in exactly one batch, the batches of one S largest first,
// S ascending. Zero lengths are left out (they have no rows to attend).
inline std::vector<DocumentBatch> document_batches(const std::vector<int64_t>& lengths,
                                                  LengthClasses classes = LengthClasses::fine) {
  std::map<int64_t, std::vector<size_t>> buckets;
  int64_t total = 0;
  for (size_t i = 0; i < lengths.size(); ++i) {
    if (lengths[i] <= 0) continue;
    buckets[padded_rows(lengths[i], classes)].push_back(i);
    total += lengths[i];
  }
  std::vector<DocumentBatch> out;
  for (auto& [S, docs] : buckets) {
    const uint64_t cap = std::bit_floor(std::max<uint64_t>(1, std::bit_ceil(static_cast<uint64_t>(total)) /
                                                                    static_cast<uint64_t>(S)));
    size_t next = 0;
    while (next < docs.size()) {
      const uint64_t left = docs.size() - next;
      const size_t B = static_cast<size_t>(std::min(cap, std::bit_floor(left)));
      out.push_back({S, std::vector<size_t>(docs.begin() + static_cast<std::ptrdiff_t>(next),
                                            docs.begin() + static_cast<std::ptrdiff_t>(next + B))});
      next += B;
    }
  }
  return out;
}

// Documents whose query rows and key rows differ (a ring's piece of a query chunk against an earlier
// key chunk): document i has q_lengths[i] query rows and k_lengths[i] key rows, each padded on its
// own (padded_rows), and the documents of one (S_q, S_k) pair run as power-of-two batches as above.
// A batch's padded query rows B * S_q are capped at the call's real query rows rounded up to a power
// of two (or one S_q), and its key rows likewise: the bound of document_batches for each side.
struct DocumentPairBatch {
  int64_t q_rows = 0, k_rows = 0;  // S_q, S_k: each document's padded query and key rows
  std::vector<std::size_t> docs;   // indices into the lengths given; a power-of-two count
};

// Every document with both lengths positive in exactly one batch, the batches of one pair largest
// first, pairs ascending. A document without queries or without keys is left out.
inline std::vector<DocumentPairBatch> document_pair_batches(const std::vector<int64_t>& q_lengths,
                                                            const std::vector<int64_t>& k_lengths,
                                                            LengthClasses classes = LengthClasses::fine) {
  std::map<std::pair<int64_t, int64_t>, std::vector<size_t>> buckets;
  int64_t q_total = 0, k_total = 0;
  for (size_t i = 0; i < q_lengths.size() && i < k_lengths.size(); ++i) {
    if (q_lengths[i] <= 0 || k_lengths[i] <= 0) continue;
    buckets[{padded_rows(q_lengths[i], classes), padded_rows(k_lengths[i], classes)}].push_back(i);
    q_total += q_lengths[i];
    k_total += k_lengths[i];
  }
  // The most documents of S rows whose padded rows stay within the total's power of two (at least 1).
  auto most = [](int64_t total, int64_t S) {
    return std::bit_floor(std::max<uint64_t>(1, std::bit_ceil(static_cast<uint64_t>(total)) / static_cast<uint64_t>(S)));
  };
  std::vector<DocumentPairBatch> out;
  for (auto& [sizes, docs] : buckets) {
    const uint64_t cap = std::min(most(q_total, sizes.first), most(k_total, sizes.second));
    size_t next = 0;
    while (next < docs.size()) {
      const size_t B = static_cast<size_t>(std::min(cap, std::bit_floor(static_cast<uint64_t>(docs.size() - next))));
      out.push_back({sizes.first, sizes.second,
                     std::vector<size_t>(docs.begin() + static_cast<std::ptrdiff_t>(next),
                                         docs.begin() + static_cast<std::ptrdiff_t>(next + B))});
      next += B;
    }
  }
  return out;
}

// What one call of document-masked attention computes on the GPU: the (query, key) pairs of its
// batches (each document at its computed rows, computed_rows; on and below the diagonal where the
// queries and keys are the same rows, every pair where they are apart) and its cuDNN calls, one a
// batch. Document i has q_lengths[i] query rows and k_lengths[i] key rows; same_rows: they are the
// same rows (causal within each document; then k_lengths is not read). call_octaves sums, over the
// calls, the octaves of each call's padded key rows S_k above kTailFreeKeyRows (log2(S_k / 512),
// at least 0): what a call costs beyond its pairs grows with the keys its tiles read (its last
// wave of tiles leaves the GPU part idle for about one tile's time). query_tiles counts the
// documents' computed query rows in tiles of kMinPaddedRows: each tile is a thread block of the
// forward, and the backward's passes over dO, O and the fp32 dQ accumulator run per query row, a
// cost the pairs miss where documents are short. On the H200, 279 ranks' ring schedules of book
// and short-document mixes (docs/PERF.md) fitted a rank's time to pairs, calls, call_octaves and
// query_tiles within 1.9% (median; p90 4.0%); without query_tiles, layouts of short documents
// predicted within 3-6% of even ran 12-14% apart.
inline constexpr int64_t kTailFreeKeyRows = 512;
struct PaddedWork {
  int64_t pairs = 0, calls = 0, call_octaves = 0, query_tiles = 0;
};
inline int64_t call_octaves(int64_t key_rows) {
  const int64_t o = static_cast<int64_t>(std::bit_width(static_cast<uint64_t>(std::max<int64_t>(key_rows, 1) - 1))) -
                    static_cast<int64_t>(std::bit_width(static_cast<uint64_t>(kTailFreeKeyRows - 1)));
  return std::max<int64_t>(0, o);
}
// window > 0: a sliding window of W keys, whose kernels skip the key tiles outside it.
inline PaddedWork padded_work(const std::vector<int64_t>& q_lengths, const std::vector<int64_t>& k_lengths,
                              bool same_rows, LengthClasses classes = LengthClasses::fine, int64_t window = 0) {
  PaddedWork w;
  auto rows = [&](size_t i, const std::vector<int64_t>& lengths) { return computed_rows(lengths[i], classes); };
  auto tiles = [](int64_t computed) { return (computed + kMinPaddedRows - 1) / kMinPaddedRows; };
  if (same_rows) {
    for (const DocumentBatch& b : document_batches(q_lengths, classes)) {
      for (size_t i : b.docs) {
        const int64_t q = rows(i, q_lengths);
        w.pairs += causal_pairs(q, window);
        w.query_tiles += tiles(q);
      }
      ++w.calls;
      w.call_octaves += call_octaves(b.rows);
    }
  } else {
    for (const DocumentPairBatch& b : document_pair_batches(q_lengths, k_lengths, classes)) {
      for (size_t i : b.docs) {
        const int64_t q = rows(i, q_lengths);
        w.pairs += q * (window > 0 ? std::min(window, rows(i, k_lengths)) : rows(i, k_lengths));
        w.query_tiles += tiles(q);
      }
      ++w.calls;
      w.call_octaves += call_octaves(b.k_rows);
    }
  }
  return w;
}

}  // namespace lcx::ops
