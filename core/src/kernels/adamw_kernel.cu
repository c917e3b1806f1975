// GPU AdamW: one thread per element, the same fp32 expression order as the CPU twin; the compute
// copy is written from the master in the same pass so weights cross memory once. The gradient
// norm is a grid-stride fp32 sum of squares per block, summed in fp64 on the host.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "cuda/check.h"
#include "kernels/adamw_kernel.h"

namespace lcx::adamw {
namespace {

template <typename T>
__device__ float ld(const T* p, int64_t i);
template <>
__device__ float ld<float>(const float* p, int64_t i) { return p[i]; }
template <>
__device__ float ld<__nv_bfloat16>(const __nv_bfloat16* p, int64_t i) { return __bfloat162float(p[i]); }

template <typename T>
__device__ void st(T* p, int64_t i, float x);
template <>
__device__ void st<float>(float* p, int64_t i, float x) { p[i] = x; }
template <>
__device__ void st<__nv_bfloat16>(__nv_bfloat16* p, int64_t i, float x) { p[i] = __float2bfloat16_rn(x); }
template <>
__device__ void st<__half>(__half* p, int64_t i, float x) { p[i] = __float2half_rn(x); }

// P: the dtype updated (master or value), M: moments, V: compute copy written beside (or P),
// G: the gradient (fp32, or the weights' dtype where the run keeps it so).
template <typename P, typename M, typename V, typename G>
__global__ void adamw_kernel(P* p, V* value, bool write_value, const G* grad, M* m, M* v, int64_t n, Hyper h) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float g = ld(grad, i);
    float x = ld(p, i) * (1.0f - h.lr * h.weight_decay);
    float mi = ld(m, i);
    mi = mi + (1.0f - h.beta1) * (g - mi);
    float vi = ld(v, i) * h.beta2 + (1.0f - h.beta2) * g * g;
    float denom = sqrtf(vi) / h.bias_correction2_sqrt + h.eps;
    x -= h.step_size * (mi / denom);
    st(m, i, mi);
    st(v, i, vi);
    st(p, i, x);
    if (write_value) st(value, i, x);
  }
}

template <typename G>
__global__ void sum_squares_kernel(const G* g, int64_t n, float* partial) {
  __shared__ float shared[256];
  float s = 0;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float x = ld(g, i);
    s += x * x;
  }
  shared[threadIdx.x] = s;
  __syncthreads();
  for (int w = blockDim.x / 2; w > 0; w /= 2) {
    if (threadIdx.x < w) shared[threadIdx.x] += shared[threadIdx.x + w];
    __syncthreads();
  }
  if (threadIdx.x == 0) partial[blockIdx.x] = shared[0];
}

int blocks_for(int64_t n) { return static_cast<int>(std::min<int64_t>((n + 255) / 256, 4096)); }

template <typename G>
void update_with(Tensor& master, Tensor& value, const G* g, Tensor& m, Tensor& v, const Hyper& h) {
  const int64_t n = value.numel();
  const int blocks = blocks_for(n);
  if (master.defined()) {
    LCX_CHECK(m.dtype() == DType::f32, "fp32 master needs fp32 moments");
    float* p = master.data_as<float>();
    switch (value.dtype()) {
      case DType::bf16:
        adamw_kernel<<<blocks, 256>>>(p, value.data_as<__nv_bfloat16>(), true, g, m.data_as<float>(), v.data_as<float>(), n, h);
        break;
      case DType::f16:
        adamw_kernel<<<blocks, 256>>>(p, value.data_as<__half>(), true, g, m.data_as<float>(), v.data_as<float>(), n, h);
        break;
      case DType::f32:
        adamw_kernel<<<blocks, 256>>>(p, value.data_as<float>(), true, g, m.data_as<float>(), v.data_as<float>(), n, h);
        break;
      default: throw Error("AdamW: parameters must be floating point");
    }
  } else {
    switch (value.dtype()) {
      case DType::bf16: {
        auto* p = value.data_as<__nv_bfloat16>();
        adamw_kernel<<<blocks, 256>>>(p, p, false, g, m.data_as<__nv_bfloat16>(), v.data_as<__nv_bfloat16>(), n, h);
        break;
      }
      case DType::f32: {
        auto* p = value.data_as<float>();
        adamw_kernel<<<blocks, 256>>>(p, p, false, g, m.data_as<float>(), v.data_as<float>(), n, h);
        break;
      }
      default: throw Error("AdamW without master weights supports bf16 and fp32 parameters");
    }
  }
  LCX_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void update_cuda(Tensor& master, Tensor& value, const Tensor& grad, Tensor& m, Tensor& v, const Hyper& h) {
  if (value.numel() == 0) return;
  switch (grad.dtype()) {
    case DType::f32: return update_with(master, value, grad.data_as<float>(), m, v, h);
    case DType::bf16: return update_with(master, value, grad.data_as<__nv_bfloat16>(), m, v, h);
    default: throw Error(str("AdamW: ", dtype_name(grad.dtype()), " gradients"), {}, "gradients are fp32 or bf16");
  }
}

double sum_squares_cuda(const Tensor& grad) {
  const int64_t n = grad.numel();
  if (n == 0) return 0;
  const int blocks = blocks_for(n);
  Tensor partial = Tensor::empty({blocks}, DType::f32, grad.device());
  if (grad.dtype() == DType::bf16)
    sum_squares_kernel<<<blocks, 256>>>(grad.data_as<__nv_bfloat16>(), n, partial.data_as<float>());
  else
    sum_squares_kernel<<<blocks, 256>>>(grad.data_as<float>(), n, partial.data_as<float>());
  LCX_CUDA_CHECK(cudaGetLastError());
  double s = 0;
  for (float x : partial.to_floats()) s += x;
  return s;
}

}  // namespace lcx::adamw
