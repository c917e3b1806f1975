// Optimizer slot: the update of the parameters from their gradients, and the state it keeps for
// it. The run hands the provider the parameters once (the model's, or this rank's ZeRO-3 shards
// of them) with [train]'s settings; every optimizer step then asks grad_norm(), maybe
// scale_grads() (clipping), and step(lr).
//
// A provider may overlap its work with the step's compute: the step tells it when a layer's
// gradients are final (grads_final, after the layer's backward) and when a layer's weights are
// about to be read (weights_needed, before the layer's forward, also in the next step), with
// kNonLayer for the parameters outside the decoder layers (embedding, final norm, head: needed
// before the embedding's forward, final after the embedding's backward). A layer's parameters are
// those named "model.layers.<layer>.". step() may return before its update is done, as long as
// weights_needed(l) makes every later read of layer l's weights wait for it (stream events, not
// a host stall, where it can), and synchronize()/state() wait for everything in flight.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "lcx/plugin.h"
#include "lcx/slots/model.h"

namespace lcx {

struct PlanInputs;
struct MemoryPlan;

// [train]'s optimizer keys: torch.optim.AdamW's, and the master weights' dtype ("fp32": fp32
// master copy and fp32 moments; "bf16": no master, moments in the weights' dtype).
struct OptimizerConfig {
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;
  double weight_decay = 0.0;
  std::string master_dtype = "fp32";
};

// Where the parameters handed to configure() come from.
struct OptimizerScope {
  int world_size = 1;    // ranks of the run; without sharding their gradients are summed after the backward
  bool sharded = false;  // the parameters are this rank's ZeRO-3 shards (core/src/distributed sharding)
};

// A checkpoint's optimizer state: per parameter name the fp32 tensors on the host,
// "<name>.master" (absent without a master), "<name>.exp_avg" and "<name>.exp_avg_sq", and the
// step count. Every provider writes and reads this form, so checkpoints move between them.
struct OptimizerState {
  int64_t step = 0;
  std::vector<std::pair<std::string, Tensor>> tensors;
};

class Optimizer : public Plugin {
 public:
  static constexpr int kNonLayer = -1;

  // Once per run, before the first step: the parameters to update and their settings. A provider
  // refuses what it cannot do here, naming the key and the fix.
  virtual void configure(std::vector<Parameter*> params, const OptimizerConfig& cfg, const OptimizerScope& scope) = 0;

  // Step hooks (see above); the defaults do nothing, for a provider that works after the backward.
  virtual void weights_needed(int /*layer*/) {}
  virtual void grads_final(int /*layer*/) {}

  // The L2 norm of all gradients handed to configure() (fp64 sum of fp32 squares), before clipping.
  virtual double grad_norm() = 0;
  // Multiplies every gradient by `scale` before the next step().
  virtual void scale_grads(double scale) = 0;
  // One update with learning rate `lr`; increments the step count.
  virtual void step(double lr) = 0;
  virtual int64_t steps() const = 0;
  // Waits for every update in flight: the parameters' values are then the updated ones.
  virtual void synchronize() {}
  // For checkpoints (see OptimizerState); both wait for everything in flight first. load_state
  // also sets the parameters' values from the master weights it restores.
  virtual OptimizerState state() const = 0;
  virtual void load_state(const OptimizerState& s) = 0;
  // Seconds the forward waited on weights this provider was still updating, over the train_step
  // calls since the last step() (0 when it never makes the forward wait); logged per step as
  // time_weights_wait_s. Read after those calls' device work is done.
  virtual double wait_seconds() const { return 0; }
  // Adds what it holds (master weights, moments, staging; on the GPU or, with on_host, the host)
  // to `plan` (lcx/plan.h), from the parameter counts the model's plan published there.
  virtual void plan(const PlanInputs& /*in*/, MemoryPlan& /*plan*/) const {}
};

}  // namespace lcx
