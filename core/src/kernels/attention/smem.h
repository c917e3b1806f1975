// Shared memory per block of lcx's own attention kernels (mma/, reference/), in bytes. The kernels
// launch with these figures (static_asserts in each kernel file hold them to the kernels' layouts);
// the dispatch (dispatch.h) compares them with the device's opt-in limit, which is 227 KB on
// sm_90 and sm_100, 163 KB on sm_80 and 99 KB on sm_86, sm_89 and sm_120.
#pragma once
#include <algorithm>
#include <cstdint>

namespace lcx::ops::attention::smem {

// fp32 CUDA-core kernels: 64-row tiles of fp32 rows of D + 1 floats, D the head size rounded up to
// 32, 64 or 128.
constexpr int64_t reference_width(int64_t d) { return d <= 32 ? 32 : d <= 64 ? 64 : 128; }
constexpr int64_t reference_forward(int64_t D) { return 4 * ((64 + 2 * 64) * (D + 1) + 64 * (64 + 1)); }
constexpr int64_t reference_backward_dq(int64_t D) { return 4 * ((2 * 64 + 2 * 64) * (D + 1) + 64 * (64 + 1)); }
constexpr int64_t reference_backward_dkv(int64_t D) {
  return 4 * ((2 * 64 + 2 * 64) * (D + 1) + 2 * 64 * (64 + 1) + 2 * 64);
}

// Tensor-core (WMMA) kernels, head_dim D of 64, 128 or 256: 16-bit tiles of row stride D + 8, fp32
// scores of stride 68, 16-bit probabilities of stride 72, the fp32 output of stride D + 4.
constexpr int64_t mma_tile(int64_t D) { return 2 * 64 * (D + 8); }
constexpr int64_t mma_scores() { return 4 * 64 * (64 + 4); }
constexpr int64_t mma_probs() { return 2 * 64 * (64 + 8); }
constexpr int64_t mma_forward(int64_t D) { return 3 * mma_tile(D) + mma_scores() + mma_probs() + 4 * 64 * (D + 4); }
constexpr int64_t mma_backward_dq(int64_t D) { return 4 * mma_tile(D) + 2 * mma_scores() + mma_probs(); }
constexpr int64_t mma_backward_dkv(int64_t D) { return 4 * mma_tile(D) + 2 * mma_scores() + 2 * mma_probs(); }

constexpr int64_t reference(bool backward, int64_t d) {
  const int64_t D = reference_width(d);
  return backward ? std::max(reference_backward_dq(D), reference_backward_dkv(D)) : reference_forward(D);
}
constexpr int64_t mma(bool backward, int64_t d) {
  return backward ? std::max(mma_backward_dq(d), mma_backward_dkv(d)) : mma_forward(d);
}

}  // namespace lcx::ops::attention::smem
