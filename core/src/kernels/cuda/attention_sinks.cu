// Attention sinks on the GPU (lcx/ops.h attention_sinks_forward / _backward; the CPU twin,
// kernels/cpu/attention_sinks_cpu.cpp, says the math). Memory-bound passes over the attention
// output, fp32 math whatever the storage.
// Forward: one block per token row; its first H threads merge the sink into the row's H LSE
// entries (kept in shared memory, so no thread reads an LSE another has rewritten), then the block
// scales the row's H x d outputs.
// Backward: deterministic, no atomics: blocks (head, part) sum exp(s - lse') * dot(dout, out')
// over a fixed share of the rows, a warp per row, into partials [H, parts]; one thread per head
// then adds its parts in order into dsinks.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_ops.h"

namespace lcx::ops::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kParts = 64;  // row shares per head in the backward

__global__ void sinks_forward_kernel(void* out, DType dt, float* lse, const void* sinks, DType sink_dt, int64_t head0,
                                     int64_t T, int64_t H, int64_t d) {
  extern __shared__ float factor[];
  const int64_t t = blockIdx.x;
  for (int64_t h = threadIdx.x; h < H; h += blockDim.x) {
    const float old = lse[h * T + t], s = lcx::cuda::ld(sinks, sink_dt, head0 + h);
    const float m = fmaxf(old, s);
    const float merged = m + logf(expf(old - m) + expf(s - m));
    lse[h * T + t] = merged;
    factor[h] = expf(old - merged);
  }
  __syncthreads();
  const int64_t n = H * d, base = t * n;
  for (int64_t e = threadIdx.x; e < n; e += blockDim.x)
    lcx::cuda::st(out, dt, base + e, lcx::cuda::ld(out, dt, base + e) * factor[e / d]);
}

__global__ void sinks_backward_partials(const void* out, const void* dout, DType dt, const float* lse,
                                        const void* sinks, DType sink_dt, int64_t head0, int64_t T, int64_t H, int64_t d,
                                        float* partials) {
  __shared__ float scratch[32];
  const int64_t h = blockIdx.x, part = blockIdx.y;
  const int64_t per = (T + kParts - 1) / kParts, t0 = part * per, t1 = lcx::cuda::lmin(T, t0 + per);
  const float s = lcx::cuda::ld(sinks, sink_dt, head0 + h);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  float acc = 0.f;
  for (int64_t t = t0 + warp; t < t1; t += warps) {
    const int64_t at = (t * H + h) * d;
    float D = 0.f;
    for (int64_t c = lane; c < d; c += 32) D += lcx::cuda::ld(out, dt, at + c) * lcx::cuda::ld(dout, dt, at + c);
    D = lcx::cuda::warp_sum(D);
    if (lane == 0) acc += expf(s - lse[h * T + t]) * D;
  }
  acc = lcx::cuda::block_sum(acc, scratch);
  if (threadIdx.x == 0) partials[h * kParts + part] = acc;
}

__global__ void sinks_backward_sum(const float* partials, int64_t H, int64_t head0, float* dsinks) {
  const int64_t h = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (h >= H) return;
  float sum = 0.f;
  for (int p = 0; p < kParts; ++p) sum += partials[h * kParts + p];
  dsinks[head0 + h] -= sum;
}

}  // namespace

void attention_sinks_forward(Tensor& out, Tensor& lse, const Tensor& sinks, int64_t head0) {
  const int64_t T = out.size(0), H = out.size(1), d = out.size(2);
  if (T == 0 || H == 0) return;
  sinks_forward_kernel<<<static_cast<unsigned>(T), kThreads, static_cast<size_t>(H) * sizeof(float),
                         lcx::cuda::current_stream()>>>(out.data(), out.dtype(), lse.data_as<float>(), sinks.data(),
                                                        sinks.dtype(), head0, T, H, d);
  LCX_CUDA_LAUNCH_CHECK();
}

void attention_sinks_backward(const Tensor& out, const Tensor& lse, const Tensor& dout, const Tensor& sinks,
                              int64_t head0, Tensor& dsinks) {
  const int64_t T = out.size(0), H = out.size(1), d = out.size(2);
  if (T == 0 || H == 0) return;
  Tensor partials = Tensor::empty({H, kParts}, DType::f32, out.device());
  const dim3 grid(static_cast<unsigned>(H), kParts);
  sinks_backward_partials<<<grid, kThreads, 0, lcx::cuda::current_stream()>>>(
      out.data(), dout.data(), out.dtype(), lse.data_as<const float>(), sinks.data(), sinks.dtype(), head0, T, H, d,
      partials.data_as<float>());
  LCX_CUDA_LAUNCH_CHECK();
  sinks_backward_sum<<<lcx::cuda::grid_for(H, 128), 128, 0, lcx::cuda::current_stream()>>>(
      partials.data_as<const float>(), H, head0, dsinks.data_as<float>());
  LCX_CUDA_LAUNCH_CHECK();
}

}  // namespace lcx::ops::cuda
