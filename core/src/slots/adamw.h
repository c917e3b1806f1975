// AdamW as torch.optim.AdamW computes it, over the model's parameters: core's Optimizer
// ("adamw", lcx/slots/optimizer.h), run where the parameters live, after the backward. By default
// each parameter has an fp32 master copy and fp32 moments, and the model's compute copy (bf16 on
// a GPU) is rounded from the master after every update. master_dtype "bf16" keeps no master and
// bf16 moments, reproducing an all-bf16 transformers run.
#pragma once
#include <string>
#include <vector>

#include "lcx/slots/optimizer.h"

namespace lcx {

class AdamW final : public Optimizer {
 public:
  AdamW() = default;
  AdamW(std::vector<Parameter*> params, OptimizerConfig cfg) { configure(std::move(params), cfg, {}); }

  void configure(std::vector<Parameter*> params, const OptimizerConfig& cfg, const OptimizerScope& scope) override;
  double grad_norm() override;
  void scale_grads(double scale) override;
  void step(double lr) override;
  int64_t steps() const override { return step_; }
  OptimizerState state() const override;
  void load_state(const OptimizerState& s) override;
  // The fp32 master and moments (or bf16 moments) beside the parameters, 1 / world of each when
  // sharded.
  void plan(const PlanInputs& in, MemoryPlan& plan) const override;

 private:
  struct ParamState {
    Parameter* p;
    Tensor master;  // fp32; undefined with master_dtype bf16
    Tensor m, v;    // fp32 (or bf16 with master_dtype bf16)
  };
  std::vector<ParamState> params_;
  OptimizerConfig cfg_;
  int64_t step_ = 0;
};

}  // namespace lcx
