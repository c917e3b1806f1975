#include "lcx/ops.h"
#include "lcx/defaults.h"

namespace lcx {
namespace {

class FullLogitsLoss final : public Loss {
 public:
  LossResult forward_backward(const Tensor& hidden, const Tensor& head, const Tensor& targets,
                              double grad_scale, Tensor& grad_hidden, Tensor& grad_head) override {
    return run(hidden, head, targets, grad_scale, &grad_hidden, &grad_head);
  }
  LossResult forward(const Tensor& hidden, const Tensor& head, const Tensor& targets) override {
    return run(hidden, head, targets, 0, nullptr, nullptr);
  }

 private:
  static LossResult run(const Tensor& hidden, const Tensor& head, const Tensor& targets, double grad_scale,
                        Tensor* grad_hidden, Tensor* grad_head) {
    const int64_t T = hidden.size(0), V = head.size(0);
    Tensor logits = Tensor::empty({T, V}, DType::f32, hidden.device());
    ops::matmul(hidden, false, head, true, logits);
    Tensor dlogits;
    if (grad_hidden) dlogits = Tensor::empty({T, V}, DType::f32, hidden.device());
    LossResult r;
    r.loss_sum = ops::cross_entropy_forward_backward(logits, targets, grad_scale,
                                                     grad_hidden ? &dlogits : nullptr, &r.valid);
    if (grad_hidden) {
      Tensor dl = dlogits.dtype() == head.dtype() ? dlogits : Tensor::empty({T, V}, head.dtype(), head.device());
      if (dl.data() != dlogits.data()) ops::cast(dlogits, dl);
      ops::matmul(dl, false, head, false, *grad_hidden);          // [T,V] @ [V,H]
      ops::matmul(dlogits, true, hidden.dtype() == DType::f32 ? hidden : hidden.to(DType::f32), false,
                  *grad_head, 1.f, 1.f);                         // [V,T] @ [T,H], accumulated
    }
    return r;
  }
};

}  // namespace

std::unique_ptr<Loss> make_full_logits_loss() { return std::make_unique<FullLogitsLoss>(); }

}  // namespace lcx
