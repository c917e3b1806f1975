// Helpers every lcx kernel file shares: loads and stores that widen any float storage dtype to
// fp32 and round back to nearest even (as torch's casts do), warp and block reductions, and the
// launch arithmetic. The dtype travels as a kernel argument; the switch on it is uniform across
// the grid, so it costs a predictable branch, not divergence, in memory-bound kernels.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>

#include "cuda/check.h"
#include "cuda/stream.h"
#include "lcx/tensor.h"

namespace lcx::cuda {

__device__ __forceinline__ float ld(const void* p, DType t, int64_t i) {
  switch (t) {
    case DType::bf16: return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    case DType::f16: return __half2float(static_cast<const __half*>(p)[i]);
    default: return static_cast<const float*>(p)[i];
  }
}

__device__ __forceinline__ void st(void* p, DType t, int64_t i, float v) {
  switch (t) {
    case DType::bf16: static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(v); break;
    case DType::f16: static_cast<__half*>(p)[i] = __float2half_rn(v); break;
    default: static_cast<float*>(p)[i] = v; break;
  }
}

// The value v takes once stored in dtype t.
__device__ __forceinline__ float round_to(DType t, float v) {
  switch (t) {
    case DType::bf16: return __bfloat162float(__float2bfloat16_rn(v));
    case DType::f16: return __half2float(__float2half_rn(v));
    default: return v;
  }
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over the block; every thread gets the result. `scratch` holds 32 floats; the block size is
// a multiple of 32. Ends with a barrier, so the scratch may be reused right after.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  v = warp_sum(v);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < warps ? scratch[lane] : 0.f;
  v = warp_sum(v);
  __syncthreads();
  return v;
}

inline unsigned grid_for(int64_t n, int threads, int64_t cap = 65535LL * 16) {
  int64_t blocks = (n + threads - 1) / threads;
  if (blocks < 1) blocks = 1;
  return static_cast<unsigned>(blocks < cap ? blocks : cap);
}

__host__ __device__ __forceinline__ int64_t lmin(int64_t a, int64_t b) { return a < b ? a : b; }
__host__ __device__ __forceinline__ int64_t lmax(int64_t a, int64_t b) { return a > b ? a : b; }

// Eight bf16 values as one 16-byte access, widened to / rounded from fp32 (round to nearest even,
// as the scalar st() does, so both paths store identical bits).
__device__ __forceinline__ void load8(const void* p, float f[8]) {
  const uint4 u = *static_cast<const uint4*>(p);
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 x = __bfloat1622float2(h[i]);
    f[2 * i] = x.x;
    f[2 * i + 1] = x.y;
  }
}

__device__ __forceinline__ void store8(void* p, const float f[8]) {
  uint4 u;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&u);
#pragma unroll
  for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
  *static_cast<uint4*>(p) = u;
}

// True when every tensor is bf16 and starts on a 16-byte boundary: the vectorized paths apply.
inline bool bf16_vectorizable(std::initializer_list<const Tensor*> ts) {
  for (const Tensor* t : ts)
    if (t->dtype() != DType::bf16 || reinterpret_cast<uintptr_t>(t->data()) % 16 != 0) return false;
  return true;
}

// Rows of a tensor viewed as [rows, last dim].
inline int64_t rows_of(const Tensor& t) {
  const int64_t d = t.size(-1);
  return d == 0 ? 0 : t.numel() / d;
}

}  // namespace lcx::cuda
