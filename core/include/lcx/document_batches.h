// How document-masked attention on cuDNN groups a call's documents (core/src/kernels/cuda/
// attention_documents.cpp). Public and inline so that a parallelism plugin can weigh its shards by
// the work the kernels do (padded_work below), and kept apart from the CUDA code so CI checks it
// on the CPU.
// cuDNN builds and caches one execution plan per shape, and a packed sequence's document lengths
// change every step, so the documents run as padded batches whose shapes come from a small set:
// each document's rows are padded to S, its length rounded up to a quarter step of its octave
// (1, 1.25, 1.5, 1.75 times a power of two, a multiple of kMinPaddedRows), and the documents of one
// S run as batches of B documents, B a power of two (13 documents of one S run as 8 + 4 + 1). The
// plan keys are then (2^i, S) pairs, four sizes S per octave: a new mix of lengths reuses the plans
// of earlier steps. Quarter steps, not powers of two: the H200 measured cuDNN's forward paying for
// the padded query rows (a 70k-row book padded to 131,072 ran at 0.56 of the unpadded rate, its
// backward at 0.94). Past kFineFromRows the steps are a 32nd of the octave (padding under 3.2%):
// such a document fills the GPU alone, so batching gains nothing there, while a quarter step still
// cost its forward 18% (a 66k-row book padded to 81,920 rows ran at 0.82 of the causal rate); a
// plan per size costs little beside calls that long, and at most 32 sizes an octave are cached.
// A batch's padded rows B * S are capped at the call's real rows rounded up to a power of two (or
// one kMinPaddedRows document), which bounds the memory plan's term (lcx/plan.h
// cudnn_document_batch_bytes: cuDNN's fp32 stats, dQ accumulator and workspace per padded row, the
// documents themselves read in place): calls run one after another, so their buffers never pass
// the rows of one unmasked call by more than that rounding. Reading in place frees the padding of
// memory but not of work (cuDNN's forward still computes the padded query rows), so the steps stay
// this fine.
#pragma once
#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <map>
#include <utility>
#include <vector>

namespace lcx::ops {

inline constexpr int64_t kMinPaddedRows = 128;
inline constexpr int64_t kFineFromRows = 4096;

// A document of n > 0 rows padded: the least step (above) >= max(n, kMinPaddedRows).
inline int64_t padded_rows(int64_t n) {
  const int64_t p = static_cast<int64_t>(std::bit_ceil(static_cast<uint64_t>(std::max(n, kMinPaddedRows))));
  // Quarter steps of the octave (32nd steps past kFineFromRows), multiples of kMinPaddedRows.
  const int64_t step = std::max(kMinPaddedRows, n > kFineFromRows ? p / 64 : p / 8);
  return (std::max(n, kMinPaddedRows) + step - 1) / step * step;
}

struct DocumentBatch {
  int64_t rows = 0;           // S: each document's padded rows
  std::vector<std::size_t> docs;   // indices into the lengths given; a power-of-two count
};

// Every document of positive length in exactly one batch, the batches of one S largest first,
// S ascending. Zero lengths are left out (they have no rows to attend).
inline std::vector<DocumentBatch> document_batches(const std::vector<int64_t>& lengths) {
  std::map<int64_t, std::vector<size_t>> buckets;
  int64_t total = 0;
  for (size_t i = 0; i < lengths.size(); ++i) {
    if (lengths[i] <= 0) continue;
    buckets[padded_rows(lengths[i])].push_back(i);
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
                                                            const std::vector<int64_t>& k_lengths) {
  std::map<std::pair<int64_t, int64_t>, std::vector<size_t>> buckets;
  int64_t q_total = 0, k_total = 0;
  for (size_t i = 0; i < q_lengths.size() && i < k_lengths.size(); ++i) {
    if (q_lengths[i] <= 0 || k_lengths[i] <= 0) continue;
    buckets[{padded_rows(q_lengths[i]), padded_rows(k_lengths[i])}].push_back(i);
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
// padded batches (each document at its padded rows; on and below the diagonal where the queries
// and keys are the same rows, every pair where they are apart) and its cuDNN calls, one a batch.
// Document i has q_lengths[i] query rows and k_lengths[i] key rows; same_rows: they are the same
// rows (causal within each document; then k_lengths is not read).
struct PaddedWork {
  int64_t pairs = 0, calls = 0;
};
inline PaddedWork padded_work(const std::vector<int64_t>& q_lengths, const std::vector<int64_t>& k_lengths,
                              bool same_rows) {
  PaddedWork w;
  if (same_rows) {
    for (const DocumentBatch& b : document_batches(q_lengths)) {
      w.pairs += static_cast<int64_t>(b.docs.size()) * b.rows * (b.rows + 1) / 2;
      ++w.calls;
    }
  } else {
    for (const DocumentPairBatch& b : document_pair_batches(q_lengths, k_lengths)) {
      w.pairs += static_cast<int64_t>(b.docs.size()) * b.q_rows * b.k_rows;
      ++w.calls;
    }
  }
  return w;
}

}  // namespace lcx::ops
