// Elementwise ops on the GPU: add, add_inplace, scale_inplace, cast, SwiGLU and GeGLU (tanh GELU,
// kernels/cpu/geglu_cpu.cpp) forward/backward.
// Each is one grid-stride pass that widens to fp32, computes, and rounds once on store, so the
// result is bit-for-bit what the CPU reference stores. Every thread loads its element before it
// stores, so an output may alias an input. Memory-bound: one read of each input and one write of
// each output; the fused SwiGLU backward reads gate, up, dout once and writes both gradients.
// When every tensor is bf16 and 16-byte aligned (the step's common case) a vectorized kernel moves
// eight elements per 16-byte access and the scalar kernel finishes the last n % 8; both round the
// same way, so the path taken never changes a stored bit.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_ops.h"

namespace lcx::ops::cuda {
namespace {

using lcx::cuda::ld;
using lcx::cuda::st;

constexpr int kThreads = 256;

__global__ void add_kernel(const void* a, DType ta, const void* b, DType tb, void* out, DType to, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    st(out, to, i, ld(a, ta, i) + ld(b, tb, i));
}

__global__ void scale_kernel(void* x, DType t, float s, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    st(x, t, i, ld(x, t, i) * s);
}

__global__ void cast_kernel(const void* src, DType ts, void* dst, DType td, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    st(dst, td, i, ld(src, ts, i));
}

__device__ __forceinline__ float sigmoid(float g) { return 1.f / (1.f + expf(-g)); }

__global__ void swiglu_fwd_kernel(const void* gate, DType tg, const void* up, DType tu, void* out, DType to,
                                  int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float g = ld(gate, tg, i);
    st(out, to, i, g * sigmoid(g) * ld(up, tu, i));
  }
}

__global__ void swiglu_bwd_kernel(const void* gate, DType tg, const void* up, DType tu, const void* dout, DType td,
                                  void* dgate, DType tdg, void* dup, DType tdu, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float g = ld(gate, tg, i), u = ld(up, tu, i), d = ld(dout, td, i);
    const float sg = sigmoid(g);
    st(dgate, tdg, i, d * u * sg * (1.f + g * (1.f - sg)));
    st(dup, tdu, i, d * g * sg);
  }
}

constexpr float kGeluBeta = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluKappa = 0.044715f;

// gelu_tanh(g) and its derivative, as torch's gelu(approximate="tanh") and its backward.
__device__ __forceinline__ void gelu_tanh(float g, float& value, float& slope) {
  const float t = tanhf(kGeluBeta * (g + kGeluKappa * g * g * g));
  value = 0.5f * g * (1.f + t);
  slope = 0.5f * (1.f + t) + 0.5f * g * (1.f - t * t) * kGeluBeta * (1.f + 3.f * kGeluKappa * g * g);
}

__global__ void geglu_fwd_kernel(const void* gate, DType tg, const void* up, DType tu, void* out, DType to, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    float v, slope;
    gelu_tanh(ld(gate, tg, i), v, slope);
    st(out, to, i, v * ld(up, tu, i));
  }
}

__global__ void geglu_bwd_kernel(const void* gate, DType tg, const void* up, DType tu, const void* dout, DType td,
                                 void* dgate, DType tdg, void* dup, DType tdu, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    float v, slope;
    gelu_tanh(ld(gate, tg, i), v, slope);
    const float d = ld(dout, td, i);
    st(dgate, tdg, i, d * ld(up, tu, i) * slope);
    st(dup, tdu, i, d * v);
  }
}

// The clamped SwiGLU over gate_up [rows, 2I] (gate and up interleaved): i counts out's elements.
__global__ void swiglu_clamped_fwd_kernel(const void* gu, DType tg, void* out, DType to, float alpha, float limit,
                                          int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float g = fminf(ld(gu, tg, 2 * i), limit), u = fminf(fmaxf(ld(gu, tg, 2 * i + 1), -limit), limit);
    st(out, to, i, (u + 1.f) * (g * sigmoid(alpha * g)));
  }
}

__global__ void swiglu_clamped_bwd_kernel(const void* gu, DType tg, const void* dout, DType td, void* dgu, DType tdg,
                                          float alpha, float limit, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float gate = ld(gu, tg, 2 * i), up = ld(gu, tg, 2 * i + 1), d = ld(dout, td, i);
    const float g = fminf(gate, limit), u = fminf(fmaxf(up, -limit), limit);
    const float s = sigmoid(alpha * g);
    st(dgu, tdg, 2 * i, gate <= limit ? d * (u + 1.f) * s * (1.f + alpha * g * (1.f - s)) : 0.f);
    st(dgu, tdg, 2 * i + 1, up >= -limit && up <= limit ? d * g * s : 0.f);
  }
}

// The 8-wide bf16 kernels: i counts groups of eight elements.
#define LCX_FOR_EACH_VEC8(n8) \
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < (n8); i += int64_t(gridDim.x) * blockDim.x)

__global__ void add_bf16x8(const __nv_bfloat16* a, const __nv_bfloat16* b, __nv_bfloat16* out, int64_t n8) {
  LCX_FOR_EACH_VEC8(n8) {
    float x[8], y[8];
    lcx::cuda::load8(a + i * 8, x);
    lcx::cuda::load8(b + i * 8, y);
#pragma unroll
    for (int k = 0; k < 8; ++k) x[k] += y[k];
    lcx::cuda::store8(out + i * 8, x);
  }
}

__global__ void scale_bf16x8(__nv_bfloat16* x, float s, int64_t n8) {
  LCX_FOR_EACH_VEC8(n8) {
    float v[8];
    lcx::cuda::load8(x + i * 8, v);
#pragma unroll
    for (int k = 0; k < 8; ++k) v[k] *= s;
    lcx::cuda::store8(x + i * 8, v);
  }
}

__global__ void cast_bf16_to_f32x8(const __nv_bfloat16* src, float* dst, int64_t n8) {
  LCX_FOR_EACH_VEC8(n8) {
    float v[8];
    lcx::cuda::load8(src + i * 8, v);
    reinterpret_cast<float4*>(dst + i * 8)[0] = make_float4(v[0], v[1], v[2], v[3]);
    reinterpret_cast<float4*>(dst + i * 8)[1] = make_float4(v[4], v[5], v[6], v[7]);
  }
}

__global__ void cast_f32_to_bf16x8(const float* src, __nv_bfloat16* dst, int64_t n8) {
  LCX_FOR_EACH_VEC8(n8) {
    const float4 a = reinterpret_cast<const float4*>(src + i * 8)[0], b = reinterpret_cast<const float4*>(src + i * 8)[1];
    const float v[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
    lcx::cuda::store8(dst + i * 8, v);
  }
}

__global__ void swiglu_fwd_bf16x8(const __nv_bfloat16* gate, const __nv_bfloat16* up, __nv_bfloat16* out, int64_t n8) {
  LCX_FOR_EACH_VEC8(n8) {
    float g[8], u[8];
    lcx::cuda::load8(gate + i * 8, g);
    lcx::cuda::load8(up + i * 8, u);
#pragma unroll
    for (int k = 0; k < 8; ++k) g[k] = g[k] * sigmoid(g[k]) * u[k];
    lcx::cuda::store8(out + i * 8, g);
  }
}

__global__ void swiglu_bwd_bf16x8(const __nv_bfloat16* gate, const __nv_bfloat16* up, const __nv_bfloat16* dout,
                                  __nv_bfloat16* dgate, __nv_bfloat16* dup, int64_t n8) {
  LCX_FOR_EACH_VEC8(n8) {
    float g[8], u[8], d[8];
    lcx::cuda::load8(gate + i * 8, g);
    lcx::cuda::load8(up + i * 8, u);
    lcx::cuda::load8(dout + i * 8, d);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const float sg = sigmoid(g[k]);
      const float dg = d[k] * u[k] * sg * (1.f + g[k] * (1.f - sg));
      u[k] = d[k] * g[k] * sg;
      g[k] = dg;
    }
    lcx::cuda::store8(dgate + i * 8, g);
    lcx::cuda::store8(dup + i * 8, u);
  }
}

__global__ void geglu_fwd_bf16x8(const __nv_bfloat16* gate, const __nv_bfloat16* up, __nv_bfloat16* out, int64_t n8) {
  LCX_FOR_EACH_VEC8(n8) {
    float g[8], u[8];
    lcx::cuda::load8(gate + i * 8, g);
    lcx::cuda::load8(up + i * 8, u);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      float v, slope;
      gelu_tanh(g[k], v, slope);
      g[k] = v * u[k];
    }
    lcx::cuda::store8(out + i * 8, g);
  }
}

__global__ void geglu_bwd_bf16x8(const __nv_bfloat16* gate, const __nv_bfloat16* up, const __nv_bfloat16* dout,
                                 __nv_bfloat16* dgate, __nv_bfloat16* dup, int64_t n8) {
  LCX_FOR_EACH_VEC8(n8) {
    float g[8], u[8], d[8];
    lcx::cuda::load8(gate + i * 8, g);
    lcx::cuda::load8(up + i * 8, u);
    lcx::cuda::load8(dout + i * 8, d);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      float v, slope;
      gelu_tanh(g[k], v, slope);
      g[k] = d[k] * u[k] * slope;
      u[k] = d[k] * v;
    }
    lcx::cuda::store8(dgate + i * 8, g);
    lcx::cuda::store8(dup + i * 8, u);
  }
}

#undef LCX_FOR_EACH_VEC8

template <typename T>
T* at(const Tensor& t, int64_t i) {
  return reinterpret_cast<T*>(static_cast<char*>(t.data()) + i * static_cast<int64_t>(dtype_size(t.dtype())));
}

}  // namespace

void add(const Tensor& a, const Tensor& b, Tensor& out) {
  const int64_t n = out.numel();
  if (n == 0) return;
  cudaStream_t stream = lcx::cuda::current_stream();
  int64_t done = 0;
  if (lcx::cuda::bf16_vectorizable({&a, &b, &out}) && n >= 8) {
    done = n / 8 * 8;
    add_bf16x8<<<lcx::cuda::grid_for(n / 8, kThreads), kThreads, 0, stream>>>(
        a.data_as<const __nv_bfloat16>(), b.data_as<const __nv_bfloat16>(), out.data_as<__nv_bfloat16>(), n / 8);
    LCX_CUDA_LAUNCH_CHECK();
  }
  if (done == n) return;
  add_kernel<<<lcx::cuda::grid_for(n - done, kThreads), kThreads, 0, stream>>>(
      at<const void>(a, done), a.dtype(), at<const void>(b, done), b.dtype(), at<void>(out, done), out.dtype(), n - done);
  LCX_CUDA_LAUNCH_CHECK();
}

void add_inplace(Tensor& acc, const Tensor& x) { add(acc, x, acc); }

void scale_inplace(Tensor& x, float s) {
  const int64_t n = x.numel();
  if (n == 0) return;
  cudaStream_t stream = lcx::cuda::current_stream();
  int64_t done = 0;
  if (lcx::cuda::bf16_vectorizable({&x}) && n >= 8) {
    done = n / 8 * 8;
    scale_bf16x8<<<lcx::cuda::grid_for(n / 8, kThreads), kThreads, 0, stream>>>(x.data_as<__nv_bfloat16>(), s, n / 8);
    LCX_CUDA_LAUNCH_CHECK();
  }
  if (done == n) return;
  scale_kernel<<<lcx::cuda::grid_for(n - done, kThreads), kThreads, 0, stream>>>(at<void>(x, done), x.dtype(), s,
                                                                                 n - done);
  LCX_CUDA_LAUNCH_CHECK();
}

void cast(const Tensor& src, Tensor& dst) {
  const int64_t n = src.numel();
  if (n == 0) return;
  if (src.dtype() == dst.dtype()) {
    LCX_CUDA_CHECK(cudaMemcpyAsync(dst.data(), src.data(), src.nbytes(), cudaMemcpyDeviceToDevice,
                                   lcx::cuda::current_stream()));
    return;
  }
  cudaStream_t stream = lcx::cuda::current_stream();
  const bool aligned = reinterpret_cast<uintptr_t>(src.data()) % 16 == 0 && reinterpret_cast<uintptr_t>(dst.data()) % 16 == 0;
  int64_t done = 0;
  if (aligned && n >= 8 && src.dtype() == DType::bf16 && dst.dtype() == DType::f32) {
    done = n / 8 * 8;
    cast_bf16_to_f32x8<<<lcx::cuda::grid_for(n / 8, kThreads), kThreads, 0, stream>>>(
        src.data_as<const __nv_bfloat16>(), dst.data_as<float>(), n / 8);
    LCX_CUDA_LAUNCH_CHECK();
  } else if (aligned && n >= 8 && src.dtype() == DType::f32 && dst.dtype() == DType::bf16) {
    done = n / 8 * 8;
    cast_f32_to_bf16x8<<<lcx::cuda::grid_for(n / 8, kThreads), kThreads, 0, stream>>>(
        src.data_as<const float>(), dst.data_as<__nv_bfloat16>(), n / 8);
    LCX_CUDA_LAUNCH_CHECK();
  }
  if (done == n) return;
  cast_kernel<<<lcx::cuda::grid_for(n - done, kThreads), kThreads, 0, stream>>>(
      at<const void>(src, done), src.dtype(), at<void>(dst, done), dst.dtype(), n - done);
  LCX_CUDA_LAUNCH_CHECK();
}

void swiglu_forward(const Tensor& gate, const Tensor& up, Tensor& out) {
  const int64_t n = gate.numel();
  if (n == 0) return;
  cudaStream_t stream = lcx::cuda::current_stream();
  int64_t done = 0;
  if (lcx::cuda::bf16_vectorizable({&gate, &up, &out}) && n >= 8) {
    done = n / 8 * 8;
    swiglu_fwd_bf16x8<<<lcx::cuda::grid_for(n / 8, kThreads), kThreads, 0, stream>>>(
        gate.data_as<const __nv_bfloat16>(), up.data_as<const __nv_bfloat16>(), out.data_as<__nv_bfloat16>(), n / 8);
    LCX_CUDA_LAUNCH_CHECK();
  }
  if (done == n) return;
  swiglu_fwd_kernel<<<lcx::cuda::grid_for(n - done, kThreads), kThreads, 0, stream>>>(
      at<const void>(gate, done), gate.dtype(), at<const void>(up, done), up.dtype(), at<void>(out, done),
      out.dtype(), n - done);
  LCX_CUDA_LAUNCH_CHECK();
}

void swiglu_backward(const Tensor& gate, const Tensor& up, const Tensor& dout, Tensor& dgate, Tensor& dup) {
  const int64_t n = gate.numel();
  if (n == 0) return;
  cudaStream_t stream = lcx::cuda::current_stream();
  int64_t done = 0;
  if (lcx::cuda::bf16_vectorizable({&gate, &up, &dout, &dgate, &dup}) && n >= 8) {
    done = n / 8 * 8;
    swiglu_bwd_bf16x8<<<lcx::cuda::grid_for(n / 8, kThreads), kThreads, 0, stream>>>(
        gate.data_as<const __nv_bfloat16>(), up.data_as<const __nv_bfloat16>(), dout.data_as<const __nv_bfloat16>(),
        dgate.data_as<__nv_bfloat16>(), dup.data_as<__nv_bfloat16>(), n / 8);
    LCX_CUDA_LAUNCH_CHECK();
  }
  if (done == n) return;
  swiglu_bwd_kernel<<<lcx::cuda::grid_for(n - done, kThreads), kThreads, 0, stream>>>(
      at<const void>(gate, done), gate.dtype(), at<const void>(up, done), up.dtype(), at<const void>(dout, done),
      dout.dtype(), at<void>(dgate, done), dgate.dtype(), at<void>(dup, done), dup.dtype(), n - done);
  LCX_CUDA_LAUNCH_CHECK();
}

void geglu_tanh_forward(const Tensor& gate, const Tensor& up, Tensor& out) {
  const int64_t n = gate.numel();
  if (n == 0) return;
  cudaStream_t stream = lcx::cuda::current_stream();
  int64_t done = 0;
  if (lcx::cuda::bf16_vectorizable({&gate, &up, &out}) && n >= 8) {
    done = n / 8 * 8;
    geglu_fwd_bf16x8<<<lcx::cuda::grid_for(n / 8, kThreads), kThreads, 0, stream>>>(
        gate.data_as<const __nv_bfloat16>(), up.data_as<const __nv_bfloat16>(), out.data_as<__nv_bfloat16>(), n / 8);
    LCX_CUDA_LAUNCH_CHECK();
  }
  if (done == n) return;
  geglu_fwd_kernel<<<lcx::cuda::grid_for(n - done, kThreads), kThreads, 0, stream>>>(
      at<const void>(gate, done), gate.dtype(), at<const void>(up, done), up.dtype(), at<void>(out, done),
      out.dtype(), n - done);
  LCX_CUDA_LAUNCH_CHECK();
}

void geglu_tanh_backward(const Tensor& gate, const Tensor& up, const Tensor& dout, Tensor& dgate, Tensor& dup) {
  const int64_t n = gate.numel();
  if (n == 0) return;
  cudaStream_t stream = lcx::cuda::current_stream();
  int64_t done = 0;
  if (lcx::cuda::bf16_vectorizable({&gate, &up, &dout, &dgate, &dup}) && n >= 8) {
    done = n / 8 * 8;
    geglu_bwd_bf16x8<<<lcx::cuda::grid_for(n / 8, kThreads), kThreads, 0, stream>>>(
        gate.data_as<const __nv_bfloat16>(), up.data_as<const __nv_bfloat16>(), dout.data_as<const __nv_bfloat16>(),
        dgate.data_as<__nv_bfloat16>(), dup.data_as<__nv_bfloat16>(), n / 8);
    LCX_CUDA_LAUNCH_CHECK();
  }
  if (done == n) return;
  geglu_bwd_kernel<<<lcx::cuda::grid_for(n - done, kThreads), kThreads, 0, stream>>>(
      at<const void>(gate, done), gate.dtype(), at<const void>(up, done), up.dtype(), at<const void>(dout, done),
      dout.dtype(), at<void>(dgate, done), dgate.dtype(), at<void>(dup, done), dup.dtype(), n - done);
  LCX_CUDA_LAUNCH_CHECK();
}

void swiglu_clamped_forward(const Tensor& gate_up, float alpha, float limit, Tensor& out) {
  const int64_t n = out.numel();
  if (n == 0) return;
  swiglu_clamped_fwd_kernel<<<lcx::cuda::grid_for(n, kThreads), kThreads, 0, lcx::cuda::current_stream()>>>(
      gate_up.data(), gate_up.dtype(), out.data(), out.dtype(), alpha, limit, n);
  LCX_CUDA_LAUNCH_CHECK();
}

void swiglu_clamped_backward(const Tensor& gate_up, const Tensor& dout, float alpha, float limit, Tensor& dgate_up) {
  const int64_t n = dout.numel();
  if (n == 0) return;
  swiglu_clamped_bwd_kernel<<<lcx::cuda::grid_for(n, kThreads), kThreads, 0, lcx::cuda::current_stream()>>>(
      gate_up.data(), gate_up.dtype(), dout.data(), dout.dtype(), dgate_up.data(), dgate_up.dtype(), alpha, limit, n);
  LCX_CUDA_LAUNCH_CHECK();
}

}  // namespace lcx::ops::cuda
