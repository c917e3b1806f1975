// Embedding on the GPU. Forward: one block row per token copies table[ids[t]] into out[t]
// (converting when the dtypes differ). Backward scatters grad_out rows into grad_table with fp32
// atomics (bf16/fp16 atomics for a low-precision grad_table): a token id that appears several
// times receives the sum of its rows in some order, so the result is deterministic only up to
// fp32 rounding. ids are range-checked on the host only for CPU tensors, so the kernels guard
// their reads: an id outside the table yields a NaN row forward (the loss shows it) and no
// update backward.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_ops.h"

namespace lcx::ops::cuda {
namespace {

using lcx::cuda::ld;
using lcx::cuda::st;

constexpr int kThreads = 256;

__global__ void embedding_fwd_kernel(const int32_t* ids, const void* table, DType tt, void* out, DType to,
                                     int64_t T, int64_t V, int64_t H) {
  for (int64_t t = blockIdx.x; t < T; t += gridDim.x) {
    const int64_t id = ids[t], src = id * H, dst = t * H;
    const bool ok = id >= 0 && id < V;
    for (int64_t i = threadIdx.x; i < H; i += blockDim.x) st(out, to, dst + i, ok ? ld(table, tt, src + i) : NAN);
  }
}

__global__ void embedding_bwd_kernel(const int32_t* ids, const void* grad_out, DType tg, void* grad_table,
                                     DType tt, int64_t T, int64_t V, int64_t H) {
  for (int64_t t = blockIdx.x; t < T; t += gridDim.x) {
    const int64_t id = ids[t], row = id * H, src = t * H;
    if (id < 0 || id >= V) continue;
    for (int64_t i = threadIdx.x; i < H; i += blockDim.x) {
      const float g = ld(grad_out, tg, src + i);
      switch (tt) {
        case DType::bf16: atomicAdd(static_cast<__nv_bfloat16*>(grad_table) + row + i, __float2bfloat16_rn(g)); break;
        case DType::f16: atomicAdd(static_cast<__half*>(grad_table) + row + i, __float2half_rn(g)); break;
        default: atomicAdd(static_cast<float*>(grad_table) + row + i, g); break;
      }
    }
  }
}

}  // namespace

void embedding_forward(const Tensor& ids, const Tensor& table, Tensor& out) {
  const int64_t T = ids.numel(), H = table.size(1);
  if (T == 0 || H == 0) return;
  embedding_fwd_kernel<<<static_cast<unsigned>(std::min<int64_t>(T, 65535 * 4)), kThreads, 0,
                         lcx::cuda::current_stream()>>>(ids.data_as<const int32_t>(), table.data(), table.dtype(),
                                                        out.data(), out.dtype(), T, table.size(0), H);
  LCX_CUDA_LAUNCH_CHECK();
}

void embedding_backward(const Tensor& ids, const Tensor& grad_out, Tensor& grad_table) {
  const int64_t T = ids.numel(), H = grad_table.size(1);
  if (T == 0 || H == 0) return;
  embedding_bwd_kernel<<<static_cast<unsigned>(std::min<int64_t>(T, 65535 * 4)), kThreads, 0,
                         lcx::cuda::current_stream()>>>(ids.data_as<const int32_t>(), grad_out.data(),
                                                        grad_out.dtype(), grad_table.data(), grad_table.dtype(), T,
                                                        grad_table.size(0), H);
  LCX_CUDA_LAUNCH_CHECK();
}

}  // namespace lcx::ops::cuda
