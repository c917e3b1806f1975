// Adapter slot: trainable weights beside a frozen model, as low-rank adapters add them. The provider attaches
// once the model's weights exist (loaded, initialized or resumed): it creates its own parameters,
// marks the model's parameters it does not train frozen (Parameter::frozen: no gradient tensor,
// no optimizer state, no weight-gradient GEMM), and answers, for each linear module a layer
// exposes (ModelConfig::linear_modules, asked by LinearModule::id), the low-rank factors the
// model adds to it:
//
//   y = x W^T + scale * (x A^T) B^T,   A [r, in], B [out, r]
//
// The model computes the update itself (it knows its head groups and its MLP slot), with the
// helpers below, so a provider holds weights and files, not layer code. Core's default, "none",
// adapts nothing and freezes nothing: full fine-tuning.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "lcx/plugin.h"
#include "lcx/slots/model.h"
#include "lcx/tensor.h"

namespace lcx {

struct PlanInputs;
struct MemoryPlan;

// One adapted projection: the factors and the scale (alpha / r, or alpha / sqrt(r) rank-stabilized).
// The parameters' gradients are fp32 (or [train] grad_dtype) and accumulate across calls.
struct LowRank {
  Parameter* a = nullptr;  // [r, in]
  Parameter* b = nullptr;  // [out, r]
  float scale = 1.f;
  // Where the provider stacks the A factors of modules that read one input (LinearModule::input:
  // q, k, v; gate, up) as consecutive rows of one tensor, that tensor (value; fp32 gradient) and this factor's
  // first row in it: then one GEMM over the input serves all of them (lowrank_inputs,
  // lowrank_input_backward). Undefined where A stands alone.
  Tensor stacked_a, stacked_grad;
  int64_t stacked_row = 0;
  // Dropout on the factor's input, as PEFT's adapters have it: y = x W^T + scale * (dropout(x) A^T) B^T. The mask
  // is drawn (ops::dropout) from the pass's key, which the provider sets in Adapter::begin_pass
  // (*dropout_pass; 0 while nothing trains, as in evaluation), and this projection's own stream
  // (its layer and module), by the input's row (its index in the sequence) and column: a recompute
  // and the backward draw the forward's mask again, whatever rows a tile or a rank of a mesh or
  // columns a head group holds.
  float dropout = 0.f;
  uint64_t dropout_stream = 0;
  const uint64_t* dropout_pass = nullptr;
  int64_t rank() const { return a->value.size(a->value.dim() - 2); }
  // Whether this pass drops, and the mask's key.
  bool dropping() const { return dropout > 0.f && dropout_pass && *dropout_pass != 0; }
  uint64_t dropout_key() const;
};
// A module of stacked experts (LinearModule::experts > 0; Adapter::find_experts) is adapted per expert with the same
// struct, its factors stacked by the experts this rank holds: a [E_local, r, in], b [E_local, out, r]
// (never stacked_a), so one grouped GEMM runs every expert's rows through its own factors.

// What an adapter attaches with.
struct AdapterContext {
  Device device;
  DType dtype = DType::bf16;  // the model's compute dtype: the factors' values take it
  uint64_t seed = 0;          // [run] seed, for the factors' initialization
  // A folder whose adapter the run resumes ("" for none): the provider's own checkpoint files,
  // written by save(); they win over the provider's own initialization.
  std::string resume_dir;
  // Whether the provider may stack factors that share an input (LowRank::stacked_a): false where
  // the run shards the parameters (ZeRO-3) or keeps GEMM weights' gradients in another dtype,
  // which would replace the parameters' views of the stacks with tensors of their own.
  bool stack_factors = true;
  // This rank's place in Mesh::partition(): the part of each partitioned parameter it holds
  // (GradGroup::partition_replicas), rows [index * n, (index + 1) * n) of the whole, so factors
  // drawn per row of the whole start from what one rank would draw.
  int partition_index = 0;
};

class Adapter : public Plugin {
 public:
  // Once, after the model's weights exist. Throws naming the key for a module the model lacks,
  // a rank the matrix cannot hold, or an adapter file that does not match the model.
  virtual void attach(Model& model, const AdapterContext& ctx) = 0;
  // Whether the run trains an adapter (false: full fine-tuning, every model parameter trained).
  virtual bool active() const { return false; }
  // The factors of the plain linear module `id` (LinearModule::id) of `layer`, or null where it
  // is not adapted.
  virtual const LowRank* find(int /*layer*/, int /*id*/) const { return nullptr; }
  // The per-expert factors of the experts module `id` of `layer`, stacked [E_local, ...] as the
  // experts are, or null where its experts are not adapted.
  virtual const LowRank* find_experts(int /*layer*/, int /*id*/) const { return nullptr; }
  // The adapter's own trainable parameters (named "model.layers.<l>.<module path>.<factor>.weight",
  // as PEFT names them, so the optimizer's per-layer hooks and state files treat them as the layer's).
  virtual std::vector<Parameter*> parameters() { return {}; }
  // Before each forward pass: the step (from 1), the pass (the sequence's place in the step's
  // batch, the same on every rank that shares the sequence), and whether it trains (false for
  // evaluation, where nothing drops). A provider with dropout keys its masks by these, and by
  // each element's row in the sequence (StepContext::rows) and column, so every mesh draws alike.
  virtual void begin_pass(int64_t /*step*/, int64_t /*pass*/, bool /*training*/) {}
  // Writes the adapter's files into a checkpoint folder (for low-rank adapters, PEFT's adapter_config.json and
  // adapter_model.safetensors); `base` names the base model in them.
  virtual void save(const std::string& /*dir*/, const std::string& /*base*/) const {}
  // Whether `dir` holds this provider's files (a checkpoint it wrote).
  virtual bool saved_in(const std::string& /*dir*/) const { return false; }
  // Before any provider plans: the parameters of the model it freezes (PlanInputs::base_frozen,
  // base_trained_parameters), so the model's plan counts gradients only for what trains, and the
  // modules it adapts (PlanInputs::adapter_ranks), so the model plans the products it makes with them.
  virtual void plan_inputs(PlanInputs& /*in*/) const {}
  virtual void plan(const PlanInputs& /*in*/, MemoryPlan& /*plan*/) const {}
};

// Where a factor drops (LowRank::dropping), each helper below reads dropout(x) for x, and dx gets
// the mask's gradient; rows (int64 [T] on x's device, StepContext::rows: each row's index in its
// sequence, a tile's share of them) are what the mask counts rows by, 0 .. T-1 where undefined. The dropped input is made when needed, [T, in] beside the call, never kept.
// Factors that drop are never run stacked: each projection draws its own mask, as PEFT's
// per-module Dropout does.
//
// y = beta * y + scale * (x A^T) B^T over x [T, in], y [T, out] (both in the activations' dtype).
// Written first (beta 0) and the projection's own GEMM then accumulating onto it (beta 1), the
// update costs one write of y: the large GEMM reads it in its epilogue, where it is hidden.
void lowrank_forward(const Tensor& x, const LowRank& lr, Tensor& y, float beta = 1.f, const Tensor& rows = Tensor());
// The backward of lowrank_forward: dx = dx_beta * dx + scale * (dy B) A, and the factors'
// gradients accumulate: dA += scale * (dy B)^T x, dB += scale * dy^T (x A^T).
void lowrank_backward(const Tensor& x, const Tensor& dy, const LowRank& lr, Tensor& dx, float dx_beta = 1.f,
                      const Tensor& rows = Tensor());

// Projections reading one input x [T, in], the adapted ones listed in the layer's order (each
// non-null). Their products are kept transposed, u^T = A x^T [r, T], stacked by rows in that
// order, so each factor's block is a contiguous row range (lowrank_block) whether one GEMM wrote
// them all or one GEMM each did. One GEMM runs where the provider stacked the A's in that order
// and the parameters still alias its tensors (a gradient in another dtype or a sharded value
// does not): lowrank_stacked says which.
bool lowrank_stacked(const std::vector<const LowRank*>& lrs);
Tensor lowrank_inputs(const Tensor& x, const std::vector<const LowRank*>& lrs, const Tensor& rows = Tensor());
// Factor i's rows [r_i, T] of a tensor stacked by lowrank_inputs' layout.
Tensor lowrank_block(const Tensor& stacked, const std::vector<const LowRank*>& lrs, size_t i);
// y = beta * y + scale * u B^T from u^T [r, T]; `b` is B or a block of its rows (a head group's).
void lowrank_update(const Tensor& ut, const LowRank& lr, const Tensor& b, Tensor& y, float beta = 1.f);
// The input side of the backward over lowrank_inputs' layout: given g^T [sum of r, T] with
// g_i = scale * dy_i B_i, dx = dx_beta * dx + sum_i g_i A_i and dA_i += g_i^T x (one GEMM each
// where stacked).
void lowrank_input_backward(const Tensor& x, const Tensor& gt, const std::vector<const LowRank*>& lrs, Tensor& dx,
                            float dx_beta = 1.f, const Tensor& rows = Tensor());

}  // namespace lcx
