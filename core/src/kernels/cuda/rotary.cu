// Rotary embedding on the GPU, rotate-half convention, in place on x [T,heads,d]. One thread per
// rotated pair (x[i], x[i+d/2]) of one head: it reads both, rotates by the row's angle from the
// fp32 cos/sin tables [T,d/2], and writes both back, so no two threads touch one element.
// Backward is the inverse rotation (sin negated). One read and one write of x; the tables are
// reread per head and stay in L2.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_ops.h"

namespace lcx::ops::cuda {
namespace {

using lcx::cuda::ld;
using lcx::cuda::st;

__global__ void rotary_kernel(void* x, DType t, const float* cos, const float* sin, int64_t heads, int64_t half,
                              float sign, int64_t pairs) {
  for (int64_t p = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; p < pairs; p += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = p % half, row = p / half;  // row = token * heads + head
    const int64_t tok = row / heads;
    const float c = cos[tok * half + i], s = sign * sin[tok * half + i];
    const int64_t o = row * 2 * half + i;
    const float x1 = ld(x, t, o), x2 = ld(x, t, o + half);
    st(x, t, o, x1 * c - x2 * s);
    st(x, t, o + half, x2 * c + x1 * s);
  }
}

void rotate(Tensor& x, const Tensor& cos, const Tensor& sin, float sign) {
  const int64_t T = x.size(0), heads = x.size(1), half = x.size(2) / 2;
  const int64_t pairs = T * heads * half;
  if (pairs == 0) return;
  rotary_kernel<<<lcx::cuda::grid_for(pairs, 256), 256, 0, lcx::cuda::current_stream()>>>(
      x.data(), x.dtype(), cos.data_as<const float>(), sin.data_as<const float>(), heads, half, sign, pairs);
  LCX_CUDA_LAUNCH_CHECK();
}

}  // namespace

void rotary_forward(Tensor& x, const Tensor& cos, const Tensor& sin) { rotate(x, cos, sin, 1.f); }
void rotary_backward(Tensor& dx, const Tensor& cos, const Tensor& sin) { rotate(dx, cos, sin, -1.f); }

}  // namespace lcx::ops::cuda
