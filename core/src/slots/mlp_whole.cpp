// MlpStrategy "whole": the MLP over every row at once. gate, up and act = silu(gate) * up (or
// gelu_tanh(gate) * up, MlpWeights::activation) are [T,I] (gated_forward writes act in one pass,
// so three tensors where PyTorch holds four); the backward recomputes them and adds dact, dgate,
// dup. An adapted projection adds its low-rank update (lcx/slots/adapter.h); a frozen weight (its
// grad undefined) gets no gradient GEMM.
#include <utility>
#include <vector>

#include "lcx/defaults.h"
#include "lcx/ops.h"
#include "lcx/plan.h"
#include "lcx/slots/adapter.h"

namespace lcx {
namespace {

class WholeMlp final : public MlpStrategy {
 public:
  void forward(const Tensor& x, const MlpWeights& w, Tensor& out) override {
    const int64_t T = x.size(0), I = w.gate.size(0);
    Tensor gate = Tensor::empty({T, I}, x.dtype(), x.device()), up = Tensor::empty({T, I}, x.dtype(), x.device());
    Tensor ut;
    project_in(x, w, gate, up, ut);
    ut = Tensor();
    Tensor act = Tensor::empty({T, I}, x.dtype(), x.device());
    ops::gated_forward(w.activation, gate, up, act);
    project(act, w.down, w.down_lr, out, w.rows);
  }

  void backward(const Tensor& x, const MlpWeights& w, const Tensor& dout, Tensor& dx, MlpWeights& grad) override {
    const int64_t T = x.size(0), I = w.gate.size(0);
    const DType dt = x.dtype();
    const Device dev = x.device();
    Tensor gate = Tensor::empty({T, I}, dt, dev), up = Tensor::empty({T, I}, dt, dev);
    Tensor ut;  // gate's and up's adapter products, kept from the recompute for dB
    project_in(x, w, gate, up, ut);
    Tensor act = Tensor::empty({T, I}, dt, dev);
    ops::gated_forward(w.activation, gate, up, act);
    Tensor dact = Tensor::empty({T, I}, dt, dev);
    if (grad.down.defined()) ops::matmul(dout, true, act, false, grad.down, 1.f, 1.f);
    // An adapter's input gradient first, the projection's GEMM accumulating onto it.
    if (w.down_lr) lowrank_backward(act, dout, *w.down_lr, dact, 0.f, w.rows);
    ops::matmul(dout, false, w.down, false, dact, 1.f, w.down_lr ? 1.f : 0.f);
    Tensor dgate = Tensor::empty({T, I}, dt, dev), dup = Tensor::empty({T, I}, dt, dev);
    ops::gated_backward(w.activation, gate, up, dact, dgate, dup);
    if (grad.gate.defined()) ops::matmul(dgate, true, x, false, grad.gate, 1.f, 1.f);
    if (grad.up.defined()) ops::matmul(dup, true, x, false, grad.up, 1.f, 1.f);
    // gate's and up's adapters: g^T = scale * B^T dy^T of each in one [2r, T] tensor, then dx and
    // the A's gradients from it (one GEMM each where the A's are stacked), dx first.
    const std::vector<const LowRank*> lrs = in_factors(w);
    float beta = 0.f;
    if (!lrs.empty()) {
      Tensor gt = Tensor::empty(ut.shape(), dt, dev);
      size_t i = 0;
      for (const auto& [lr, dy] : {std::pair{w.gate_lr, &dgate}, std::pair{w.up_lr, &dup}}) {
        if (!lr) continue;
        Tensor g = lowrank_block(gt, lrs, i);
        ops::matmul(lr->b->value, true, *dy, true, g, lr->scale);  // [out,r]^T @ [T,out]^T
        if (!lr->b->frozen) ops::matmul(*dy, true, lowrank_block(ut, lrs, i), true, lr->b->grad, lr->scale, 1.f);
        ++i;
      }
      ut = Tensor();
      lowrank_input_backward(x, gt, lrs, dx, 0.f, w.rows);
      beta = 1.f;
    }
    ops::matmul(dgate, false, w.gate, false, dx, 1.f, beta);
    ops::matmul(dup, false, w.up, false, dx, 1.f, 1.f);
  }

  // out = x @ w^T, with the adapter's update written first and the GEMM accumulating onto it.
  static void project(const Tensor& x, const Tensor& w, const LowRank* lr, Tensor& out, const Tensor& rows) {
    if (lr) lowrank_forward(x, *lr, out, 0.f, rows);
    ops::matmul(x, false, w, true, out, 1.f, lr ? 1.f : 0.f);
  }
  // gate's and up's factors, those adapted, in that order (they share the input).
  static std::vector<const LowRank*> in_factors(const MlpWeights& w) {
    std::vector<const LowRank*> lrs;
    if (w.gate_lr) lrs.push_back(w.gate_lr);
    if (w.up_lr) lrs.push_back(w.up_lr);
    return lrs;
  }
  // gate = x @ Wg^T and up = x @ Wu^T, each with its adapter's update written first from u^T
  // (both adapters' products in one GEMM where their A's are stacked), returned in ut.
  static void project_in(const Tensor& x, const MlpWeights& w, Tensor& gate, Tensor& up, Tensor& ut) {
    const std::vector<const LowRank*> lrs = in_factors(w);
    if (!lrs.empty()) ut = lowrank_inputs(x, lrs, w.rows);
    size_t i = 0;
    if (w.gate_lr) lowrank_update(lowrank_block(ut, lrs, i++), *w.gate_lr, w.gate_lr->b->value, gate, 0.f);
    ops::matmul(x, false, w.gate, true, gate, 1.f, w.gate_lr ? 1.f : 0.f);
    if (w.up_lr) lowrank_update(lowrank_block(ut, lrs, i++), *w.up_lr, w.up_lr->b->value, up, 0.f);
    ops::matmul(x, false, w.up, true, up, 1.f, w.up_lr ? 1.f : 0.f);
  }

  void plan(const PlanInputs& in, MemoryPlan& plan) const override {
    // A model whose every layer runs an MLP of its own plans it itself.
    if (in.model.mlp_slot_layers == 0) return;
    const int64_t TI = in.tokens_per_rank * in.model.intermediate_size * static_cast<int64_t>(dtype_size(in.weight_dtype));
    plan.add("mlp_forward", "layer forward: MLP gate, up, act [T,I]", PlanCategory::transient, 3 * TI,
             plan_phase::forward);
    plan.add("mlp_recompute", "recompute: MLP gate, up, act [T,I]", PlanCategory::transient, 3 * TI,
             plan_phase::mlp_backward);
    plan.add("mlp_backward", "backward: MLP dact, dgate, dup [T,I]", PlanCategory::transient, 3 * TI,
             plan_phase::mlp_backward);
    // Beyond the arithmetic (the model's): each layer's backward reads and writes the three weights'
    // gradients once, as its GEMMs accumulate into them (an MLP run in tiles does it per tile).
    if (in.base_frozen) return;
    plan.work.memory_bytes += static_cast<double>(in.model.num_layers) * 6.0 *
                              static_cast<double>(in.model.intermediate_size * in.model.hidden_size) *
                              static_cast<double>(dtype_size(in.grad_dtype));
  }
};

}  // namespace

std::unique_ptr<MlpStrategy> make_whole_mlp() { return std::make_unique<WholeMlp>(); }

}  // namespace lcx
