// What lcx's own flash-style attention kernels share on the device (the parameter struct is in
// params.h): the tile sizes, the tile loader and the causal visibility rule. Tiles are 64 query
// rows by 64 key rows; a head of dimension d is padded with zeros to D in {32, 64, 128} so one
// instantiation serves every d up to D. Tiles sit in shared memory as fp32 rows of D + 1 floats:
// the odd stride puts the rows a warp reads at one column in distinct banks.
#pragma once
#include <cmath>

#include "kernels/attention/params.h"
#include "kernels/cuda/common.cuh"

namespace lcx::ops::cuda::attn {

constexpr int kBr = 64;  // query rows per tile
constexpr int kBc = 64;  // key rows per tile
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// Query row i (global position q_offset + i) sees key j (k_offset + j): causal, keys at or before
// the query; a window, keys fewer than `window` positions before it.
__device__ __forceinline__ bool visible(const Params& p, int64_t i, int64_t j) {
  return i < p.T && j < p.S && (!p.causal || p.k_offset + j <= p.q_offset + i) &&
         (p.window <= 0 || p.k_offset + j > p.q_offset + i - p.window);
}

// The tile bounds that keep a masked call's work to the tiles it sees (T x W under a window, half
// of T x S causal): every kernel walks key tiles [first_key, key_end) for a block of query rows and
// query tiles [first_query, query_end) for a block of key rows, and masks inside the partial ones.
// The first key row (a multiple of `tile`) of the tile holding the first key query row q0 sees.
__host__ __device__ __forceinline__ int64_t first_key(const Params& p, int64_t q0, int64_t tile) {
  if (p.window <= 0) return 0;
  const int64_t lo = p.q_offset + q0 - p.window + 1 - p.k_offset;
  return lo <= 0 ? 0 : lo / tile * tile;
}
// One past the last key row any of the query rows [q0, q0 + rows) sees (causal), else S.
__host__ __device__ __forceinline__ int64_t key_end(const Params& p, int64_t q0, int64_t rows) {
  if (!p.causal) return p.S;
  const int64_t last_q = q0 + (rows < p.T - q0 ? rows : p.T - q0) - 1;
  const int64_t end = p.q_offset + last_q - p.k_offset + 1;
  return end <= 0 ? 0 : end < p.S ? end : p.S;
}
// The first query row (a multiple of `tile`) of the tile holding the first query that sees key row
// k0 (causal), else 0.
__host__ __device__ __forceinline__ int64_t first_query(const Params& p, int64_t k0, int64_t tile) {
  if (!p.causal) return 0;
  const int64_t lo = p.k_offset + k0 - p.q_offset;
  return lo <= 0 ? 0 : lo / tile * tile;
}
// One past the last query row that sees any of the key rows [k0, k0 + keys) (a window), else T.
__host__ __device__ __forceinline__ int64_t query_end(const Params& p, int64_t k0, int64_t keys) {
  if (p.window <= 0) return p.T;
  const int64_t end = p.k_offset + k0 + keys - 1 + p.window - p.q_offset;
  return end <= 0 ? 0 : end < p.T ? end : p.T;
}

// Rows [row0, row0 + 64) of one head of x [rows, heads, d] into dst [64][D + 1], zero-padded past
// the last row and past d.
template <int D>
__device__ __forceinline__ void load_tile(float* dst, const void* x, DType t, int64_t row0, int64_t rows,
                                          int64_t heads, int64_t head, int64_t d) {
  for (int idx = threadIdx.x; idx < 64 * D; idx += blockDim.x) {
    const int r = idx / D, c = idx % D;
    const int64_t row = row0 + r;
    dst[r * (D + 1) + c] = row < rows && c < d ? lcx::cuda::ld(x, t, (row * heads + head) * d + c) : 0.f;
  }
}

template <int D>
__device__ __forceinline__ float dot_rows(const float* a, const float* b) {
  float acc = 0.f;
#pragma unroll 16
  for (int k = 0; k < D; ++k) acc += a[k] * b[k];
  return acc;
}

// Raises a kernel's dynamic shared memory limit past 48 KB, once per instantiation.
template <typename Kernel>
void allow_smem(Kernel kernel, size_t bytes) {
  LCX_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
}

}  // namespace lcx::ops::cuda::attn
