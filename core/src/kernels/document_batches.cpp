#include "kernels/document_batches.h"

#include <algorithm>
#include <bit>
#include <map>
#include <utility>

namespace lcx::ops {

int64_t padded_rows(int64_t n) {
  const int64_t p = static_cast<int64_t>(std::bit_ceil(static_cast<uint64_t>(std::max(n, kMinPaddedRows))));
  // Quarter steps of the octave (32nd steps past kFineFromRows), multiples of kMinPaddedRows.
  const int64_t step = std::max(kMinPaddedRows, n > kFineFromRows ? p / 64 : p / 8);
  return (std::max(n, kMinPaddedRows) + step - 1) / step * step;
}

std::vector<DocumentBatch> document_batches(const std::vector<int64_t>& lengths) {
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

std::vector<DocumentPairBatch> document_pair_batches(const std::vector<int64_t>& q_lengths,
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

}  // namespace lcx::ops
