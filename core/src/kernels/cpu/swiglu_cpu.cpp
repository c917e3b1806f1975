// SwiGLU, CPU reference: out = silu(gate) * up with silu(g) = g * sigmoid(g), fp32 math and one
// rounding on store. Backward with sg = sigmoid(g): dup = dout * silu(g),
// dgate = dout * up * sg * (1 + g * (1 - sg)).
#include <algorithm>
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

// The clamped SwiGLU of GPT-OSS, gate and up interleaved in gate_up's rows. With g, u the clamped
// values and s = sigmoid(alpha g): out = (u + 1) g s; dup = dout g s where |up| <= limit, else 0;
// dgate = dout (u + 1) s (1 + alpha g (1 - s)) where gate <= limit, else 0.
void swiglu_clamped_forward(const Tensor& gate_up, float alpha, float limit, Tensor& out) {
  const int64_t I = out.size(1);
  std::vector<float> gu(static_cast<size_t>(2 * I)), o(static_cast<size_t>(I));
  for (int64_t r = 0; r < out.size(0); ++r) {
    load_f32(gate_up, r * 2 * I, 2 * I, gu.data());
    for (int64_t i = 0; i < I; ++i) {
      const float g = std::min(gu[2 * i], limit), u = std::clamp(gu[2 * i + 1], -limit, limit);
      o[i] = (u + 1.f) * (g * sigmoid(alpha * g));
    }
    store_f32(o.data(), I, out, r * I);
  }
}

void swiglu_clamped_backward(const Tensor& gate_up, const Tensor& dout, float alpha, float limit, Tensor& dgate_up) {
  const int64_t I = dout.size(1);
  std::vector<float> gu(static_cast<size_t>(2 * I)), d(static_cast<size_t>(I));
  for (int64_t r = 0; r < dout.size(0); ++r) {
    load_f32(gate_up, r * 2 * I, 2 * I, gu.data());
    load_f32(dout, r * I, I, d.data());
    for (int64_t i = 0; i < I; ++i) {
      const float gate = gu[2 * i], up = gu[2 * i + 1];
      const float g = std::min(gate, limit), u = std::clamp(up, -limit, limit);
      const float s = sigmoid(alpha * g);
      gu[2 * i] = gate <= limit ? d[i] * (u + 1.f) * s * (1.f + alpha * g * (1.f - s)) : 0.f;
      gu[2 * i + 1] = up >= -limit && up <= limit ? d[i] * g * s : 0.f;
    }
    store_f32(gu.data(), 2 * I, dgate_up, r * 2 * I);
  }
}

}  // namespace lcx::ops::cpu
