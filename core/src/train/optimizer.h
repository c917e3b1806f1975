// AdamW as torch.optim.AdamW computes it, over the model's parameters. By default each parameter
// has an fp32 master copy and fp32 moments, and the model's compute copy (bf16 on a GPU) is
// rounded from the master after every update. master_dtype "bf16" keeps no master and bf16
// moments, reproducing an all-bf16 transformers run.
#pragma once
#include <string>
#include <vector>

#include "lcx/slots/model.h"

namespace lcx {

struct AdamWConfig {
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;
  double weight_decay = 0.0;
  std::string master_dtype = "fp32";
};

class AdamW {
 public:
  AdamW(std::vector<Parameter*> params, AdamWConfig cfg);
  // Total L2 norm of all gradients (fp64 sum of fp32 squares), before clipping.
  double grad_norm() const;
  // Multiplies every gradient by `scale`.
  void scale_grads(double scale);
  // One update with learning rate `lr`; increments the step count.
  void step(double lr);
  int64_t steps() const { return step_; }

  // State for checkpoints: per parameter name, the master weights and the two moments (fp32
  // tensors on the host), plus the step count.
  struct State {
    int64_t step = 0;
    std::vector<std::pair<std::string, Tensor>> tensors;  // "<name>.master", ".exp_avg", ".exp_avg_sq"
  };
  State state() const;
  void load_state(const State& s);

 private:
  struct ParamState {
    Parameter* p;
    Tensor master;  // fp32; undefined with master_dtype bf16
    Tensor m, v;    // fp32 (or bf16 with master_dtype bf16)
  };
  std::vector<ParamState> params_;
  AdamWConfig cfg_;
  int64_t step_ = 0;
};

}  // namespace lcx
