// Adapter "none" (full fine-tuning: nothing adapted, nothing frozen) and the low-rank update's
// forward and backward that a model and an MLP strategy run for an adapted projection.
#include "kernels/dropout_mask.h"
#include "lcx/defaults.h"
#include "lcx/ops.h"
#include "lcx/slots/adapter.h"

namespace lcx {
namespace {

class NoAdapter final : public Adapter {
 public:
  void attach(Model& /*model*/, const AdapterContext& /*ctx*/) override {}
};

}  // namespace

std::unique_ptr<Adapter> make_no_adapter() { return std::make_unique<NoAdapter>(); }

uint64_t LowRank::dropout_key() const {
  return ops::dropout_mix(*dropout_pass ^ ops::dropout_mix(dropout_stream + 0x9e3779b97f4a7c15ull));
}

namespace {

// x itself, or where the factor drops, its dropped copy (in `buffer`'s storage when given).
Tensor adapter_input(const Tensor& x, const LowRank& lr, const Tensor& rows, Tensor buffer = {}) {
  if (!lr.dropping()) return x;
  Tensor xd = buffer.defined() ? buffer : Tensor::empty(x.shape(), x.dtype(), x.device());
  ops::dropout(x, lr.dropout, lr.dropout_key(), rows, 0, xd);
  return xd;
}

// dx = dx_beta * dx + g A through the factor's mask: g A in `buffer` (returned for reuse), then
// dropped onto dx.
Tensor input_gradient(const Tensor& g, bool g_transposed, const LowRank& lr, Tensor& dx, float dx_beta, const Tensor& rows) {
  if (!lr.dropping()) {
    ops::matmul(g, g_transposed, lr.a->value, false, dx, 1.f, dx_beta);
    return {};
  }
  Tensor buffer = Tensor::empty(dx.shape(), dx.dtype(), dx.device());
  ops::matmul(g, g_transposed, lr.a->value, false, buffer);
  ops::dropout(buffer, lr.dropout, lr.dropout_key(), rows, 0, dx, dx_beta);
  return buffer;
}

}  // namespace

void lowrank_forward(const Tensor& x, const LowRank& lr, Tensor& y, float beta, const Tensor& rows) {
  const Tensor xa = adapter_input(x, lr, rows);
  Tensor u = Tensor::empty({x.size(0), lr.rank()}, x.dtype(), x.device());
  ops::matmul(xa, false, lr.a->value, true, u);                  // [T,in] @ [r,in]^T
  ops::matmul(u, false, lr.b->value, true, y, lr.scale, beta);  // [T,r] @ [out,r]^T
}

void lowrank_backward(const Tensor& x, const Tensor& dy, const LowRank& lr, Tensor& dx, float dx_beta, const Tensor& rows) {
  const int64_t T = x.size(0), r = lr.rank();
  Tensor g = Tensor::empty({T, r}, x.dtype(), x.device());
  ops::matmul(dy, false, lr.b->value, false, g, lr.scale);  // scale * dy @ B: [T,out] @ [out,r]
  Tensor buffer = input_gradient(g, false, lr, dx, dx_beta, rows);  // dx (+)= g @ A
  const Tensor xa = adapter_input(x, lr, rows, buffer);
  if (!lr.a->frozen) ops::matmul(g, true, xa, false, lr.a->grad, 1.f, 1.f);  // dA += g^T @ x
  if (lr.b->frozen) return;
  Tensor u = Tensor::empty({T, r}, x.dtype(), x.device());
  ops::matmul(xa, false, lr.a->value, true, u);
  ops::matmul(dy, true, u, false, lr.b->grad, lr.scale, 1.f);  // dB += scale * dy^T @ u
}

bool lowrank_stacked(const std::vector<const LowRank*>& lrs) {
  if (lrs.size() < 2) return false;
  for (const LowRank* lr : lrs)
    if (lr->dropping()) return false;
  const Tensor& sa = lrs[0]->stacked_a;
  const Tensor& sg = lrs[0]->stacked_grad;
  const bool trained = !lrs[0]->a->frozen;
  if (!sa.defined() || (trained && !sg.defined())) return false;
  int64_t row = 0;
  for (const LowRank* lr : lrs) {
    const int64_t r = lr->rank();
    if (lr->stacked_a.data() != sa.data() || lr->stacked_row != row || lr->a->frozen == trained) return false;
    if (lr->a->value.data() != sa.rows(row, row + r).data() || lr->a->value.dtype() != sa.dtype()) return false;
    if (trained && (lr->stacked_grad.data() != sg.data() || lr->a->grad.data() != sg.rows(row, row + r).data() ||
                    lr->a->grad.dtype() != sg.dtype()))
      return false;
    row += r;
  }
  return row == sa.size(0);
}

Tensor lowrank_inputs(const Tensor& x, const std::vector<const LowRank*>& lrs, const Tensor& rows) {
  int64_t ranks = 0;
  for (const LowRank* lr : lrs) ranks += lr->rank();
  Tensor ut = Tensor::empty({ranks, x.size(0)}, x.dtype(), x.device());
  if (lowrank_stacked(lrs)) {
    ops::matmul(lrs[0]->stacked_a, false, x, true, ut);  // [sum r, in] @ [T, in]^T
    return ut;
  }
  Tensor buffer;  // one dropped input at a time
  for (size_t i = 0; i < lrs.size(); ++i) {
    Tensor block = lowrank_block(ut, lrs, i);
    if (lrs[i]->dropping() && !buffer.defined()) buffer = Tensor::empty(x.shape(), x.dtype(), x.device());
    ops::matmul(lrs[i]->a->value, false, adapter_input(x, *lrs[i], rows, buffer), true, block);
  }
  return ut;
}

Tensor lowrank_block(const Tensor& stacked, const std::vector<const LowRank*>& lrs, size_t i) {
  int64_t row = 0;
  for (size_t j = 0; j < i; ++j) row += lrs[j]->rank();
  return stacked.rows(row, row + lrs[i]->rank());
}

void lowrank_update(const Tensor& ut, const LowRank& lr, const Tensor& b, Tensor& y, float beta) {
  ops::matmul(ut, true, b, true, y, lr.scale, beta);  // [r,T]^T @ [out,r]^T
}

void lowrank_input_backward(const Tensor& x, const Tensor& gt, const std::vector<const LowRank*>& lrs, Tensor& dx,
                            float dx_beta, const Tensor& rows) {
  if (lowrank_stacked(lrs)) {
    ops::matmul(gt, true, lrs[0]->stacked_a, false, dx, 1.f, dx_beta);  // [sum r,T]^T @ [sum r,in]
    if (!lrs[0]->a->frozen) {
      Tensor grad = lrs[0]->stacked_grad;  // a view: the factors' gradients are its rows
      ops::matmul(gt, false, x, false, grad, 1.f, 1.f);
    }
    return;
  }
  for (size_t i = 0; i < lrs.size(); ++i) {
    const Tensor g = lowrank_block(gt, lrs, i);
    Tensor buffer = input_gradient(g, true, *lrs[i], dx, i == 0 ? dx_beta : 1.f, rows);
    if (!lrs[i]->a->frozen) ops::matmul(g, false, adapter_input(x, *lrs[i], rows, buffer), false, lrs[i]->a->grad, 1.f, 1.f);
  }
}

}  // namespace lcx
