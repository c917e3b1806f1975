// Model slot: parameters by Hugging Face name, explicit forward and backward per layer, HF I/O.
// There is no autograd: the step (core) runs embed -> layers -> final norm -> Loss, then the
// layers' backward last to first, recomputing each layer from the input MemoryStrategy kept.
#pragma once
#include <limits>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "lcx/plugin.h"
#include "lcx/slots/memory_strategy.h"
#include "lcx/slots/mlp_strategy.h"
#include "lcx/slots/parallelism.h"
#include "lcx/slots/positional_encoding.h"
#include "lcx/tensor.h"

namespace lcx {

struct PlanInputs;
struct MemoryPlan;

// A linear module of a layer, as the model exposes it to adapters (lcx/slots/adapter.h) and PEFT
// matches it: y = x W^T (+ bias), W [out_features, in_features], or, stacked for a mixture of
// experts, one such W per expert, each applied to the rows routed to it.
struct LinearModule {
  // The module's path under its layer, as transformers and PEFT name it: "self_attn.q_proj",
  // "mlp.down_proj", "mlp.experts.gate_up_proj". Its full name is "model.layers.<l>." + path.
  std::string path;
  int64_t in_features = 0, out_features = 0;
  bool bias = false;  // the module adds a bias (its parameter is path + ".bias")
  // The experts stacked in it (every expert of the model, whatever ranks hold them); 0 for a plain
  // linear module.
  int64_t experts = 0;
  // The experts each token's row is routed to (the rows an experts module runs per token).
  int64_t experts_per_token = 0;
  // How PEFT addresses stacked experts: false, one nn.Linear per expert, expert e's named by its
  // number before the path's last part ("mlp.experts.5.gate_proj"); true, one 3-D parameter
  // [experts, in, out] named by the path ("mlp.experts.gate_up_proj"), adapted by PEFT's
  // target_parameters.
  bool parameter = false;
  // The model's number for it, unique in its layer: what Adapter::find(layer, id) is asked by.
  int id = 0;
  // Modules of one layer with the same input number read the same tensor (q, k and v read the
  // normed input): an adapter may stack their factors so one GEMM over that input serves them.
  int input = 0;
};

// A parameter of the model by its Hugging Face name, its elements and whether its gradient is a
// GEMM's (a linear module's weight, a router's), as the module declares it.
struct ParameterSize {
  std::string name;
  int64_t numel = 0;
  bool gemm = false;
};

struct ModelConfig {
  std::string model_type;  // "qwen3"
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_layers = 0;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t max_position_embeddings = 0;
  double rope_theta = 1e6;
  double rms_norm_eps = 1e-6;
  bool tie_word_embeddings = false;
  std::vector<std::string> layer_types;  // one per layer
  // The window of the "sliding_attention" layers (transformers' sliding_window): a query at
  // position p sees the keys at positions p - W + 1 .. p (W keys, itself included). 0: none.
  int64_t sliding_window = 0;
  std::string rope_parameters_json = "{}";
  // The sliding_attention layers' rope parameters where they rotate otherwise than the full
  // layers (Gemma 3: rope_theta 10000, unscaled, beside the full layers' 1e6 with their scaling);
  // empty: every layer rotates with rope_parameters_json. The PositionalEncoding slot's tables are
  // the full layers'; a model computes the sliding layers' from StepContext::positions.
  std::string sliding_rope_parameters_json;
  // The softmax scale of the attention scores; 0: 1/sqrt(head_dim). Gemma 3 scales by
  // query_pre_attn_scalar^-0.5.
  double attention_scale = 0;
  std::string torch_dtype = "bfloat16";
  // Each layer's linear modules (linear_modules[l]), in the order the layer runs them; the model's
  // output head is none of them. Set by the module (Model::describe and config()), so a plan made
  // before any weight exists sees them too.
  std::vector<std::vector<LinearModule>> linear_modules;
  // Every parameter in load order (a mixture of experts' stacked experts at the share a rank of the
  // model's [distributed] ep holds). Set by the module with linear_modules, for what a plan counts
  // before any weight exists (the parameters an adapter's modules_to_save trains whole).
  std::vector<ParameterSize> parameters;
  // The layers whose MLP runs through the MLP slot (StepContext::mlp); the others run an MLP of the
  // model's own, which its plan counts. -1: every layer.
  int64_t mlp_slot_layers = -1;
  // Layer l's module of that path, or null.
  const LinearModule* linear_module(int64_t layer, const std::string& path) const {
    if (layer < 0 || static_cast<size_t>(layer) >= linear_modules.size()) return nullptr;
    for (const LinearModule& m : linear_modules[static_cast<size_t>(layer)])
      if (m.path == path) return &m;
    return nullptr;
  }
  // What the family's module reads beyond these (a mixture of experts' shape and routing, the
  // decoder library's MoeConfig), as JSON text: set and read by the module alone, carried with the
  // config so a plan made from describe() sees it too. Data, not an object of the module's: a
  // config outlives the module's library. Empty where the family has none.
  std::string family_json;
};

// A figure a model logs beside its auxiliary loss (a column of metrics.jsonl, by name), and how a
// step of several sequences combines their passes' values (NaN, logged as null, wins either way).
struct AuxStat {
  std::string name;
  double value = 0;
  enum class Combine : uint8_t { min, max } combine = Combine::max;
};

// The auxiliary loss of a model's last forward pass (embed_forward .. final_norm_forward): for a
// mixture of experts, the load-balancing loss, with what the experts took as its stats.
struct AuxLoss {
  double value = 0;   // the loss, its coefficient not applied
  double coef = 0;    // its weight in the trained (and reported) loss; 0: logged only
  std::vector<AuxStat> stats;
  bool present = false;  // the model has one

  // The stat of that name; NaN where the model gives none.
  double stat(std::string_view name) const {
    for (const AuxStat& s : stats)
      if (s.name == name) return s.value;
    return std::numeric_limits<double>::quiet_NaN();
  }
};

// The ranks a parameter's gradient is summed over, which follow from the ranks that hold it.
enum class GradGroup : uint8_t {
  // Every rank holds the whole parameter (or, under ZeRO-3, its shard of it): summed over the world.
  world,
  // Each rank of Mesh::partition() holds its own part of it (rows of dim 0, in the group's rank
  // order; a mixture of experts' experts under [distributed] ep): summed over
  // Mesh::partition_replicas(), the ranks holding the same part. Its squares count once per
  // partition in the gradient's norm, and a save gathers the parts over the partition.
  partition_replicas,
};

struct Parameter {
  std::string name;  // the HF name, e.g. "model.layers.0.self_attn.q_proj.weight"
  Tensor value;      // compute copy (bf16 on GPU by default)
  // Accumulated across the step: none when loaded; the run gives one to each parameter it trains
  // unsharded (fp32, or [train] grad_dtype for a GEMM weight), Model::zero_grad fp32 to the rest.
  Tensor grad;
  bool decay = true;  // weight decay applies (false for norms)
  // Its gradient is written by GEMMs alone (projections, MLP), which accumulate in fp32 and round
  // once, so the run may keep it in the weights' dtype ([train] grad_dtype).
  bool gemm_grad = false;
  // Not trained (the Adapter slot froze it): no gradient tensor, no optimizer state, and the
  // backward computes no gradient for it.
  bool frozen = false;
  GradGroup grad_group = GradGroup::world;
};

struct StepContext {
  const RopeTables* rope = nullptr;
  Parallelism* parallel = nullptr;
  Device device;
  MlpStrategy* mlp = nullptr;  // the MLP slot; a model runs its own whole MLP when null
  // Where a layer may keep tensors beyond its input for its backward (MemoryStrategy::keep); null
  // on paths with no backward (evaluation), where nothing is kept.
  MemoryStrategy* memory = nullptr;
  Recipe recipe;  // the plan's choices (lcx/knob.h)
  // The shard's document_bounds, for the attention (AttentionArgs::documents).
  std::span<const int64_t> documents;
  // The Adapter slot: the low-rank factors a layer adds to its linear modules (asked by
  // LinearModule::id); null (or a provider that adapts nothing) for full fine-tuning.
  const class Adapter* adapter = nullptr;
  // This pass's share of the step's auxiliary loss (1 / the step's sequences): the weight of its
  // gradient beside the LM loss's.
  double aux_weight = 1.0;
  // The ranks that share this sequence (cp x sp), for statistics over the whole sequence (the
  // load-balancing loss's); null where one rank holds it.
  class Communicator* sequence = nullptr;
  // Mesh::partition(): the ranks holding the parts of the model's partitioned parameters
  // (GradGroup::partition_replicas), through which a layer sends its rows to the rank holding the
  // part they need (a sparse layer's tokens to their experts); null where one rank holds them whole.
  // Its ranks exchange in every pass, so the step runs as many passes on each of them.
  class Communicator* partition = nullptr;
  // int64 [T] on the device: each row's index in its sequence (Shard::indices, 0 .. T-1 where the
  // shard has none), by which the adapters' dropout draws (LowRank).
  Tensor rows;
  // int64 [T] on the host: each row's position (Shard::positions, restarting per document), from
  // which a model builds rotary tables of its own (ModelConfig::sliding_rope_parameters_json);
  // undefined where the caller has none, and then such a model refuses to run.
  Tensor positions;
};

class Model : public Plugin {
 public:
  virtual void load_hf(const std::string& dir, Device device, DType dtype) = 0;
  // `spec` is a preset name (qwen3-0.6b, ...) or a JSON object of config.json keys.
  virtual void init_random(const std::string& spec, uint64_t seed, Device device, DType dtype) = 0;
  // Writes config.json (with `rope_parameters_json`) and safetensors that transformers loads.
  virtual void save_hf(const std::string& dir, DType dtype, const std::string& rope_parameters_json) const = 0;
  virtual const ModelConfig& config() const = 0;
  // The configuration `spec` would give, with no weight created: a Hugging Face folder (its
  // config.json), a preset name, or a JSON object as init_random takes. For plans and checks made
  // before anything is loaded; throws naming the spec when the module does not know it.
  virtual ModelConfig describe(const std::string& spec) const = 0;
  virtual std::vector<Parameter*> parameters() = 0;
  // Zeroes every gradient, first giving each unfrozen parameter without one an fp32 gradient.
  virtual void zero_grad() = 0;

  virtual void embed_forward(const Tensor& tokens, Tensor& x) = 0;  // x [T,H]
  virtual void embed_backward(const Tensor& tokens, const Tensor& dx) = 0;
  virtual void layer_forward(int layer, const Tensor& x, Tensor& y, StepContext& ctx) = 0;
  // Recomputes the layer from x, then writes dx and accumulates the layer's parameter grads. dy's
  // memory is the model's to overwrite (the step drops it after), so a layer's backward need not
  // hold the residual's gradient beside it.
  virtual void layer_backward(int layer, const Tensor& x, const Tensor& dy, Tensor& dx,
                              StepContext& ctx) = 0;
  virtual void final_norm_forward(const Tensor& x, Tensor& y) = 0;
  virtual void final_norm_backward(const Tensor& x, const Tensor& dy, Tensor& dx) = 0;
  // The last forward pass's auxiliary loss (embed_forward begins a pass, final_norm_forward ends
  // it; the layers' recomputes after it do not count); its gradient is the layers' backward's.
  virtual AuxLoss aux_loss() const { return {}; }
  // The model FLOPs of one training step over a sequence of `tokens` (forward and backward, 3x
  // the forward; no recompute), for the MFU: 6 per token for each weight its GEMMs multiply it by
  // (the head's included, the embedding lookup's not; a mixture of experts' experts that token
  // takes), plus the attention's score and value products over the (query, key) pairs the mask
  // allows. document_bounds as Sequence::document_bounds (empty: one causal sequence).
  virtual double step_flops(int64_t tokens, std::span<const int64_t> document_bounds) const = 0;
  virtual Tensor head_weight() = 0;  // [V,H]: lm_head, or the embedding when tied
  virtual Tensor head_grad() = 0;    // fp32 [V,H], shared with the embedding's when tied
  // Lines the plan's header adds under the model's shape (each ending in a newline): what this
  // module does with the run's mesh beyond the common layout (which part of its parameters a rank
  // holds). The default adds none.
  virtual std::string plan_summary(const PlanInputs& /*in*/) const { return {}; }
  // Adds what this provider holds during a step to `plan` (lcx/plan.h); the default adds nothing.
  virtual void plan(const PlanInputs& /*in*/, MemoryPlan& /*plan*/) const {}
};

}  // namespace lcx
