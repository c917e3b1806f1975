// RMSNorm, CPU reference, numerics of transformers' Qwen3RMSNorm: per row of the last dimension,
// rstd = 1/sqrt(mean(x^2) + eps) in fp32, h = (x * rstd) rounded to x's dtype, y = w * h rounded
// to y's dtype. rstd is kept (fp32 [rows]) so backward need not recompute the reduction.
// Backward: dh = dy * w, dx = rstd * (dh - x * rstd^2 * mean(dh * x)); dw += sum over rows of
// dy * h, gathered in fp32 scratch and added into dw once.
// The offset form (Gemma3RMSNorm): y = x * rstd * (offset + w) in fp32, rounded once on store;
// backward as above with (offset + w) for w and dw += dy * x * rstd unrounded.
#include <cmath>

#include "kernels/cpu/cpu_ops.h"

namespace lcx::ops::cpu {

void rmsnorm_forward(const Tensor& x, const Tensor& w, float eps, Tensor& y, Tensor& rstd) {
  const int64_t d = x.size(-1), rows = rstd.numel();
  const std::vector<float> wf = to_f32(w);
  std::vector<float> xr(d), yr(d);
  float* rs = rstd.data_as<float>();
  for (int64_t r = 0; r < rows; ++r) {
    load_f32(x, r * d, d, xr.data());
    float ss = 0.f;
    for (int64_t i = 0; i < d; ++i) ss += xr[i] * xr[i];
    const float s = 1.f / std::sqrt(ss / static_cast<float>(d) + eps);
    rs[r] = s;
    for (int64_t i = 0; i < d; ++i) yr[i] = wf[i] * round_to(x.dtype(), xr[i] * s);
    store_f32(yr.data(), d, y, r * d);
  }
}

void rmsnorm_backward(const Tensor& x, const Tensor& w, const Tensor& rstd, const Tensor& dy, Tensor& dx,
                      Tensor& dw) {
  const int64_t d = x.size(-1), rows = rstd.numel();
  const std::vector<float> wf = to_f32(w);
  std::vector<float> xr(d), dyr(d), dxr(d), dwacc(d, 0.f);
  const float* rs = rstd.data_as<const float>();
  for (int64_t r = 0; r < rows; ++r) {
    load_f32(x, r * d, d, xr.data());
    load_f32(dy, r * d, d, dyr.data());
    const float s = rs[r];
    float dot = 0.f;  // sum of dh * x
    for (int64_t i = 0; i < d; ++i) {
      dwacc[i] += dyr[i] * round_to(x.dtype(), xr[i] * s);
      dot += dyr[i] * wf[i] * xr[i];
    }
    const float k = s * s * dot / static_cast<float>(d);
    for (int64_t i = 0; i < d; ++i) dxr[i] = s * (dyr[i] * wf[i] - xr[i] * k);
    store_f32(dxr.data(), d, dx, r * d);
  }
  std::vector<float> cur = to_f32(dw);
  for (int64_t i = 0; i < d; ++i) cur[i] += dwacc[i];
  store_f32(cur.data(), d, dw, 0);
}

void rmsnorm_offset_forward(const Tensor& x, const Tensor& w, float offset, float eps, Tensor& y, Tensor& rstd) {
  const int64_t d = x.size(-1), rows = rstd.numel();
  std::vector<float> wf = to_f32(w);
  for (float& v : wf) v += offset;
  std::vector<float> xr(d), yr(d);
  float* rs = rstd.data_as<float>();
  for (int64_t r = 0; r < rows; ++r) {
    load_f32(x, r * d, d, xr.data());
    float ss = 0.f;
    for (int64_t i = 0; i < d; ++i) ss += xr[i] * xr[i];
    const float s = 1.f / std::sqrt(ss / static_cast<float>(d) + eps);
    rs[r] = s;
    for (int64_t i = 0; i < d; ++i) yr[i] = xr[i] * s * wf[i];
    store_f32(yr.data(), d, y, r * d);
  }
}

void rmsnorm_offset_backward(const Tensor& x, const Tensor& w, float offset, const Tensor& rstd, const Tensor& dy,
                             Tensor& dx, Tensor& dw) {
  const int64_t d = x.size(-1), rows = rstd.numel();
  std::vector<float> wf = to_f32(w);
  for (float& v : wf) v += offset;
  std::vector<float> xr(d), dyr(d), dxr(d), dwacc(d, 0.f);
  const float* rs = rstd.data_as<const float>();
  for (int64_t r = 0; r < rows; ++r) {
    load_f32(x, r * d, d, xr.data());
    load_f32(dy, r * d, d, dyr.data());
    const float s = rs[r];
    float dot = 0.f;  // sum of dh * x with dh = dy * (offset + w)
    for (int64_t i = 0; i < d; ++i) {
      dwacc[i] += dyr[i] * xr[i] * s;
      dot += dyr[i] * wf[i] * xr[i];
    }
    const float k = s * s * dot / static_cast<float>(d);
    for (int64_t i = 0; i < d; ++i) dxr[i] = s * (dyr[i] * wf[i] - xr[i] * k);
    store_f32(dxr.data(), d, dx, r * d);
  }
  std::vector<float> cur = to_f32(dw);
  for (int64_t i = 0; i < d; ++i) cur[i] += dwacc[i];
  store_f32(cur.data(), d, dw, 0);
}

}  // namespace lcx::ops::cpu
