// One forward and backward pass over this rank's shard of a sequence, through the slots:
//
//   embed -> for each layer: memory.save(l, x), x = layer(x) -> final norm
//   -> loss (fused forward + backward: grad of the final hidden, grad of the head)
//   -> final norm backward -> for each layer, last first: x = memory.fetch(l), recompute and
//   backward the layer, memory.release(l) -> embedding backward
//
// The Optimizer slot hears when a layer's weights are about to be read (weights_needed, before
// its forward) and when its gradients are final (grads_final, after its backward), so it can
// overlap its update with the step (lcx/slots/optimizer.h).
//
// Parameter gradients accumulate into the model's fp32 grads (the caller zeroes them per
// optimizer step), so gradient accumulation is calling this several times.
#pragma once
#include <cstdint>
#include <optional>
#include <vector>

#include "lcx/comm.h"
#include "lcx/slots.h"

namespace lcx {

// Called around each piece of the step; ZeRO-3 sharding gathers a layer's weights in
// before_*() and releases them (and reduce-scatters its gradients) in after_*(). A forward-only
// pass (eval_step, forward_hidden) calls begin_forward_only, the layers' before/after_layer_forward
// and end_forward_only: weights without gradients, all released at its end, nothing reduced.
class StepHooks {
 public:
  virtual ~StepHooks() = default;
  virtual void begin_step() {}  // before the embedding: non-layer weights
  virtual void before_layer_forward(int /*layer*/) {}
  virtual void after_layer_forward(int /*layer*/) {}
  virtual void before_layer_backward(int /*layer*/) {}
  virtual void after_layer_backward(int /*layer*/) {}
  virtual void end_step() {}  // after the embedding's backward
  virtual void begin_forward_only() {}  // before the embedding
  virtual void end_forward_only() {}    // after the loss
};

// One pointer per slot (lcx/slots.h). The model is required; every other slot left null runs
// core's default, created once per StepSlots (and shared by its copies) on first use.
struct StepSlots : SlotTuple<SlotPtr> {
  StepHooks* hooks = nullptr;
  // The activations' dtype, the weights' compute dtype. Unset: the head weight's, which then
  // must be present; under ZeRO-3 sharding no parameter has a full value between layers, so the
  // trainer sets it.
  std::optional<DType> activation_dtype;
  Recipe recipe;  // the plan's choices for this run (lcx/slots/model.h)
  // This rank's mesh, handed to the Parallelism by configure_slots; null for one rank alone.
  Mesh* mesh = nullptr;
  // Core's defaults standing in for the slots left null.
  std::shared_ptr<SlotTuple<std::shared_ptr>> defaults;

  StepSlots() = default;
  StepSlots(Model& model, Loss& loss, PositionalEncoding& positional, MemoryStrategy& memory, Parallelism& parallel);
  // Points each null slot but the model at core's default.
  void fill_defaults();
};

struct StepResult {
  double loss_sum = 0;  // summed over this shard's valid targets
  int64_t valid = 0;    // targets that are not -100
  double forward_s = 0;   // embed + layers + final norm
  double backward_s = 0;  // loss + final norm backward + layers' recompute and backward + embed
  AuxLoss aux;            // the model's auxiliary loss of this pass (Model::aux_loss)
};

// Tells the positional encoding and the parallelism the model's shape, and the parallelism its
// mesh (call once after loading).
void configure_slots(StepSlots& s);

// grad_scale multiplies d(loss_sum): 1 / (valid targets of the whole step, across ranks and
// accumulated sequences) gives transformers' mean loss. aux_weight weighs the model's auxiliary
// loss of this pass (1 / the step's sequences: the step trains their mean).
StepResult train_step(StepSlots& s, const Shard& shard, double grad_scale, Device device, double aux_weight = 1.0);

struct EvalResult {
  double loss_sum = 0;
  int64_t valid = 0;
  std::vector<float> per_position;  // [T] loss at each position (0 where the target is -100)
};

// Forward only; no gradients, no memory strategy. With per_position, each position's loss too.
EvalResult eval_step(StepSlots& s, const Shard& shard, Device device, bool per_position = false);

// The final hidden states [T,H] after the final norm, for callers that need logits themselves.
Tensor forward_hidden(StepSlots& s, const Shard& shard, Device device);

}  // namespace lcx
