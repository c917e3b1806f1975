// Inverted dropout, CPU reference: a row at a time widened to fp32, the kept elements scaled,
// beta * out added with one fused multiply-add (as the GPU kernel does), rounded once on store.
#include <cmath>
#include <vector>

#include "kernels/cpu/cpu_ops.h"
#include "kernels/dropout_mask.h"

namespace lcx::ops::cpu {

void dropout(const Tensor& x, float p, uint64_t key, int64_t row0, int64_t col0, Tensor& out, float beta) {
  const int64_t rows = x.size(0), cols = x.size(1);
  const uint32_t threshold = dropout_threshold(p);
  const float scale = dropout_scale(p);
  std::vector<float> v(cols), o(cols);
  for (int64_t i = 0; i < rows; ++i) {
    load_f32(x, i * cols, cols, v.data());
    if (beta != 0.f) load_f32(out, i * cols, cols, o.data());
    for (int64_t j = 0; j < cols; ++j) {
      const float kept = dropout_keep(key, row0 + i, col0 + j, threshold) ? v[j] * scale : 0.f;
      v[j] = beta != 0.f ? std::fma(beta, o[j], kept) : kept;
    }
    store_f32(v.data(), cols, out, i * cols);
  }
}

}  // namespace lcx::ops::cpu
