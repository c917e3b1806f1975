#include "lcx/ops.h"
#include "lcx/defaults.h"
#include "lcx/plan.h"

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
  // What run() allocates with gradients: logits and dlogits [T,V] fp32, dlogits cast to the
  // head's dtype for the grad-of-hidden GEMM, an fp32 copy of hidden for the head's gradient,
  // and the CUDA cross entropy's fp32 per-row loss.
  void plan(const PlanInputs& in, MemoryPlan& plan) const override {
    const int64_t T = in.tokens_per_rank, V = in.model.vocab_size, H = in.model.hidden_size;
    const bool cast = in.weight_dtype != DType::f32;
    plan.add("logits", "logits + dlogits [T,V] fp32", PlanCategory::transient, 2 * T * V * 4 + T * 4, plan_phase::loss);
    // logits, dh, and dW unless the head is frozen
    plan.work.gemm_flops += (in.head_frozen ? 4.0 : 6.0) * static_cast<double>(T) * static_cast<double>(V) * static_cast<double>(H);
    plan.work.memory_bytes += 5.0 * static_cast<double>(T) * static_cast<double>(V) * 4;
    if (cast) {
      plan.add("dlogits_cast", "dlogits cast [T,V]", PlanCategory::transient,
               T * V * static_cast<int64_t>(dtype_size(in.weight_dtype)), plan_phase::loss);
      if (!in.head_frozen)
        plan.add("hidden_fp32", "hidden fp32 copy [T,H]", PlanCategory::transient, T * H * 4, plan_phase::loss);
    }
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
      if (grad_head->defined())
        ops::matmul(dlogits, true, hidden.dtype() == DType::f32 ? hidden : hidden.to(DType::f32), false,
                    *grad_head, 1.f, 1.f);                       // [V,T] @ [T,H], accumulated
    }
    return r;
  }
};

}  // namespace

std::unique_ptr<Loss> make_full_logits_loss() { return std::make_unique<FullLogitsLoss>(); }

}  // namespace lcx
