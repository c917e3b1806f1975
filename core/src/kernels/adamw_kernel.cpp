// CPU AdamW, element by element in torch's order:
//   p *= 1 - lr*wd; m = lerp(m, g, 1-b1); v = b2*v + (1-b2)*g*g;
//   p -= step_size * m / (sqrt(v)/bc2_sqrt + eps)
#include <cmath>

#include "kernels/adamw_kernel.h"
#include "lcx/grad_norm.h"

namespace lcx::adamw {
namespace {

float load(const Tensor& t, int64_t i) {
  switch (t.dtype()) {
    case DType::f32: return t.data_as<float>()[i];
    case DType::bf16: return bf16_to_float(t.data_as<bf16>()[i]);
    case DType::f16: return f16_to_float(t.data_as<f16>()[i]);
    default: throw Error(str("AdamW: unsupported dtype ", dtype_name(t.dtype())));
  }
}

void store(Tensor& t, int64_t i, float x) {
  switch (t.dtype()) {
    case DType::f32: t.data_as<float>()[i] = x; break;
    case DType::bf16: t.data_as<bf16>()[i] = float_to_bf16(x); break;
    case DType::f16: t.data_as<f16>()[i] = float_to_f16(x); break;
    default: throw Error(str("AdamW: unsupported dtype ", dtype_name(t.dtype())));
  }
}

}  // namespace

void update(Tensor& master, Tensor& value, const Tensor& grad, Tensor& m, Tensor& v, const Hyper& h) {
#ifdef LCX_HAVE_CUDA
  if (value.device().is_cuda()) return update_cuda(master, value, grad, m, v, h);
#endif
  const bool has_master = master.defined();
  Tensor& p = has_master ? master : value;
  const int64_t n = p.numel();
  for (int64_t i = 0; i < n; ++i) {
    const float g = load(grad, i);
    float x = load(p, i);
    x *= 1.0f - h.lr * h.weight_decay;
    float mi = load(m, i);
    mi = mi + (1.0f - h.beta1) * (g - mi);
    float vi = load(v, i);
    vi = vi * h.beta2 + (1.0f - h.beta2) * g * g;
    float denom = std::sqrt(vi) / h.bias_correction2_sqrt + h.eps;
    x -= h.step_size * (mi / denom);
    store(m, i, mi);
    store(v, i, vi);
    store(p, i, x);
    if (has_master) store(value, i, x);
  }
}

double sum_squares(const Tensor& grad) {
#ifdef LCX_HAVE_CUDA
  if (grad.device().is_cuda()) return sum_squares_cuda(grad);
#endif
  double s = 0;
  for (int64_t i = 0; i < grad.numel(); ++i) {
    const double g = load(grad, i);
    s += g * g;
  }
  return s;
}

}  // namespace lcx::adamw

namespace lcx::ops {

double sum_squares(const Tensor& x) { return adamw::sum_squares(x); }

}  // namespace lcx::ops
