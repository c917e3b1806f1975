// The dropout mask of ops::dropout, one function for both backends so the GPU keeps exactly the
// elements the CPU twin keeps. The mask is a pure function of (key, row, column): nothing is
// stored between the forward, a checkpointed layer's recompute and the backward, which all draw
// the same mask again.
#pragma once
#include <cstdint>

#if defined(__CUDACC__)
#define LCX_DROPOUT_HD __host__ __device__ __forceinline__
#else
#define LCX_DROPOUT_HD inline
#endif

namespace lcx::ops {

// Columns are counted in 20 bits of the element's counter (a row of at most 1,048,576 columns).
constexpr int kDropoutColumnBits = 20;

// SplitMix64's output function: a bijection of 64 bits whose outputs, over consecutive counters,
// pass BigCrush; one per element.
LCX_DROPOUT_HD uint64_t dropout_mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Whether element (row, col) is kept: its 24-bit draw at or above `threshold` (p * 2^24, rounded).
LCX_DROPOUT_HD bool dropout_keep(uint64_t key, int64_t row, int64_t col, uint32_t threshold) {
  const uint64_t counter = (static_cast<uint64_t>(row) << kDropoutColumnBits) | static_cast<uint64_t>(col);
  return static_cast<uint32_t>(dropout_mix(key + counter * 0x9e3779b97f4a7c15ull) >> 40) >= threshold;
}

// The draw below which an element drops, and what a kept one is multiplied by; host-side, so both
// backends take the same numbers.
inline uint32_t dropout_threshold(float p) {
  return static_cast<uint32_t>(static_cast<double>(p) * 16777216.0 + 0.5);
}
inline float dropout_scale(float p) { return 1.f / (1.f - p); }

}  // namespace lcx::ops
