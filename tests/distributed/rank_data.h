// Each rank's test data as a function of (rank, index), and the serial results the
// communicators are held to. No gtest here: the NCCL stand-in worker uses it too.
#pragma once
#include <vector>

#include "lcx/tensor.h"

namespace lcx::test {

// Distinct, non-trivial values per rank; fractions make fp32 sums order-sensitive.
inline float rank_value(int rank, int64_t i) { return 0.37f * static_cast<float>(rank + 1) + 0.011f * static_cast<float>(i % 97) - 0.5f; }

inline std::vector<float> rank_values(int rank, int64_t n) {
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = rank_value(rank, i);
  return v;
}

// As the dtype stores it (bf16 inputs are rounded before the sum).
inline std::vector<float> stored(const std::vector<float>& v, DType dt) {
  return Tensor::from_floats(v, {static_cast<int64_t>(v.size())}, dt).to_floats();
}

inline std::vector<float> serial_sum(int world, int64_t n, DType dt, int64_t offset = 0, int64_t count = -1) {
  if (count < 0) count = n;
  std::vector<float> acc(static_cast<size_t>(count), 0.0f);
  for (int r = 0; r < world; ++r) {
    std::vector<float> v = stored(rank_values(r, n), dt);
    for (int64_t i = 0; i < count; ++i) acc[static_cast<size_t>(i)] = r == 0 ? v[static_cast<size_t>(offset + i)] : acc[static_cast<size_t>(i)] + v[static_cast<size_t>(offset + i)];
  }
  return stored(acc, dt);
}

}  // namespace lcx::test
