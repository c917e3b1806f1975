#include "kernels/document_batches.h"

#include <algorithm>
#include <bit>
#include <map>

namespace lcx::ops {

int64_t padded_rows(int64_t n) {
  const int64_t p = static_cast<int64_t>(std::bit_ceil(static_cast<uint64_t>(std::max(n, kMinPaddedRows))));
  // Quarter steps of the octave where they stay multiples of kMinPaddedRows.
  const int64_t step = std::max(kMinPaddedRows, p / 8);
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

}  // namespace lcx::ops
