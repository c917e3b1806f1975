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

// Query row i (global position q_offset + i) sees key j (k_offset + j).
__device__ __forceinline__ bool visible(const Params& p, int64_t i, int64_t j) {
  return i < p.T && j < p.S && (!p.causal || p.k_offset + j <= p.q_offset + i);
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
