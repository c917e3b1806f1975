// GeGLU with the tanh GELU, CPU reference: out = gelu_tanh(gate) * up, fp32 math and one rounding
// on store, as torch's gelu(approximate="tanh") (transformers' gelu_pytorch_tanh):
//   gelu_tanh(g) = 0.5 g (1 + t),  t = tanh(b (g + k g^3)),  b = sqrt(2/pi), k = 0.044715,
//   gelu_tanh'(g) = 0.5 (1 + t) + 0.5 g (1 - t^2) b (1 + 3 k g^2).
// Backward: dup = dout * gelu_tanh(g), dgate = dout * up * gelu_tanh'(g).
#include <cmath>

#include "kernels/cpu/cpu_ops.h"

namespace lcx::ops::cpu {
namespace {
constexpr int64_t kChunk = 4096;  // elements widened per pass, so scratch stays small
constexpr float kBeta = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kKappa = 0.044715f;
}  // namespace

void geglu_tanh_forward(const Tensor& gate, const Tensor& up, Tensor& out) {
  std::vector<float> g(kChunk), u(kChunk);
  for (int64_t o = 0; o < gate.numel(); o += kChunk) {
    const int64_t n = std::min(kChunk, gate.numel() - o);
    load_f32(gate, o, n, g.data());
    load_f32(up, o, n, u.data());
    for (int64_t i = 0; i < n; ++i) {
      const float x = g[i];
      const float t = std::tanh(kBeta * (x + kKappa * x * x * x));
      g[i] = 0.5f * x * (1.f + t) * u[i];
    }
    store_f32(g.data(), n, out, o);
  }
}

void geglu_tanh_backward(const Tensor& gate, const Tensor& up, const Tensor& dout, Tensor& dgate, Tensor& dup) {
  std::vector<float> g(kChunk), u(kChunk), d(kChunk);
  for (int64_t o = 0; o < gate.numel(); o += kChunk) {
    const int64_t n = std::min(kChunk, gate.numel() - o);
    load_f32(gate, o, n, g.data());
    load_f32(up, o, n, u.data());
    load_f32(dout, o, n, d.data());
    for (int64_t i = 0; i < n; ++i) {
      const float x = g[i];
      const float t = std::tanh(kBeta * (x + kKappa * x * x * x));
      const float gelu = 0.5f * x * (1.f + t);
      const float slope = 0.5f * (1.f + t) + 0.5f * x * (1.f - t * t) * kBeta * (1.f + 3.f * kKappa * x * x);
      g[i] = d[i] * u[i] * slope;
      u[i] = d[i] * gelu;  // dup, reusing u's scratch
    }
    store_f32(g.data(), n, dgate, o);
    store_f32(u.data(), n, dup, o);
  }
}

}  // namespace lcx::ops::cpu
