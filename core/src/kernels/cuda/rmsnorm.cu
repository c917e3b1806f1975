// RMSNorm on the GPU with the numerics of transformers' Qwen3RMSNorm (see the CPU twin):
// rstd = 1/sqrt(mean(x^2) + eps) in fp32, h = x * rstd rounded to x's dtype, y = w * h.
// Forward and the dx part of backward run one warp per row (a row is read twice; the second read
// hits L1/L2), which suits both hidden rows (d = 1024..5120) and per-head rows (d = 128).
// dw is a sum over all rows: rather than atomics, a column-parallel pass writes fp32 partial sums
// per chunk of rows and a second pass adds the chunks in order into dw, so dw is deterministic.
// The offset form (Gemma3RMSNorm, see the CPU twin) shares the kernels through `offset` (the weight
// read as offset + w) and `unit` (y = x * rstd * (offset + w) rounded once, dw from the unrounded
// x * rstd), both 0/false for the form above.
// All-bf16 rows with d % 8 == 0 on 16-byte boundaries take 8-wide variants of the same kernels
// (one 16-byte access per lane per step); the scalar ones serve every other dtype mix.
#include <algorithm>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_ops.h"

namespace lcx::ops::cuda {
namespace {

using lcx::cuda::ld;
using lcx::cuda::round_to;
using lcx::cuda::st;
using lcx::cuda::warp_sum;

constexpr int kWarps = 8;

__global__ void rmsnorm_fwd_kernel(const void* x, DType tx, const void* w, DType tw, float offset, bool unit, float eps,
                                   void* y, DType ty, float* rstd, int64_t rows, int64_t d) {
  const int lane = threadIdx.x % 32;
  for (int64_t r = blockIdx.x * int64_t(kWarps) + threadIdx.x / 32; r < rows; r += int64_t(gridDim.x) * kWarps) {
    const int64_t o = r * d;
    float ss = 0.f;
    for (int64_t i = lane; i < d; i += 32) {
      const float v = ld(x, tx, o + i);
      ss += v * v;
    }
    const float s = rsqrtf(warp_sum(ss) / static_cast<float>(d) + eps);
    if (lane == 0) rstd[r] = s;
    for (int64_t i = lane; i < d; i += 32) {
      const float wi = ld(w, tw, i) + offset, h = ld(x, tx, o + i) * s;
      st(y, ty, o + i, unit ? h * wi : wi * round_to(tx, h));
    }
  }
}

__global__ void rmsnorm_bwd_dx_kernel(const void* x, DType tx, const void* w, DType tw, float offset, const float* rstd,
                                      const void* dy, DType tdy, void* dx, DType tdx, int64_t rows, int64_t d) {
  const int lane = threadIdx.x % 32;
  for (int64_t r = blockIdx.x * int64_t(kWarps) + threadIdx.x / 32; r < rows; r += int64_t(gridDim.x) * kWarps) {
    const int64_t o = r * d;
    float dot = 0.f;  // sum of dh * x with dh = dy * w
    for (int64_t i = lane; i < d; i += 32) dot += ld(dy, tdy, o + i) * (ld(w, tw, i) + offset) * ld(x, tx, o + i);
    const float s = rstd[r];
    const float k = s * s * warp_sum(dot) / static_cast<float>(d);
    for (int64_t i = lane; i < d; i += 32)
      st(dx, tdx, o + i, s * (ld(dy, tdy, o + i) * (ld(w, tw, i) + offset) - ld(x, tx, o + i) * k));
  }
}

// partial[chunk, c] = sum over the chunk's rows of dy * h.
__global__ void rmsnorm_bwd_dw_partial_kernel(const void* x, DType tx, bool unit, const float* rstd, const void* dy,
                                              DType tdy, float* partial, int64_t rows, int64_t d, int64_t rows_per_chunk) {
  const int64_t c = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (c >= d) return;
  const int64_t r0 = blockIdx.y * rows_per_chunk, r1 = min(rows, r0 + rows_per_chunk);
  float acc = 0.f;
  for (int64_t r = r0; r < r1; ++r) {
    const float h = ld(x, tx, r * d + c) * rstd[r];
    acc += ld(dy, tdy, r * d + c) * (unit ? h : round_to(tx, h));
  }
  partial[blockIdx.y * d + c] = acc;
}

__global__ void rmsnorm_bwd_dw_reduce_kernel(const float* partial, int64_t chunks, void* dw, DType tdw, int64_t d) {
  const int64_t c = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (c >= d) return;
  float acc = 0.f;
  for (int64_t k = 0; k < chunks; ++k) acc += partial[k * d + c];
  st(dw, tdw, c, ld(dw, tdw, c) + acc);
}

__device__ __forceinline__ float bf16_round(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

__global__ void rmsnorm_fwd_bf16x8(const __nv_bfloat16* x, const __nv_bfloat16* w, float offset, bool unit, float eps,
                                   __nv_bfloat16* y, float* rstd, int64_t rows, int64_t d) {
  const int lane = threadIdx.x % 32;
  for (int64_t r = blockIdx.x * int64_t(kWarps) + threadIdx.x / 32; r < rows; r += int64_t(gridDim.x) * kWarps) {
    const __nv_bfloat16* xr = x + r * d;
    float ss = 0.f;
    for (int64_t i = lane * 8; i < d; i += 256) {
      float v[8];
      lcx::cuda::load8(xr + i, v);
#pragma unroll
      for (int k = 0; k < 8; ++k) ss += v[k] * v[k];
    }
    const float s = rsqrtf(warp_sum(ss) / static_cast<float>(d) + eps);
    if (lane == 0) rstd[r] = s;
    for (int64_t i = lane * 8; i < d; i += 256) {
      float v[8], wv[8];
      lcx::cuda::load8(xr + i, v);
      lcx::cuda::load8(w + i, wv);
#pragma unroll
      for (int k = 0; k < 8; ++k) v[k] = unit ? v[k] * s * (wv[k] + offset) : (wv[k] + offset) * bf16_round(v[k] * s);
      lcx::cuda::store8(y + r * d + i, v);
    }
  }
}

__global__ void rmsnorm_bwd_dx_bf16x8(const __nv_bfloat16* x, const __nv_bfloat16* w, float offset, const float* rstd,
                                      const __nv_bfloat16* dy, __nv_bfloat16* dx, int64_t rows, int64_t d) {
  const int lane = threadIdx.x % 32;
  for (int64_t r = blockIdx.x * int64_t(kWarps) + threadIdx.x / 32; r < rows; r += int64_t(gridDim.x) * kWarps) {
    const int64_t o = r * d;
    float dot = 0.f;
    for (int64_t i = lane * 8; i < d; i += 256) {
      float g[8], wv[8], v[8];
      lcx::cuda::load8(dy + o + i, g);
      lcx::cuda::load8(w + i, wv);
      lcx::cuda::load8(x + o + i, v);
#pragma unroll
      for (int k = 0; k < 8; ++k) dot += g[k] * (wv[k] + offset) * v[k];
    }
    const float s = rstd[r];
    const float kk = s * s * warp_sum(dot) / static_cast<float>(d);
    for (int64_t i = lane * 8; i < d; i += 256) {
      float g[8], wv[8], v[8];
      lcx::cuda::load8(dy + o + i, g);
      lcx::cuda::load8(w + i, wv);
      lcx::cuda::load8(x + o + i, v);
#pragma unroll
      for (int k = 0; k < 8; ++k) g[k] = s * (g[k] * (wv[k] + offset) - v[k] * kk);
      lcx::cuda::store8(dx + o + i, g);
    }
  }
}

// As rmsnorm_bwd_dw_partial_kernel, eight columns per thread.
__global__ void rmsnorm_bwd_dw_partial_bf16x8(const __nv_bfloat16* x, bool unit, const float* rstd,
                                              const __nv_bfloat16* dy, float* partial, int64_t rows, int64_t d,
                                              int64_t rows_per_chunk) {
  const int64_t c = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) * 8;
  if (c >= d) return;
  const int64_t r0 = blockIdx.y * rows_per_chunk, r1 = min(rows, r0 + rows_per_chunk);
  float acc[8] = {};
  for (int64_t r = r0; r < r1; ++r) {
    float g[8], v[8];
    lcx::cuda::load8(dy + r * d + c, g);
    lcx::cuda::load8(x + r * d + c, v);
    const float s = rstd[r];
#pragma unroll
    for (int k = 0; k < 8; ++k) acc[k] += g[k] * (unit ? v[k] * s : bf16_round(v[k] * s));
  }
  float4* out = reinterpret_cast<float4*>(partial + blockIdx.y * d + c);
  out[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
  out[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
}

unsigned row_blocks(int64_t rows) { return lcx::cuda::grid_for(rows, kWarps, 65535LL * 8); }

// The plain and the offset forms' host side.
void norm_forward(const Tensor& x, const Tensor& w, float offset, bool unit, float eps, Tensor& y, Tensor& rstd) {
  const int64_t d = x.size(-1), rows = lcx::cuda::rows_of(x);
  if (rows == 0) return;
  if (d % 8 == 0 && lcx::cuda::bf16_vectorizable({&x, &w, &y})) {
    rmsnorm_fwd_bf16x8<<<row_blocks(rows), kWarps * 32, 0, lcx::cuda::current_stream()>>>(
        x.data_as<const __nv_bfloat16>(), w.data_as<const __nv_bfloat16>(), offset, unit, eps, y.data_as<__nv_bfloat16>(),
        rstd.data_as<float>(), rows, d);
  } else {
    rmsnorm_fwd_kernel<<<row_blocks(rows), kWarps * 32, 0, lcx::cuda::current_stream()>>>(
        x.data(), x.dtype(), w.data(), w.dtype(), offset, unit, eps, y.data(), y.dtype(), rstd.data_as<float>(), rows, d);
  }
  LCX_CUDA_LAUNCH_CHECK();
}

void norm_backward(const Tensor& x, const Tensor& w, float offset, bool unit, const Tensor& rstd, const Tensor& dy,
                   Tensor& dx, Tensor& dw) {
  const int64_t d = x.size(-1), rows = lcx::cuda::rows_of(x);
  if (rows == 0) return;
  cudaStream_t stream = lcx::cuda::current_stream();
  const bool vec = d % 8 == 0 && lcx::cuda::bf16_vectorizable({&x, &w, &dy, &dx});
  if (vec) {
    rmsnorm_bwd_dx_bf16x8<<<row_blocks(rows), kWarps * 32, 0, stream>>>(
        x.data_as<const __nv_bfloat16>(), w.data_as<const __nv_bfloat16>(), offset, rstd.data_as<const float>(),
        dy.data_as<const __nv_bfloat16>(), dx.data_as<__nv_bfloat16>(), rows, d);
  } else {
    rmsnorm_bwd_dx_kernel<<<row_blocks(rows), kWarps * 32, 0, stream>>>(x.data(), x.dtype(), w.data(), w.dtype(), offset,
                                                                         rstd.data_as<const float>(), dy.data(),
                                                                         dy.dtype(), dx.data(), dx.dtype(), rows, d);
  }
  LCX_CUDA_LAUNCH_CHECK();

  // About four waves of blocks over the H200's 132 multiprocessors, each summing a run of rows.
  constexpr int threads = 128;
  const int64_t cols_per_thread = vec ? 8 : 1;
  const int64_t col_blocks = (d / cols_per_thread + threads - 1) / threads;
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>({rows, int64_t{65535}, 4 * 132 * 4 / col_blocks}));
  const int64_t rows_per_chunk = (rows + chunks - 1) / chunks;
  Tensor partial = Tensor::empty({chunks, d}, DType::f32, x.device());
  const dim3 grid(static_cast<unsigned>(col_blocks), static_cast<unsigned>(chunks));
  if (vec)
    rmsnorm_bwd_dw_partial_bf16x8<<<grid, threads, 0, stream>>>(x.data_as<const __nv_bfloat16>(), unit,
                                                                 rstd.data_as<const float>(),
                                                                 dy.data_as<const __nv_bfloat16>(),
                                                                 partial.data_as<float>(), rows, d, rows_per_chunk);
  else
    rmsnorm_bwd_dw_partial_kernel<<<grid, threads, 0, stream>>>(x.data(), x.dtype(), unit, rstd.data_as<const float>(),
                                                                 dy.data(), dy.dtype(), partial.data_as<float>(), rows,
                                                                 d, rows_per_chunk);
  LCX_CUDA_LAUNCH_CHECK();
  rmsnorm_bwd_dw_reduce_kernel<<<static_cast<unsigned>((d + threads - 1) / threads), threads, 0, stream>>>(
      partial.data_as<const float>(), chunks, dw.data(), dw.dtype(), d);
  LCX_CUDA_LAUNCH_CHECK();
}

}  // namespace

void rmsnorm_forward(const Tensor& x, const Tensor& w, float eps, Tensor& y, Tensor& rstd) {
  norm_forward(x, w, 0.f, false, eps, y, rstd);
}

void rmsnorm_backward(const Tensor& x, const Tensor& w, const Tensor& rstd, const Tensor& dy, Tensor& dx,
                      Tensor& dw) {
  norm_backward(x, w, 0.f, false, rstd, dy, dx, dw);
}

void rmsnorm_offset_forward(const Tensor& x, const Tensor& w, float offset, float eps, Tensor& y, Tensor& rstd) {
  norm_forward(x, w, offset, true, eps, y, rstd);
}

void rmsnorm_offset_backward(const Tensor& x, const Tensor& w, float offset, const Tensor& rstd, const Tensor& dy,
                             Tensor& dx, Tensor& dw) {
  norm_backward(x, w, offset, true, rstd, dy, dx, dw);
}

}  // namespace lcx::ops::cuda
