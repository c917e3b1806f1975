// Attention sinks, CPU reference (lcx/ops.h attention_sinks_forward / _backward): the sink's logit
// joins each row's softmax denominator after the attention, as one more log-sum-exp term, so the
// attention kernels never see it. Per head: lse' = logaddexp(lse, s), out' = out * exp(lse - lse');
// the backward's dsink = -sum over rows of exp(s - lse') * dot(dout, out'), the sink column's
// probability times its ds = p * (0 - D) with D = dot(dout, out'). A row that saw no key (lse
// -inf) gets lse' = s and keeps its zero output.
#include <cmath>

#include "kernels/cpu/cpu_ops.h"

namespace lcx::ops::cpu {

void attention_sinks_forward(Tensor& out, Tensor& lse, const Tensor& sinks, int64_t head0) {
  const int64_t T = out.size(0), H = out.size(1), d = out.size(2);
  const std::vector<float> s = to_f32(sinks);
  float* l = lse.data_as<float>();
  std::vector<float> row(static_cast<size_t>(d));
  for (int64_t h = 0; h < H; ++h) {
    const float sink = s[static_cast<size_t>(head0 + h)];
    for (int64_t t = 0; t < T; ++t) {
      const float old = l[h * T + t];
      const float m = std::max(old, sink);
      const float merged = m + std::log(std::exp(old - m) + std::exp(sink - m));
      l[h * T + t] = merged;
      const float f = std::exp(old - merged);
      const int64_t at = (t * H + h) * d;
      load_f32(out, at, d, row.data());
      for (auto& x : row) x *= f;
      store_f32(row.data(), d, out, at);
    }
  }
}

void attention_sinks_backward(const Tensor& out, const Tensor& lse, const Tensor& dout, const Tensor& sinks,
                              int64_t head0, Tensor& dsinks) {
  const int64_t T = out.size(0), H = out.size(1), d = out.size(2);
  const std::vector<float> s = to_f32(sinks);
  const float* l = lse.data_as<const float>();
  float* g = dsinks.data_as<float>();
  std::vector<float> o(static_cast<size_t>(d)), go(static_cast<size_t>(d));
  for (int64_t h = 0; h < H; ++h) {
    const float sink = s[static_cast<size_t>(head0 + h)];
    float sum = 0.f;
    for (int64_t t = 0; t < T; ++t) {
      const int64_t at = (t * H + h) * d;
      load_f32(out, at, d, o.data());
      load_f32(dout, at, d, go.data());
      float D = 0.f;
      for (int64_t c = 0; c < d; ++c) D += o[static_cast<size_t>(c)] * go[static_cast<size_t>(c)];
      sum += std::exp(sink - l[h * T + t]) * D;
    }
    g[head0 + h] -= sum;
  }
}

}  // namespace lcx::ops::cpu
