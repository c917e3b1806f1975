// Inverted dropout, CPU reference: a row at a time widened to fp32, the kept elements scaled,
// beta * out added with one fused multiply-add (as the GPU kernel does), rounded once on store.
#include <cmath>
#include <vector>

#include "kernels/cpu/cpu_ops.h"
#include "kernels/dropout_mask.h"

namespace lcx::ops::cpu {

void dropout(const Tensor& x, float p, uint64_t key, const Tensor& rows, int64_t col0, Tensor& out, float beta) {
  const int64_t n = x.size(0), cols = x.size(1);
  const int64_t* index = rows.defined() ? rows.data_as<const int64_t>() : nullptr;
  const uint32_t threshold = dropout_threshold(p);
  const float scale = dropout_scale(p);
  std::vector<float> v(cols), o(cols);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t row = index ? index[i] : i;
    load_f32(x, i * cols, cols, v.data());
    if (beta != 0.f) load_f32(out, i * cols, cols, o.data());
    for (int64_t j = 0; j < cols; ++j) {
      const float kept = dropout_keep(key, row, col0 + j, threshold) ? v[j] * scale : 0.f;
      v[j] = beta != 0.f ? std::fma(beta, o[j], kept) : kept;
    }
    store_f32(v.data(), cols, out, i * cols);
  }
}

}  // namespace lcx::ops::cpu
