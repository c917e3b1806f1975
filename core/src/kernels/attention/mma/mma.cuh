// The tile layout and the WMMA building blocks the tensor-core attention kernels share
// (forward.cu, backward.cu): bf16/fp16 operands, fp32 accumulation, 64-row
// tiles as 16-byte vector copies into padded shared rows (row stride D + 8 elements keeps WMMA's
// 32-byte alignment and spreads banks).
#pragma once
#include <mma.h>

#include "kernels/attention/common.cuh"
#include "kernels/attention/smem.h"

namespace lcx::ops::cuda::attn {

using namespace nvcuda;

constexpr int kTcThreads = 128;  // 4 warps, 16 rows each

template <typename T>
__device__ __forceinline__ T to_t(float v);
template <>
__device__ __forceinline__ __nv_bfloat16 to_t<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ __half to_t<__half>(float v) {
  return __float2half_rn(v);
}

template <int D>
struct Tc {
  static constexpr int LDH = D + 8;    // 16-bit tile row stride
  static constexpr int LDS = kBc + 4;  // fp32 score row stride
  static constexpr int LDP = kBc + 8;  // 16-bit probability row stride
  static constexpr int LDO = D + 4;    // fp32 accumulator row stride
  static constexpr size_t tile = sizeof(uint16_t) * 64 * LDH;
  static constexpr size_t scores = sizeof(float) * 64 * LDS;
  static constexpr size_t probs = sizeof(uint16_t) * 64 * LDP;
  static constexpr size_t acc = sizeof(float) * 64 * LDO;
  static constexpr size_t fwd_smem = 3 * tile + scores + probs + acc;
  static constexpr size_t dq_smem = 4 * tile + 2 * scores + probs;
  static constexpr size_t dkv_smem = 4 * tile + 2 * scores + 2 * probs;
  static_assert(4 * tile >= acc, "the backward epilogue reuses the tiles as its fp32 staging");
};

// Rows [row0, row0 + 64) of one head of x [rows, heads, D] into dst (row stride ld), zero past
// the last row. x rows are 16-byte aligned (the dispatch checks).
template <int D, typename T>
__device__ __forceinline__ void load_tile_tc(T* dst, const void* x, int64_t row0, int64_t rows, int64_t heads,
                                             int64_t head, int ld) {
  constexpr int kVecs = D / 8;
  const T* src = static_cast<const T*>(x);
  for (int idx = threadIdx.x; idx < 64 * kVecs; idx += blockDim.x) {
    const int r = idx / kVecs, v = idx % kVecs;
    const int64_t row = row0 + r;
    uint4 val = make_uint4(0, 0, 0, 0);
    if (row < rows) val = *reinterpret_cast<const uint4*>(src + (row * heads + head) * D + v * 8);
    *reinterpret_cast<uint4*>(dst + r * ld + v * 8) = val;
  }
}

using FragAcc = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;
template <typename T>
using FragARow = wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major>;
template <typename T>
using FragACol = wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::col_major>;
template <typename T>
using FragBRow = wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major>;
template <typename T>
using FragBCol = wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major>;

// out[16 x 64] (fp32, row stride Tc::LDS) = a[16 x D] @ b[64 x D]^T for this warp's strip.
template <int D, typename T>
__device__ __forceinline__ void strip_abt(float* out, const T* a, const T* b) {
  FragAcc acc[kBc / 16];
#pragma unroll
  for (int n = 0; n < kBc / 16; ++n) wmma::fill_fragment(acc[n], 0.f);
#pragma unroll
  for (int kk = 0; kk < D; kk += 16) {
    FragARow<T> fa;
    wmma::load_matrix_sync(fa, a + kk, Tc<D>::LDH);
#pragma unroll
    for (int n = 0; n < kBc / 16; ++n) {
      FragBCol<T> fb;
      wmma::load_matrix_sync(fb, b + n * 16 * Tc<D>::LDH + kk, Tc<D>::LDH);
      wmma::mma_sync(acc[n], fa, fb, acc[n]);
    }
  }
#pragma unroll
  for (int n = 0; n < kBc / 16; ++n) wmma::store_matrix_sync(out + n * 16, acc[n], Tc<D>::LDS, wmma::mem_row_major);
}

}  // namespace lcx::ops::cuda::attn
