// One chunk of a chunked loss on the GPU: max, log-sum-exp, target logit and gradient in one
// kernel, one block per row of fp32 logits [n,V], and nothing read back to the host.
// Pass 1 keeps a running (max, sum of exp) per thread, four logits per 16-byte load when the row
// allows it, merged across the block into the row's log-sum-exp; thread 0 writes the row's loss
// into row_loss, a slice of the caller's per-token buffer, which the caller sums once per step
// (in row order, so the loss is deterministic and no chunk waits on the host). Pass 2 writes
// grad_scale * (softmax - onehot) in dlogits' dtype: over the logits in place for fp32, or
// straight into the bf16 operand of the head GEMMs, which saves a separate cast pass over [n,V].
// Two reads of the logits and one write of the gradient; rows with an ignored target only write
// zeros. exp is the fast hardware one: its error (a few ulp) sits far below the bf16 rounding of
// the gradient, and the kernel stays bound by memory.
#include <cmath>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_ops.h"

namespace lcx::ops::cuda {
namespace {

constexpr int kThreads = 1024;

// (m, s) <- the running max and sum of exp of both halves.
__device__ __forceinline__ void merge(float& m, float& s, float m2, float s2) {
  const float mn = fmaxf(m, m2);
  if (mn == -INFINITY) return;
  s = s * __expf(m - mn) + s2 * __expf(m2 - mn);
  m = mn;
}

__device__ __forceinline__ void add4(float& m, float& s, float4 v) {
  const float mn = fmaxf(fmaxf(m, fmaxf(v.x, v.y)), fmaxf(v.z, v.w));
  s = s * __expf(m - mn) + __expf(v.x - mn) + __expf(v.y - mn) + __expf(v.z - mn) + __expf(v.w - mn);
  m = mn;
}

__device__ __forceinline__ void add1(float& m, float& s, float x) {
  const float mn = fmaxf(m, x);
  s = s * __expf(m - mn) + __expf(x - mn);
  m = mn;
}

template <typename Out>
__device__ __forceinline__ Out to_out(float v);
template <>
__device__ __forceinline__ float to_out<float>(float v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 to_out<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <>
__device__ __forceinline__ __half to_out<__half>(float v) { return __float2half_rn(v); }

// Four gradients at p[0..3] (16 bytes for fp32, 8 for bf16/fp16: aligned by the caller).
template <typename Out>
__device__ __forceinline__ void store4(Out* p, float4 g) {
  if constexpr (sizeof(Out) == 4) {
    *reinterpret_cast<float4*>(p) = g;
  } else {
    struct alignas(8) Four {
      Out v[4];
    } f{{to_out<Out>(g.x), to_out<Out>(g.y), to_out<Out>(g.z), to_out<Out>(g.w)}};
    *reinterpret_cast<Four*>(p) = f;
  }
}

// Out is the gradient's storage type; dlogits == nullptr computes the loss only. kVec: V % 4 == 0
// and both rows start 16 (fp32) or 8 (bf16/fp16) bytes aligned.
template <typename Out, bool kVec>
__global__ void __launch_bounds__(kThreads) cross_entropy_chunk_kernel(const float* logits, const int64_t* targets,
                                                                        float grad_scale, float* row_loss,
                                                                        Out* dlogits, int64_t V) {
  __shared__ float sm[32], ss[32];
  const int64_t row = blockIdx.x;
  const float* x = logits + row * V;
  Out* d = dlogits ? dlogits + row * V : nullptr;
  const int64_t tg = targets[row];
  const int64_t V4 = kVec ? V / 4 : 0;
  if (tg < 0) {  // ignored row
    if (d) {
      if constexpr (kVec)
        for (int64_t i = threadIdx.x; i < V4; i += blockDim.x) store4(d + 4 * i, make_float4(0.f, 0.f, 0.f, 0.f));
      else
        for (int64_t i = threadIdx.x; i < V; i += blockDim.x) d[i] = to_out<Out>(0.f);
    }
    if (threadIdx.x == 0) row_loss[row] = 0.f;
    return;
  }

  float m = -INFINITY, s = 0.f;
  if constexpr (kVec) {
    const float4* x4 = reinterpret_cast<const float4*>(x);
    for (int64_t i = threadIdx.x; i < V4; i += blockDim.x) add4(m, s, x4[i]);
  } else {
    for (int64_t i = threadIdx.x; i < V; i += blockDim.x) add1(m, s, x[i]);
  }
  for (int off = 16; off > 0; off >>= 1)
    merge(m, s, __shfl_xor_sync(0xffffffffu, m, off), __shfl_xor_sync(0xffffffffu, s, off));
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) {
    sm[warp] = m;
    ss[warp] = s;
  }
  __syncthreads();
  m = lane < blockDim.x / 32 ? sm[lane] : -INFINITY;
  s = lane < blockDim.x / 32 ? ss[lane] : 0.f;
  for (int off = 16; off > 0; off >>= 1)
    merge(m, s, __shfl_xor_sync(0xffffffffu, m, off), __shfl_xor_sync(0xffffffffu, s, off));
  const float lse = m + logf(s);
  // A target past the vocabulary poisons the loss rather than reading out of bounds.
  const bool bad = tg >= V;
  if (threadIdx.x == 0) row_loss[row] = bad ? NAN : lse - x[tg];
  if (!d) return;
  __syncthreads();  // the target logit is read before pass 2 may overwrite it in place

  if constexpr (kVec) {
    const float4* x4 = reinterpret_cast<const float4*>(x);
    for (int64_t i = threadIdx.x; i < V4; i += blockDim.x) {
      const float4 v = x4[i];
      const int64_t j = 4 * i;  // compares, not an indexed float4, keep g in registers
      const float4 g = make_float4(grad_scale * (__expf(v.x - lse) - (j == tg ? 1.f : 0.f)),
                                   grad_scale * (__expf(v.y - lse) - (j + 1 == tg ? 1.f : 0.f)),
                                   grad_scale * (__expf(v.z - lse) - (j + 2 == tg ? 1.f : 0.f)),
                                   grad_scale * (__expf(v.w - lse) - (j + 3 == tg ? 1.f : 0.f)));
      store4(d + j, g);
    }
  } else {
    for (int64_t i = threadIdx.x; i < V; i += blockDim.x)
      d[i] = to_out<Out>(grad_scale * (__expf(x[i] - lse) - (i == tg ? 1.f : 0.f)));
  }
}

bool aligned(const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

template <typename Out>
void launch(const Tensor& logits, const Tensor& targets, float grad_scale, Tensor& row_loss, Out* dlogits) {
  const int64_t n = logits.size(0), V = logits.size(1);
  const bool vec = V % 4 == 0 && aligned(logits.data(), 16) && (!dlogits || aligned(dlogits, 4 * sizeof(Out)));
  cudaStream_t stream = lcx::cuda::current_stream();
  const auto args = [&](auto kernel) {
    kernel<<<static_cast<unsigned>(n), kThreads, 0, stream>>>(logits.data_as<const float>(),
                                                              targets.data_as<const int64_t>(), grad_scale,
                                                              row_loss.data_as<float>(), dlogits, V);
  };
  if (vec)
    args(cross_entropy_chunk_kernel<Out, true>);
  else
    args(cross_entropy_chunk_kernel<Out, false>);
  LCX_CUDA_LAUNCH_CHECK();
}

}  // namespace

void cross_entropy_chunk(const Tensor& logits, const Tensor& targets, float grad_scale, Tensor& row_loss,
                         Tensor* dlogits) {
  const int64_t n = logits.size(0);
  if (n == 0) return;
  LCX_CHECK(n <= 0x7fffffff, "cross entropy chunk of ", n, " rows: more than one grid");
  if (!dlogits) return launch<float>(logits, targets, grad_scale, row_loss, nullptr);
  switch (dlogits->dtype()) {
    case DType::bf16: return launch(logits, targets, grad_scale, row_loss, dlogits->data_as<__nv_bfloat16>());
    case DType::f16: return launch(logits, targets, grad_scale, row_loss, dlogits->data_as<__half>());
    default: return launch(logits, targets, grad_scale, row_loss, dlogits->data_as<float>());
  }
}

}  // namespace lcx::ops::cuda
