// Cross entropy, CPU reference, one pass per row of logits [T,V] in fp32: m = max, lse = m +
// log(sum exp(x - m)), row loss = lse - x[target]. The gradient reuses the row:
// dlogits = grad_scale * (exp(x - lse) - onehot(target)), zeros for ignored rows (target -100).
// Rows run on a few threads; row losses are summed in row order in double, so the result does not
// depend on the thread count.
#include <cmath>

#include "kernels/cpu/cpu_ops.h"

namespace lcx::ops::cpu {

double cross_entropy_row(const Tensor& logits, int64_t t, int64_t target, double grad_scale, Tensor* dlogits,
                         std::vector<float>& x) {
  const int64_t V = logits.size(1);
  if (target < 0) {  // ignored
    if (dlogits) {
      std::fill(x.begin(), x.end(), 0.f);
      store_f32(x.data(), V, *dlogits, t * V);
    }
    return 0.0;
  }
  load_f32(logits, t * V, V, x.data());
  float m = -INFINITY;
  for (int64_t i = 0; i < V; ++i) m = std::max(m, x[i]);
  double sum = 0.0;
  for (int64_t i = 0; i < V; ++i) sum += std::exp(x[i] - m);
  const double lse = m + std::log(sum);
  const double loss = lse - x[target];
  if (dlogits) {
    for (int64_t i = 0; i < V; ++i) x[i] = static_cast<float>(grad_scale * std::exp(x[i] - lse));
    x[target] -= static_cast<float>(grad_scale);
    store_f32(x.data(), V, *dlogits, t * V);
  }
  return loss;
}

double cross_entropy_forward_backward(const Tensor& logits, const Tensor& targets, double grad_scale,
                                      Tensor* dlogits, int64_t* valid) {
  const int64_t T = logits.size(0), V = logits.size(1);
  const int64_t* tg = targets.data_as<const int64_t>();
  std::vector<double> row_loss(static_cast<size_t>(T), 0.0);
  parallel_tasks(T, [&](int64_t t) {
    std::vector<float> x(static_cast<size_t>(V));
    row_loss[t] = cross_entropy_row(logits, t, tg[t], grad_scale, dlogits, x);
  });
  double loss = 0.0;
  int64_t n = 0;
  for (int64_t t = 0; t < T; ++t) {
    loss += row_loss[t];
    n += tg[t] >= 0;
  }
  if (valid) *valid = n;
  return loss;
}

}  // namespace lcx::ops::cpu
