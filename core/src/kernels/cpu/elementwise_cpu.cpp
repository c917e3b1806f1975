// Elementwise ops, CPU reference: add, add_inplace, scale_inplace, cast. Any mix of float dtypes;
// each pass widens a chunk to fp32, computes, and rounds once into the destination's dtype.
// Chunks are loaded before anything is stored, so out may alias an input.
#include "kernels/cpu/cpu_ops.h"

namespace lcx::ops::cpu {
namespace {
constexpr int64_t kChunk = 4096;
}  // namespace

void add(const Tensor& a, const Tensor& b, Tensor& out) {
  std::vector<float> x(kChunk), y(kChunk);
  for (int64_t o = 0; o < a.numel(); o += kChunk) {
    const int64_t n = std::min(kChunk, a.numel() - o);
    load_f32(a, o, n, x.data());
    load_f32(b, o, n, y.data());
    for (int64_t i = 0; i < n; ++i) x[i] += y[i];
    store_f32(x.data(), n, out, o);
  }
}

void add_inplace(Tensor& acc, const Tensor& x) { add(acc, x, acc); }

void scale_inplace(Tensor& x, float s) {
  if (x.dtype() == DType::f32) {
    float* p = x.data_as<float>();
    for (int64_t i = 0; i < x.numel(); ++i) p[i] *= s;
    return;
  }
  std::vector<float> v(kChunk);
  for (int64_t o = 0; o < x.numel(); o += kChunk) {
    const int64_t n = std::min(kChunk, x.numel() - o);
    load_f32(x, o, n, v.data());
    for (int64_t i = 0; i < n; ++i) v[i] *= s;
    store_f32(v.data(), n, x, o);
  }
}

void cast(const Tensor& src, Tensor& dst) {
  std::vector<float> v(kChunk);
  for (int64_t o = 0; o < src.numel(); o += kChunk) {
    const int64_t n = std::min(kChunk, src.numel() - o);
    load_f32(src, o, n, v.data());
    store_f32(v.data(), n, dst, o);
  }
}

}  // namespace lcx::ops::cpu
