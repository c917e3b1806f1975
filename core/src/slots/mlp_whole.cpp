// MlpStrategy "whole": the MLP over every row at once. gate, up and act = silu(gate) * up are
// [T,I] (swiglu_forward writes act in one pass, so three tensors where PyTorch holds four); the
// backward recomputes them and adds dact, dgate, dup. An adapted projection adds its low-rank
// update (lcx/slots/adapter.h); a frozen weight (its grad undefined) gets no gradient GEMM.
#include <utility>

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
    project_in(x, w, gate, up);
    Tensor act = Tensor::empty({T, I}, x.dtype(), x.device());
    ops::swiglu_forward(gate, up, act);
    project(act, w.down, w.down_lr, out);
  }

  void backward(const Tensor& x, const MlpWeights& w, const Tensor& dout, Tensor& dx, MlpWeights& grad) override {
    const int64_t T = x.size(0), I = w.gate.size(0);
    const DType dt = x.dtype();
    const Device dev = x.device();
    Tensor gate = Tensor::empty({T, I}, dt, dev), up = Tensor::empty({T, I}, dt, dev);
    project_in(x, w, gate, up);
    Tensor act = Tensor::empty({T, I}, dt, dev);
    ops::swiglu_forward(gate, up, act);
    Tensor dact = Tensor::empty({T, I}, dt, dev);
    if (grad.down.defined()) ops::matmul(dout, true, act, false, grad.down, 1.f, 1.f);
    // An adapter's input gradient first, the projection's GEMM accumulating onto it.
    if (w.down_lr) lowrank_backward(act, dout, *w.down_lr, dact, 0.f);
    ops::matmul(dout, false, w.down, false, dact, 1.f, w.down_lr ? 1.f : 0.f);
    Tensor dgate = Tensor::empty({T, I}, dt, dev), dup = Tensor::empty({T, I}, dt, dev);
    ops::swiglu_backward(gate, up, dact, dgate, dup);
    if (grad.gate.defined()) ops::matmul(dgate, true, x, false, grad.gate, 1.f, 1.f);
    if (grad.up.defined()) ops::matmul(dup, true, x, false, grad.up, 1.f, 1.f);
    float beta = 0.f;
    if (w.gate_lr) lowrank_backward(x, dgate, *w.gate_lr, dx, std::exchange(beta, 1.f));
    if (w.up_lr) lowrank_backward(x, dup, *w.up_lr, dx, std::exchange(beta, 1.f));
    ops::matmul(dgate, false, w.gate, false, dx, 1.f, beta);
    ops::matmul(dup, false, w.up, false, dx, 1.f, 1.f);
  }

  // out = x @ w^T, with the adapter's update written first and the GEMM accumulating onto it.
  static void project(const Tensor& x, const Tensor& w, const LowRank* lr, Tensor& out) {
    if (lr) lowrank_forward(x, *lr, out, 0.f);
    ops::matmul(x, false, w, true, out, 1.f, lr ? 1.f : 0.f);
  }
  // gate = x @ Wg^T and up = x @ Wu^T, each with its adapter's update.
  static void project_in(const Tensor& x, const MlpWeights& w, Tensor& gate, Tensor& up) {
    project(x, w.gate, w.gate_lr, gate);
    project(x, w.up, w.up_lr, up);
  }

  void plan(const PlanInputs& in, MemoryPlan& plan) const override {
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
