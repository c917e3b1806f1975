// copy_columns on the GPU: a block of columns is a pitched 2-D region, so one cudaMemcpy2DAsync on
// the current stream moves it (the copy engine handles the strides; no kernel of ours). Bytes only:
// the result is bit-for-bit the CPU twin's. upload: a few host bytes (tables, constants) into a
// device tensor on the current stream.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_ops.h"

namespace lcx::ops::cuda {

void copy_columns(const Tensor& src, int64_t src_col, Tensor& dst, int64_t dst_col, int64_t cols) {
  const size_t es = dtype_size(src.dtype());
  const int64_t rows = src.size(-1) ? src.numel() / src.size(-1) : 0;
  if (rows == 0 || cols == 0) return;
  const auto* s = static_cast<const char*>(src.data()) + static_cast<size_t>(src_col) * es;
  auto* d = static_cast<char*>(dst.data()) + static_cast<size_t>(dst_col) * es;
  LCX_CUDA_CHECK(cudaMemcpy2DAsync(d, static_cast<size_t>(dst.size(-1)) * es, s, static_cast<size_t>(src.size(-1)) * es,
                                   static_cast<size_t>(cols) * es, static_cast<size_t>(rows), cudaMemcpyDeviceToDevice,
                                   lcx::cuda::current_stream()));
}

void upload(const void* host, Tensor& dst) {
  if (dst.nbytes() == 0) return;
  LCX_CUDA_CHECK(cudaMemcpyAsync(dst.data(), host, dst.nbytes(), cudaMemcpyHostToDevice, lcx::cuda::current_stream()));
}

}  // namespace lcx::ops::cuda
