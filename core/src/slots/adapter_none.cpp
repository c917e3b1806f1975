// Adapter "none" (full fine-tuning: nothing adapted, nothing frozen) and the low-rank update's
// forward and backward that a model and an MLP strategy run for an adapted projection.
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

const char* linear_name(Linear m) {
  static const char* names[kLinearCount] = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"};
  return names[static_cast<int>(m)];
}

void lowrank_forward(const Tensor& x, const LowRank& lr, Tensor& y, float beta) {
  Tensor u = Tensor::empty({x.size(0), lr.rank()}, x.dtype(), x.device());
  ops::matmul(x, false, lr.a->value, true, u);                   // [T,in] @ [r,in]^T
  ops::matmul(u, false, lr.b->value, true, y, lr.scale, beta);  // [T,r] @ [out,r]^T
}

void lowrank_backward(const Tensor& x, const Tensor& dy, const LowRank& lr, Tensor& dx, float dx_beta) {
  const int64_t T = x.size(0), r = lr.rank();
  Tensor g = Tensor::empty({T, r}, x.dtype(), x.device());
  ops::matmul(dy, false, lr.b->value, false, g, lr.scale);  // scale * dy @ B: [T,out] @ [out,r]
  ops::matmul(g, false, lr.a->value, false, dx, 1.f, dx_beta);  // dx (+)= g @ A
  if (!lr.a->frozen) ops::matmul(g, true, x, false, lr.a->grad, 1.f, 1.f);  // dA += g^T @ x
  if (lr.b->frozen) return;
  Tensor u = Tensor::empty({T, r}, x.dtype(), x.device());
  ops::matmul(x, false, lr.a->value, true, u);
  ops::matmul(dy, true, u, false, lr.b->grad, lr.scale, 1.f);  // dB += scale * dy^T @ u
}

}  // namespace lcx
