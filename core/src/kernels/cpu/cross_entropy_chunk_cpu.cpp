// One chunk of a chunked loss, CPU reference, one pass per row of fp32 logits [n,V]: m = max,
// lse = m + log(sum exp(x - m)), row loss = lse - x[target] into row_loss; the gradient
// grad_scale * (exp(x - lse) - onehot(target)) is built in fp32 scratch from the row, then stored
// in dlogits' dtype, so dlogits may be the logits themselves. The arithmetic is that of
// cross_entropy_forward_backward (double sum, double lse), so both give the same fp32 gradient.
#include <cmath>

#include "kernels/cpu/cpu_ops.h"

namespace lcx::ops::cpu {

void cross_entropy_chunk(const Tensor& logits, const Tensor& targets, float grad_scale, Tensor& row_loss,
                         Tensor* dlogits) {
  const int64_t n = logits.size(0), V = logits.size(1);
  const int64_t* tg = targets.data_as<const int64_t>();
  float* loss = row_loss.data_as<float>();
  parallel_tasks(n, [&](int64_t t) {
    std::vector<float> x(static_cast<size_t>(V));
    if (tg[t] < 0) {  // ignored
      loss[t] = 0.f;
      if (dlogits) store_f32(x.data(), V, *dlogits, t * V);  // x is zero-initialized
      return;
    }
    load_f32(logits, t * V, V, x.data());
    float m = -INFINITY;
    for (int64_t i = 0; i < V; ++i) m = std::max(m, x[i]);
    double sum = 0.0;
    for (int64_t i = 0; i < V; ++i) sum += std::exp(x[i] - m);
    const double lse = m + std::log(sum);
    loss[t] = static_cast<float>(lse - x[tg[t]]);
    if (!dlogits) return;
    for (int64_t i = 0; i < V; ++i) x[i] = static_cast<float>(grad_scale * std::exp(x[i] - lse));
    x[tg[t]] -= grad_scale;
    store_f32(x.data(), V, *dlogits, t * V);
  });
}

}  // namespace lcx::ops::cpu
