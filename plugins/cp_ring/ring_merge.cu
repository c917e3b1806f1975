// ring_merge.cu: the log-sum-exp merge of a block's partial attention into the running result
// (ring_merge.h), on the GPU. One warp per (query row, head): every lane reads both LSEs, scales
// its slice of head_dim, and after a warp sync lane 0 writes the merged LSE, so no lane reads a
// value another lane already overwrote. Memory-bound; fp32 math and accumulator, the block's
// output read in its own dtype. Issued on the legacy default stream, where lcx's kernels run
// unless a caller set another (the SDK exposes no stream); ordering with them is implicit.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "ring_merge.h"

namespace lcx::cp_ring {
namespace {

constexpr int kWarpsPerBlock = 8;

__device__ float load(const void* p, int64_t i, DType t) {
  if (t == DType::bf16) return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
  if (t == DType::f16) return __half2float(static_cast<const __half*>(p)[i]);
  return static_cast<const float*>(p)[i];
}

struct MergeParams {
  float* acc_out;  // [T,H,d]
  float* acc_lse;  // [H,T]
  const void* blk_out;  // [n,H,d]
  DType blk_dtype;
  const float* blk_lse;  // [H,blk_T]
  int64_t T, H, d, n, row0, blk_row0, blk_T;
  bool first;
};

__global__ void merge_kernel(MergeParams p) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  const int lane = static_cast<int>(threadIdx.x % 32);
  if (row >= p.n * p.H) return;
  const int64_t i = row / p.H, h = row % p.H;
  float* o = p.acc_out + ((p.row0 + i) * p.H + h) * p.d;
  const int64_t b = ((p.blk_row0 + i) * p.H + h) * p.d;
  float* la = p.acc_lse + h * p.T + p.row0 + i;
  const float lb = p.blk_lse[h * p.blk_T + p.blk_row0 + i];
  if (p.first) {
    for (int64_t e = lane; e < p.d; e += 32) o[e] = load(p.blk_out, b + e, p.blk_dtype);
    if (lane == 0) *la = lb;
    return;
  }
  const float a = *la;
  const float m = fmaxf(a, lb);
  if (m == -INFINITY) return;  // neither part saw a key: the row stays empty
  const float lse = m + logf(expf(a - m) + expf(lb - m));
  const float wa = expf(a - lse), wb = expf(lb - lse);
  for (int64_t e = lane; e < p.d; e += 32) o[e] = wa * o[e] + wb * load(p.blk_out, b + e, p.blk_dtype);
  __syncwarp();
  if (lane == 0) *la = lse;
}

}  // namespace

void merge_cuda(Tensor& acc_out, Tensor& acc_lse, const Tensor& blk_out, const Tensor& blk_lse, const MergeRows& m) {
  MergeParams p;
  p.acc_out = acc_out.data_as<float>();
  p.acc_lse = acc_lse.data_as<float>();
  p.blk_out = blk_out.data();
  p.blk_dtype = blk_out.dtype();
  p.blk_lse = blk_lse.data_as<const float>();
  p.T = acc_out.size(0);
  p.H = acc_out.size(1);
  p.d = acc_out.size(2);
  p.n = m.n;
  p.row0 = m.row0;
  p.blk_row0 = m.blk_row0;
  p.blk_T = m.blk_T;
  p.first = m.first;
  const int64_t rows = p.n * p.H;
  if (rows == 0) return;
  const unsigned blocks = static_cast<unsigned>((rows + kWarpsPerBlock - 1) / kWarpsPerBlock);
  merge_kernel<<<blocks, kWarpsPerBlock * 32>>>(p);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    throw Error(str("cp_ring merge kernel launch failed: ", cudaGetErrorString(e), " at ", __FILE__, ":", __LINE__));
}

}  // namespace lcx::cp_ring
