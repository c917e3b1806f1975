// Mixture-of-experts routing on the CPU, the reference of kernels/cuda/moe.cu: the router's
// softmax and top-k, the stable sort of (token, choice) slots by expert, the gather of each slot's
// row and the weighted combine back to tokens. Plain loops; the math is fp32 as on the GPU.
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/cpu/cpu_ops.h"

namespace lcx::ops::cpu {

void moe_route(const Tensor& logits, int64_t k, bool norm_topk, Tensor& weights, Tensor& experts, Tensor* probs) {
  const int64_t T = logits.size(0), E = logits.size(1);
  std::vector<float> p(static_cast<size_t>(E));
  std::vector<char> taken(static_cast<size_t>(E));
  float* w = weights.data_as<float>();
  int32_t* ex = experts.data_as<int32_t>();
  for (int64_t t = 0; t < T; ++t) {
    load_f32(logits, t * E, E, p.data());
    float m = -INFINITY;
    for (float v : p) m = std::max(m, v);
    float sum = 0;
    for (float& v : p) sum += (v = expf(v - m));
    for (float& v : p) v /= sum;
    if (probs) std::copy(p.begin(), p.end(), probs->data_as<float>() + t * E);
    std::fill(taken.begin(), taken.end(), 0);
    float picked = 0;
    for (int64_t j = 0; j < k; ++j) {
      int64_t best = -1;
      for (int64_t e = 0; e < E; ++e)
        if (!taken[static_cast<size_t>(e)] && (best < 0 || p[static_cast<size_t>(e)] > p[static_cast<size_t>(best)])) best = e;
      taken[static_cast<size_t>(best)] = 1;
      w[t * k + j] = p[static_cast<size_t>(best)];
      ex[t * k + j] = static_cast<int32_t>(best);
      picked += p[static_cast<size_t>(best)];
    }
    if (norm_topk)
      for (int64_t j = 0; j < k; ++j) w[t * k + j] /= picked;
  }
}

void moe_permute(const Tensor& experts, int64_t num_experts, Tensor& order, Tensor& position, Tensor& offsets) {
  const int64_t n = experts.numel();
  const int32_t* ex = experts.data_as<const int32_t>();
  int64_t* off = offsets.data_as<int64_t>();
  std::fill(off, off + num_experts + 1, 0);
  for (int64_t s = 0; s < n; ++s) {
    LCX_CHECK(ex[s] >= 0 && ex[s] < num_experts, "moe_permute: slot ", s, " names expert ", ex[s], " of ", num_experts);
    ++off[ex[s] + 1];
  }
  for (int64_t e = 0; e < num_experts; ++e) off[e + 1] += off[e];
  std::vector<int64_t> cursor(off, off + num_experts);
  int32_t* ord = order.data_as<int32_t>();
  int32_t* pos = position.data_as<int32_t>();
  for (int64_t s = 0; s < n; ++s) {
    const int64_t at = cursor[static_cast<size_t>(ex[s])]++;
    ord[at] = static_cast<int32_t>(s);
    pos[s] = static_cast<int32_t>(at);
  }
}

void gather_rows(const Tensor& x, const Tensor& rows, int64_t divide, Tensor& out) {
  const int64_t N = rows.numel(), T = x.size(0);
  const size_t row_bytes = static_cast<size_t>(x.size(1)) * dtype_size(x.dtype());
  const int32_t* r = rows.data_as<const int32_t>();
  for (int64_t i = 0; i < N; ++i) {
    const int64_t src = r[i] / divide;
    LCX_CHECK(src >= 0 && src < T, "gather_rows: row ", i, " reads row ", src, " of ", T);
    std::memcpy(static_cast<char*>(out.data()) + static_cast<size_t>(i) * row_bytes,
                static_cast<const char*>(x.data()) + static_cast<size_t>(src) * row_bytes, row_bytes);
  }
}

void moe_combine(const Tensor& y, const Tensor& position, const Tensor& weights, Tensor& out) {
  const int64_t T = weights.size(0), k = weights.size(1), H = y.size(1);
  const int32_t* pos = position.data_as<const int32_t>();
  const float* w = weights.data_as<const float>();
  std::vector<float> acc(static_cast<size_t>(H)), row(static_cast<size_t>(H));
  for (int64_t t = 0; t < T; ++t) {
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t j = 0; j < k; ++j) {
      load_f32(y, static_cast<int64_t>(pos[t * k + j]) * H, H, row.data());
      const float wj = w[t * k + j];
      for (int64_t h = 0; h < H; ++h) acc[static_cast<size_t>(h)] += wj * row[static_cast<size_t>(h)];
    }
    store_f32(acc.data(), H, out, t * H);
  }
}

void moe_combine_backward(const Tensor& dout, const Tensor& y, const Tensor& order, const Tensor& position,
                          const Tensor& weights, Tensor& dy, Tensor& dweights) {
  const int64_t T = weights.size(0), k = weights.size(1), H = dout.size(1);
  const int32_t* ord = order.data_as<const int32_t>();
  const int32_t* pos = position.data_as<const int32_t>();
  const float* w = weights.data_as<const float>();
  std::vector<float> d(static_cast<size_t>(H)), row(static_cast<size_t>(H));
  for (int64_t i = 0; i < T * k; ++i) {
    const int64_t s = ord[i];
    load_f32(dout, (s / k) * H, H, d.data());
    for (float& v : d) v *= w[s];
    store_f32(d.data(), H, dy, i * H);
  }
  float* dw = dweights.data_as<float>();
  for (int64_t s = 0; s < T * k; ++s) {
    load_f32(dout, (s / k) * H, H, d.data());
    load_f32(y, static_cast<int64_t>(pos[s]) * H, H, row.data());
    float acc = 0;
    for (int64_t h = 0; h < H; ++h) acc += d[static_cast<size_t>(h)] * row[static_cast<size_t>(h)];
    dw[s] = acc;
  }
}

void moe_route_backward(const Tensor& probs, const Tensor& experts, const Tensor& weights, const Tensor& dweights,
                        bool norm_topk, const Tensor* aux_grad, Tensor& dlogits) {
  const int64_t T = probs.size(0), E = probs.size(1), k = experts.size(1);
  std::vector<float> g(static_cast<size_t>(E));
  for (int64_t t = 0; t < T; ++t) {
    const float* p = probs.data_as<const float>() + t * E;
    const int32_t* ex = experts.data_as<const int32_t>() + t * k;
    const float* w = weights.data_as<const float>() + t * k;
    const float* dw = dweights.data_as<const float>() + t * k;
    for (int64_t e = 0; e < E; ++e) g[static_cast<size_t>(e)] = aux_grad ? aux_grad->data_as<const float>()[e] : 0.f;
    // Through the renormalization w_j = r_j / sum(r): dr_j = (dw_j - sum_i dw_i w_i) / sum(r).
    float dot = 0, picked = 0;
    for (int64_t j = 0; j < k; ++j) dot += dw[j] * w[j], picked += p[ex[j]];
    for (int64_t j = 0; j < k; ++j) g[static_cast<size_t>(ex[j])] += norm_topk ? (dw[j] - dot) / picked : dw[j];
    // Through the softmax: dlogit_e = p_e (g_e - sum_f p_f g_f).
    float pg = 0;
    for (int64_t e = 0; e < E; ++e) pg += p[e] * g[static_cast<size_t>(e)];
    for (int64_t e = 0; e < E; ++e) g[static_cast<size_t>(e)] = p[e] * (g[static_cast<size_t>(e)] - pg);
    store_f32(g.data(), E, dlogits, t * E);
  }
}

}  // namespace lcx::ops::cpu
