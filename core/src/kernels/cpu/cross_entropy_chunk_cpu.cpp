// One chunk of a chunked loss, CPU reference, one pass per row of fp32 logits [n,V]: m = max,
// lse = m + log(sum exp(x - m)), row loss = lse - x[target] into row_loss; the gradient
// grad_scale * (exp(x - lse) - onehot(target)) is built in fp32 scratch from the row, then stored
// in dlogits' dtype, so dlogits may be the logits themselves. Each row is cross_entropy_row, as in
// cross_entropy_forward_backward, so both give the same fp32 gradient.
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
    loss[t] = static_cast<float>(cross_entropy_row(logits, t, tg[t], grad_scale, dlogits, x));
  });
}

}  // namespace lcx::ops::cpu
