// Inverted dropout on the GPU: a block per row (grid-stride over rows), its threads over the
// columns, so each element's counter is (row, column) with no division. Memory-bound: one read of
// x (and of out where beta != 0), one write. Widened to fp32 and rounded once, with the CPU twin's
// operations in its order (kernels/dropout_mask.h draws the same mask), so the bits agree.
#include <algorithm>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/dropout_mask.h"

namespace lcx::ops::cuda {
namespace {

using lcx::cuda::ld;
using lcx::cuda::st;

constexpr int kThreads = 256;

__global__ void dropout_kernel(const void* x, DType tx, void* out, DType to, int64_t rows, int64_t cols,
                               uint64_t key, const int64_t* index, int64_t col0, uint32_t threshold, float scale, float beta) {
  for (int64_t i = blockIdx.x; i < rows; i += gridDim.x) {
    const int64_t row = index ? index[i] : i;
    for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) {
      const int64_t e = i * cols + j;
      const float kept = dropout_keep(key, row, col0 + j, threshold) ? __fmul_rn(ld(x, tx, e), scale) : 0.f;
      st(out, to, e, beta != 0.f ? fmaf(beta, ld(out, to, e), kept) : kept);
    }
  }
}

}  // namespace

void dropout(const Tensor& x, float p, uint64_t key, const Tensor& index, int64_t col0, Tensor& out, float beta) {
  const int64_t rows = x.size(0), cols = x.size(1);
  if (rows == 0 || cols == 0) return;
  const int blocks = static_cast<int>(std::min<int64_t>(rows, 65535));
  dropout_kernel<<<blocks, kThreads, 0, lcx::cuda::current_stream()>>>(
      x.data(), x.dtype(), out.data(), out.dtype(), rows, cols, key, index.defined() ? index.data_as<const int64_t>() : nullptr, col0, dropout_threshold(p), dropout_scale(p), beta);
  LCX_CUDA_LAUNCH_CHECK();
}

}  // namespace lcx::ops::cuda
