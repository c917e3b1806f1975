// Elementwise ops on the GPU: add, add_inplace, scale_inplace, cast, and SwiGLU forward/backward.
// Each is one grid-stride pass that widens to fp32, computes, and rounds once on store, so the
// result is bit-for-bit what the CPU reference stores. Every thread loads its element before it
// stores, so an output may alias an input. Memory-bound: one read of each input and one write of
// each output; the fused SwiGLU backward reads gate, up, dout once and writes both gradients.
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

}  // namespace

void add(const Tensor& a, const Tensor& b, Tensor& out) {
  const int64_t n = out.numel();
  if (n == 0) return;
  add_kernel<<<lcx::cuda::grid_for(n, kThreads), kThreads, 0, lcx::cuda::current_stream()>>>(
      a.data(), a.dtype(), b.data(), b.dtype(), out.data(), out.dtype(), n);
  LCX_CUDA_LAUNCH_CHECK();
}

void add_inplace(Tensor& acc, const Tensor& x) { add(acc, x, acc); }

void scale_inplace(Tensor& x, float s) {
  const int64_t n = x.numel();
  if (n == 0) return;
  scale_kernel<<<lcx::cuda::grid_for(n, kThreads), kThreads, 0, lcx::cuda::current_stream()>>>(x.data(), x.dtype(),
                                                                                              s, n);
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
  cast_kernel<<<lcx::cuda::grid_for(n, kThreads), kThreads, 0, lcx::cuda::current_stream()>>>(
      src.data(), src.dtype(), dst.data(), dst.dtype(), n);
  LCX_CUDA_LAUNCH_CHECK();
}

void swiglu_forward(const Tensor& gate, const Tensor& up, Tensor& out) {
  const int64_t n = gate.numel();
  if (n == 0) return;
  swiglu_fwd_kernel<<<lcx::cuda::grid_for(n, kThreads), kThreads, 0, lcx::cuda::current_stream()>>>(
      gate.data(), gate.dtype(), up.data(), up.dtype(), out.data(), out.dtype(), n);
  LCX_CUDA_LAUNCH_CHECK();
}

void swiglu_backward(const Tensor& gate, const Tensor& up, const Tensor& dout, Tensor& dgate, Tensor& dup) {
  const int64_t n = gate.numel();
  if (n == 0) return;
  swiglu_bwd_kernel<<<lcx::cuda::grid_for(n, kThreads), kThreads, 0, lcx::cuda::current_stream()>>>(
      gate.data(), gate.dtype(), up.data(), up.dtype(), dout.data(), dout.dtype(), dgate.data(), dgate.dtype(),
      dup.data(), dup.dtype(), n);
  LCX_CUDA_LAUNCH_CHECK();
}

}  // namespace lcx::ops::cuda
