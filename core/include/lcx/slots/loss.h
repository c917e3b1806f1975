// Loss slot: fused forward and backward of the language-model head and cross entropy.
// A provider that takes the rows in chunks may leave their size to the plan as a knob of its own
// (lcx/knob.h), and adds each chunk's cost to MemoryPlan::work, so the plan weighs larger chunks'
// speed against their memory.
#pragma once
#include "lcx/plugin.h"
#include "lcx/tensor.h"

namespace lcx {

struct PlanInputs;
struct MemoryPlan;

struct LossResult {
  double loss_sum = 0;  // sum of per-token losses over valid targets (fp32 math, fp64 sum)
  int64_t valid = 0;    // targets that are not -100
};

class Loss : public Plugin {
 public:
  // hidden [T,H] (after the final norm), head [V,H] (tied or not), targets int64 [T] ALREADY
  // shifted: targets[t] is the token that position t predicts, -100 where ignored.
  // grad_scale is d(step loss)/d(loss_sum): 1 / (valid targets of the whole step, all ranks).
  // Writes grad_hidden [T,H] and ACCUMULATES into grad_head [V,H] (fp32); an undefined grad_head
  // is a frozen head's (the Adapter slot's): its gradient GEMM is not run.
  virtual LossResult forward_backward(const Tensor& hidden, const Tensor& head, const Tensor& targets,
                                      double grad_scale, Tensor& grad_hidden, Tensor& grad_head) = 0;
  // The same sums without gradients, for evaluation.
  virtual LossResult forward(const Tensor& hidden, const Tensor& head, const Tensor& targets) = 0;
  // Adds what this provider holds during a step to `plan` (lcx/plan.h); the default adds nothing.
  virtual void plan(const PlanInputs& /*in*/, MemoryPlan& /*plan*/) const {}
};

}  // namespace lcx
