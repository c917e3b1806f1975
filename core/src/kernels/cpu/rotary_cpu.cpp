// Rotary embedding, CPU reference, rotate-half convention (as transformers' apply_rotary_pos_emb):
// each head vector of x [T,heads,d] splits into x1 = x[:d/2], x2 = x[d/2:]; with the row's
// c = cos[t], s = sin[t] (fp32 [T,d/2]): out1 = x1*c - x2*s, out2 = x2*c + x1*s, in place.
// The map is a rotation per pair, so backward is the same rotation with -sin.
#include "kernels/cpu/cpu_ops.h"

namespace lcx::ops::cpu {
namespace {

void rotate(Tensor& x, const Tensor& cos, const Tensor& sin, float sign) {
  const int64_t T = x.size(0), heads = x.size(1), d = x.size(2), half = d / 2;
  const float* c = cos.data_as<const float>();
  const float* s = sin.data_as<const float>();
  std::vector<float> row(d);
  for (int64_t t = 0; t < T; ++t) {
    const float* ct = c + t * half;
    const float* st = s + t * half;
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t off = (t * heads + h) * d;
      load_f32(x, off, d, row.data());
      for (int64_t i = 0; i < half; ++i) {
        const float x1 = row[i], x2 = row[i + half], sn = sign * st[i];
        row[i] = x1 * ct[i] - x2 * sn;
        row[i + half] = x2 * ct[i] + x1 * sn;
      }
      store_f32(row.data(), d, x, off);
    }
  }
}

}  // namespace

void rotary_forward(Tensor& x, const Tensor& cos, const Tensor& sin) { rotate(x, cos, sin, 1.f); }
void rotary_backward(Tensor& dx, const Tensor& cos, const Tensor& sin) { rotate(dx, cos, sin, -1.f); }

}  // namespace lcx::ops::cpu
