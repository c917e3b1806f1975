// MLP slot: how a layer's SwiGLU MLP runs over the sequence. The model hands over the normed
// input and the three weights; the strategy decides how much of the sequence it works on at once.
// Core's "whole" runs every row together (four [T,I] intermediates at full length); a strategy
// may cut the rows into tiles, since each row's output depends only on that row.
//
//   out [T,H] = (act(x @ w_gate^T) * (x @ w_up^T)) @ w_down^T,  act = silu or gelu_tanh (MlpWeights::activation)
//
// backward recomputes what it needs from x (nothing is kept between forward and backward), writes
// dx and accumulates the weights' fp32 gradients (beta 1), as the model's other gradients do.
//
// A strategy that cuts the rows into tiles may leave their size to the plan as a knob of its own
// (lcx/knob.h), and adds each tile's cost to MemoryPlan::work, so the plan weighs larger tiles'
// speed against their memory.
#pragma once
#include "lcx/ops.h"
#include "lcx/plugin.h"
#include "lcx/tensor.h"

namespace lcx {

struct PlanInputs;
struct MemoryPlan;

struct LowRank;

// gate [I,H], up [I,H], down [H,I]: HF's gate_proj, up_proj, down_proj (values or fp32 grads).
// A grad left undefined is a frozen weight's: its gradient GEMM is not run. In the values, the
// Adapter slot's low-rank factors of each projection (lcx/slots/adapter.h), null where none:
// the strategy adds lowrank_forward to the projection and runs lowrank_backward beside it.
struct MlpWeights {
  Tensor gate, up, down;
  const LowRank* gate_lr = nullptr;
  const LowRank* up_lr = nullptr;
  const LowRank* down_lr = nullptr;
  // int64 [T] on x's device: each row of x's index in its sequence (StepContext::rows, a tile's
  // share of them), by which the adapters' dropout draws, so a tile draws what the whole MLP would;
  // undefined reads as 0 .. T-1.
  Tensor rows;
  // The gate's activation: silu (SwiGLU, the default) or gelu_tanh (Gemma's GeGLU).
  ops::GateActivation activation = ops::GateActivation::silu;
};

class MlpStrategy : public Plugin {
 public:
  virtual void forward(const Tensor& x, const MlpWeights& w, Tensor& out) = 0;
  virtual void backward(const Tensor& x, const MlpWeights& w, const Tensor& dout, Tensor& dx, MlpWeights& grad) = 0;
  // Adds the MLP's transient buffers in the forward and in the layer MLP backward phases to `plan`
  // (lcx/plan.h: plan_phase::forward, plan_phase::mlp_backward); the model's plan leaves them out.
  virtual void plan(const PlanInputs& /*in*/, MemoryPlan& /*plan*/) const {}
};

}  // namespace lcx
