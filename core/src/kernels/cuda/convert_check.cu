// The loader's convert-and-check on the GPU (kernels/convert_check.h): one grid-stride pass that
// widens each stored value to fp32, rounds it to the target dtype as the CPU twin does (NaN payloads
// by the same bit rules as lcx/dtype.h, so even a NaN's bits agree), and lowers a per-tensor counter
// to the index of any element that is not finite. Non-finite weights are rare, so the atomic is
// off the common path.
#include "kernels/convert_check.h"
#include "kernels/cuda/common.cuh"

namespace lcx::ops::cuda {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float widen(const void* p, StoredFloat from, int64_t i) {
  switch (from) {
    case StoredFloat::f64: return __double2float_rn(static_cast<const double*>(p)[i]);
    case StoredFloat::f32: return static_cast<const float*>(p)[i];
    case StoredFloat::f16: {
      const uint16_t b = static_cast<const uint16_t*>(p)[i];
      if ((b & 0x7c00u) == 0x7c00u)  // Inf or NaN: the CPU's bit rule, payload kept
        return __uint_as_float((static_cast<uint32_t>(b & 0x8000u) << 16) | 0x7f800000u |
                               (static_cast<uint32_t>(b & 0x3ffu) << 13));
      return __half2float(__ushort_as_half(b));
    }
    default: return __uint_as_float(static_cast<uint32_t>(static_cast<const uint16_t*>(p)[i]) << 16);
  }
}

// Stores v as dtype t and returns the stored bits' verdict: finite or not.
__device__ __forceinline__ bool store(void* p, DType t, int64_t i, float v) {
  const uint32_t u = __float_as_uint(v);
  const bool nan = (u & 0x7f800000u) == 0x7f800000u && (u & 0x7fffffu);
  switch (t) {
    case DType::bf16: {
      const uint16_t b = nan ? static_cast<uint16_t>((u >> 16) | 0x40u) : __bfloat16_as_ushort(__float2bfloat16_rn(v));
      static_cast<uint16_t*>(p)[i] = b;
      return (b & 0x7f80u) != 0x7f80u;
    }
    case DType::f16: {
      const uint16_t b = nan ? static_cast<uint16_t>(((u >> 16) & 0x8000u) | 0x7e00u) : __half_as_ushort(__float2half_rn(v));
      static_cast<uint16_t*>(p)[i] = b;
      return (b & 0x7c00u) != 0x7c00u;
    }
    default:
      static_cast<float*>(p)[i] = v;
      return (u & 0x7f800000u) != 0x7f800000u;
  }
}

__global__ void convert_check_kernel(const void* src, StoredFloat from, void* dst, DType to, int64_t n, uint64_t base,
                                     unsigned long long* first_bad) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    if (!store(dst, to, i, widen(src, from, i)) && first_bad) atomicMin(first_bad, static_cast<unsigned long long>(base + i));
}

// The check alone, for a tensor already in its dtype: the exponent bits, 8 elements of 16 bits (or
// 4 of 32) per 16-byte load where the range is aligned.
// `mask` is the exponent of a 16-bit element (bf16 0x7f80, fp16 0x7c00); fp32's is fixed.
__global__ void check_kernel(const void* p, int esize, uint32_t mask, int64_t n, uint64_t base,
                             unsigned long long* first_bad) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int per = 16 / esize;
  const int64_t vecs = reinterpret_cast<uintptr_t>(p) % 16 == 0 ? n / per : 0;
  for (int64_t v = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; v < vecs; v += stride) {
    const uint4 q = static_cast<const uint4*>(p)[v];
    const uint32_t w[4] = {q.x, q.y, q.z, q.w};
    for (int k = 0; k < 4; ++k) {
      const bool bad = esize == 4 ? (w[k] & 0x7f800000u) == 0x7f800000u
                                  : ((w[k] & mask) == mask) || ((w[k] >> 16 & mask) == mask);
      if (!bad) continue;
      for (int j = 0; j < per / 4; ++j) {  // find which element of the word
        const uint32_t b = esize == 4 ? w[k] : (w[k] >> (16 * j)) & 0xffffu;
        if (esize == 4 ? (b & 0x7f800000u) == 0x7f800000u : (b & mask) == mask)
          atomicMin(first_bad, static_cast<unsigned long long>(base + v * per + k * (per / 4) + j));
      }
    }
  }
  for (int64_t i = vecs * per + blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n; i += stride) {
    const uint32_t b = esize == 4 ? static_cast<const uint32_t*>(p)[i] : static_cast<const uint16_t*>(p)[i];
    if (esize == 4 ? (b & 0x7f800000u) == 0x7f800000u : (b & mask) == mask)
      atomicMin(first_bad, static_cast<unsigned long long>(base + i));
  }
}

}  // namespace

void convert_check(const void* src, StoredFloat from, void* dst, DType to, int64_t n, uint64_t base,
                   unsigned long long* first_bad) {
  if (n == 0) return;
  cudaStream_t stream = lcx::cuda::current_stream();
  const bool same = (from == StoredFloat::f32 && to == DType::f32) || (from == StoredFloat::bf16 && to == DType::bf16) ||
                    (from == StoredFloat::f16 && to == DType::f16);
  if (same) {
    const size_t bytes = static_cast<size_t>(n) * dtype_size(to);
    if (src != dst) LCX_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream));
    if (!first_bad) return;
    check_kernel<<<lcx::cuda::grid_for(n / 8 + 1, kThreads), kThreads, 0, stream>>>(
        dst, static_cast<int>(dtype_size(to)), to == DType::f16 ? 0x7c00u : 0x7f80u, n, base, first_bad);
  } else {
    LCX_CHECK(src != dst, "convert_check converts in place only within one encoding");
    convert_check_kernel<<<lcx::cuda::grid_for(n, kThreads), kThreads, 0, stream>>>(src, from, dst, to, n, base, first_bad);
  }
  LCX_CUDA_LAUNCH_CHECK();
}

}  // namespace lcx::ops::cuda
