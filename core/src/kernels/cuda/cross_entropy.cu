// Cross entropy on the GPU, forward and backward fused, one block per row of logits [T,V]:
// pass 1 keeps a running (max, sum of exp) per thread, combined across the block into the row's
// log-sum-exp; the row loss is lse - x[target]; pass 2 writes grad_scale * (softmax - onehot)
// over the row (in place when dlogits aliases logits: each element is read before it is written
// by the same thread). Two reads and one write of the logits. Row losses land in an fp32 buffer
// that one block sums in double, in a fixed order, so the loss is deterministic; the host reads
// back 16 bytes.
#include <cmath>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_ops.h"

namespace lcx::ops::cuda {
namespace {

using lcx::cuda::ld;
using lcx::cuda::st;

constexpr int kThreads = 512;

__device__ __forceinline__ void combine(float& m, float& s, float m2, float s2) {
  const float mn = fmaxf(m, m2);
  if (mn == -INFINITY) return;
  s = s * expf(m - mn) + s2 * expf(m2 - mn);
  m = mn;
}

__global__ void cross_entropy_kernel(const void* logits, DType tl, const int64_t* targets, float grad_scale,
                                     void* dlogits, DType td, float* row_loss, int64_t V) {
  __shared__ float sm[32], ss[32];
  const int64_t row = blockIdx.x;
  const int64_t o = row * V;
  const int64_t tg = targets[row];
  if (tg < 0) {  // ignored row
    if (dlogits)
      for (int64_t i = threadIdx.x; i < V; i += blockDim.x) st(dlogits, td, o + i, 0.f);
    if (threadIdx.x == 0) row_loss[row] = 0.f;
    return;
  }
  float m = -INFINITY, s = 0.f;
  for (int64_t i = threadIdx.x; i < V; i += blockDim.x) {
    const float x = ld(logits, tl, o + i);
    if (x > m) {
      s = s * expf(m - x) + 1.f;
      m = x;
    } else {
      s += expf(x - m);
    }
  }
  for (int off = 16; off > 0; off >>= 1)
    combine(m, s, __shfl_xor_sync(0xffffffffu, m, off), __shfl_xor_sync(0xffffffffu, s, off));
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) {
    sm[warp] = m;
    ss[warp] = s;
  }
  __syncthreads();
  m = lane < blockDim.x / 32 ? sm[lane] : -INFINITY;
  s = lane < blockDim.x / 32 ? ss[lane] : 0.f;
  for (int off = 16; off > 0; off >>= 1)
    combine(m, s, __shfl_xor_sync(0xffffffffu, m, off), __shfl_xor_sync(0xffffffffu, s, off));
  const float lse = m + logf(s);
  // A target past the vocabulary poisons the loss rather than reading out of bounds.
  const bool bad = tg >= V;
  if (threadIdx.x == 0) row_loss[row] = bad ? NAN : lse - ld(logits, tl, o + tg);
  __syncthreads();  // the target logit is read before pass 2 may overwrite it in place
  if (!dlogits) return;
  for (int64_t i = threadIdx.x; i < V; i += blockDim.x) {
    const float p = expf(ld(logits, tl, o + i) - lse);
    st(dlogits, td, o + i, grad_scale * (p - (i == tg ? 1.f : 0.f)));
  }
}

struct LossSum {
  double loss;
  long long valid;
};

__global__ void loss_sum_kernel(const float* row_loss, const int64_t* targets, int64_t T, LossSum* out) {
  __shared__ double sl[1024];
  __shared__ long long sv[1024];
  double l = 0;
  long long v = 0;
  for (int64_t i = threadIdx.x; i < T; i += blockDim.x) {
    l += row_loss[i];
    v += targets[i] >= 0;
  }
  sl[threadIdx.x] = l;
  sv[threadIdx.x] = v;
  __syncthreads();
  for (int w = blockDim.x / 2; w > 0; w >>= 1) {
    if (threadIdx.x < w) {
      sl[threadIdx.x] += sl[threadIdx.x + w];
      sv[threadIdx.x] += sv[threadIdx.x + w];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) *out = {sl[0], sv[0]};
}

}  // namespace

double cross_entropy_forward_backward(const Tensor& logits, const Tensor& targets, double grad_scale,
                                      Tensor* dlogits, int64_t* valid) {
  const int64_t T = logits.size(0), V = logits.size(1);
  if (T == 0) {
    if (valid) *valid = 0;
    return 0.0;
  }
  LCX_CHECK(T <= 0x7fffffff, "cross entropy over ", T, " rows: more than one grid");
  cudaStream_t stream = lcx::cuda::current_stream();
  Tensor row_loss = Tensor::empty({T}, DType::f32, logits.device());
  Tensor sum = Tensor::empty({2}, DType::i64, logits.device());  // one LossSum
  cross_entropy_kernel<<<static_cast<unsigned>(T), kThreads, 0, stream>>>(
      logits.data(), logits.dtype(), targets.data_as<const int64_t>(), static_cast<float>(grad_scale),
      dlogits ? dlogits->data() : nullptr, dlogits ? dlogits->dtype() : DType::f32, row_loss.data_as<float>(), V);
  LCX_CUDA_LAUNCH_CHECK();
  loss_sum_kernel<<<1, 1024, 0, stream>>>(row_loss.data_as<const float>(), targets.data_as<const int64_t>(), T,
                                          static_cast<LossSum*>(sum.data()));
  LCX_CUDA_LAUNCH_CHECK();
  LossSum host;
  LCX_CUDA_CHECK(cudaMemcpyAsync(&host, sum.data(), sizeof(LossSum), cudaMemcpyDeviceToHost, stream));
  LCX_CUDA_CHECK(cudaStreamSynchronize(stream));
  if (valid) *valid = host.valid;
  return host.loss;
}

}  // namespace lcx::ops::cuda
