// grouped_matmul and its weight gradient, CPU reference: the CPU matmul once per group, on row
// views of the operands and the group's matrix of w (or dw), so the fp32 math and the single
// rounding on store are matmul_cpu.cpp's.
#include "kernels/cpu/cpu_ops.h"

namespace lcx::ops::cpu {

void grouped_matmul(const Tensor& x, const Tensor& w, bool trans_w, std::span<const int64_t> offsets, Tensor& y,
                    float alpha, float beta) {
  for (size_t g = 0; g + 1 < offsets.size(); ++g) {
    const int64_t begin = offsets[g], end = offsets[g + 1];
    if (begin == end) continue;
    Tensor yg = y.rows(begin, end);
    const auto e = static_cast<int64_t>(g);
    matmul(x.rows(begin, end), false, w.rows(e, e + 1), trans_w, yg, alpha, beta);
  }
}

// A group with no rows is a product with an empty inner dimension: matmul leaves beta * dw[g].
void grouped_matmul_wgrad(const Tensor& dy, const Tensor& x, std::span<const int64_t> offsets, Tensor& dw, float alpha,
                          float beta) {
  for (size_t g = 0; g + 1 < offsets.size(); ++g) {
    const int64_t begin = offsets[g], end = offsets[g + 1];
    const auto e = static_cast<int64_t>(g);
    Tensor dwg = dw.rows(e, e + 1);
    matmul(dy.rows(begin, end), true, x.rows(begin, end), false, dwg, alpha, beta);
  }
}

}  // namespace lcx::ops::cpu
