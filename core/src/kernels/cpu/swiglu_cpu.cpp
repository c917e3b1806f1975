// SwiGLU, CPU reference: out = silu(gate) * up with silu(g) = g * sigmoid(g), fp32 math and one
// rounding on store. Backward with sg = sigmoid(g): dup = dout * silu(g),
// dgate = dout * up * sg * (1 + g * (1 - sg)).
#include <cmath>

#include "kernels/cpu/cpu_ops.h"

namespace lcx::ops::cpu {
namespace {
constexpr int64_t kChunk = 4096;  // elements widened per pass, so scratch stays small
inline float sigmoid(float g) { return 1.f / (1.f + std::exp(-g)); }
}  // namespace

void swiglu_forward(const Tensor& gate, const Tensor& up, Tensor& out) {
  std::vector<float> g(kChunk), u(kChunk);
  for (int64_t o = 0; o < gate.numel(); o += kChunk) {
    const int64_t n = std::min(kChunk, gate.numel() - o);
    load_f32(gate, o, n, g.data());
    load_f32(up, o, n, u.data());
    for (int64_t i = 0; i < n; ++i) g[i] = g[i] * sigmoid(g[i]) * u[i];
    store_f32(g.data(), n, out, o);
  }
}

void swiglu_backward(const Tensor& gate, const Tensor& up, const Tensor& dout, Tensor& dgate, Tensor& dup) {
  std::vector<float> g(kChunk), u(kChunk), d(kChunk);
  for (int64_t o = 0; o < gate.numel(); o += kChunk) {
    const int64_t n = std::min(kChunk, gate.numel() - o);
    load_f32(gate, o, n, g.data());
    load_f32(up, o, n, u.data());
    load_f32(dout, o, n, d.data());
    for (int64_t i = 0; i < n; ++i) {
      const float sg = sigmoid(g[i]);
      const float dg = d[i] * u[i] * sg * (1.f + g[i] * (1.f - sg));
      u[i] = d[i] * g[i] * sg;  // dup, reusing u's scratch
      g[i] = dg;
    }
    store_f32(g.data(), n, dgate, o);
    store_f32(u.data(), n, dup, o);
  }
}

}  // namespace lcx::ops::cpu
