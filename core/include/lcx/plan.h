// Memory plan: what one training step holds on each GPU (and in pinned host memory), computed from
// shapes alone, before any GPU work. Every slot provider adds its own terms through its slot's
// plan() (loss.h, positional_encoding.h, memory_strategy.h, parallelism.h, model.h, optimizer.h), so a strategy
// written later plans itself; core adds the step's own buffers, sums the terms per phase and
// reports the peak (`lcx-train --plan`, and the out-of-memory message).
//
// A term is live either in every phase ("always": weights, optimizer state), through the whole step
// ("step": saved layer inputs, rope tables), or in one phase. A provider lists what it holds at the
// worst moment of that phase; the terms of one phase coexist, so a phase's bytes are their sum.
#pragma once
#include <algorithm>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "lcx/dtype.h"
#include "lcx/mesh_shape.h"
#include "lcx/slots/model.h"

namespace lcx {

namespace plan_phase {
inline constexpr const char* always = "always";
inline constexpr const char* step = "step";  // forward through the last layer's backward
inline constexpr const char* forward = "forward";
inline constexpr const char* loss = "loss";
inline constexpr const char* final_norm = "final norm backward";
// A layer's backward has two moments: its MLP's backward (beside the recomputed MLP input), then
// its attention's (recompute of the attention half, attention backward). Their buffers never
// coexist, so each is a phase: the MLP slot plans mlp_backward, the Parallelism slot backward.
inline constexpr const char* mlp_backward = "layer MLP backward";
inline constexpr const char* backward = "layer recompute/backward";
inline constexpr const char* optimizer = "optimizer";
}  // namespace plan_phase

enum class PlanCategory : uint8_t {
  weights,
  gradients,
  master_weights,
  optimizer,
  activations_gpu,   // checkpointed layer inputs held on the GPU
  activations_host,  // checkpointed layer inputs in pinned host memory (on_host terms)
  transient,         // work buffers of one layer, the loss, the attention
  reserve,           // outside the allocator's count: CUDA context, library workspaces, slack
  communication,     // gathered parameters, ring blocks, all-to-all buffers
};
constexpr int kPlanCategories = 9;
const char* plan_category_name(PlanCategory c);

struct PlanInputs {
  ModelConfig model;
  int64_t seq_len = 0;          // the global sequence length, after padding
  int64_t tokens_per_rank = 0;  // the tokens one rank's layers see: seq_len / (cp * sp)
  int64_t world_size = 1;       // dp * cp * sp; parameters and optimizer state shard over it
  int64_t dp = 1, cp = 1, sp = 1;
  int64_t local_ranks = 1;      // ranks on one node: their pinned host bytes share its memory
  DType weight_dtype = DType::bf16;  // the compute copy; activations take it too
  DType master_dtype = DType::f32;   // f32: fp32 master and moments; bf16: no master, moments in weight_dtype
  int64_t grad_accum = 1;            // accumulation reuses the grads in place: no extra memory
  DType grad_dtype = DType::f32;     // of the GEMM weights' gradients (norms, embedding, head: fp32)
  Recipe recipe;                     // the choices planned (model.h); explicit keys win over them
  bool documents_masked = false;     // [data] attend_across_documents = false: attention masks per document
  MeshOrder order = MeshOrder::sp_inner;  // [distributed] order: which of cp and sp takes neighbouring ranks
  int64_t ep = 1;  // [distributed] ep: ranks splitting each sparse layer's experts (MeshShape::ep)
  // [train] rebuild_each (Recipe::rebuild_each): -1 "auto" (the plan's choice where k >= 3), 0 or 1.
  int64_t rebuild_each = -1;
  // Set by the Adapter slot's plan_inputs() before anything plans (lcx/slots/adapter.h): the
  // model's parameters are frozen but for base_trained_parameters of them (modules the adapter
  // trains whole), so the model plans gradients for those alone and skips its weight-gradient work.
  bool base_frozen = false;
  int64_t base_trained_parameters = 0;
  bool head_frozen = false;  // of those frozen, the head: the loss computes no gradient for it
  // Set there too: the rank of the low-rank factors on each linear module, by layer and the
  // module's place in ModelConfig::linear_modules (0: not adapted; empty: nothing is), and whether
  // they drop their input. The model computes the update (lcx/slots/adapter.h), so it plans the
  // products and dropped inputs it holds; the adapter plans its factors.
  std::vector<std::vector<int64_t>> adapter_ranks;
  bool adapter_dropout = false;
  int64_t adapter_rank(int64_t layer, size_t module) const {
    if (layer < 0 || static_cast<size_t>(layer) >= adapter_ranks.size()) return 0;
    const auto& l = adapter_ranks[static_cast<size_t>(layer)];
    return module < l.size() ? l[module] : 0;
  }
};

// The ranks each parameter, its gradient and its optimizer state are split over: the world under
// ZeRO-3; 1 under expert parallelism, which runs with parameters replicated (ZeRO-3 refused) and
// divides only the experts, by ep, in the model's own count (MemoryPlan::parameters).
inline int64_t parameter_shards(const PlanInputs& in) { return in.ep > 1 ? 1 : std::max<int64_t>(1, in.world_size); }

struct PlanTerm {
  // Short snake_case, fixed while the term means the same bytes ("logits", "rope_tables"): what code
  // and tests look a term up by, one per contributor and phase. `name` is for people (--plan).
  std::string id;
  std::string name;  // what the bytes are, e.g. "logits [T,V] fp32"
  PlanCategory category = PlanCategory::transient;
  int64_t bytes = 0;
  std::string phase = plan_phase::always;
  bool on_host = false;     // host memory (pinned, or an optimizer's state) rather than the GPU
  std::string contributor;  // the provider that added it ("nll", "qwen3", "step", ...)
};

// The step's work by kind, for the plan's time estimate: each provider adds what its own calls
// compute beside its memory terms; core turns the sums into seconds with the rates this kind of
// GPU reaches (its row of the rates table, lcx/rates.h), and ranks the recipes by them.
struct StepWork {
  double gemm_flops = 0;
  double grouped_gemm_flops = 0;  // GEMMs cut by head group (head_groups of them per full-width one)
  // The sparse layers' expert GEMMs, one grouped call over the experts per projection: slower
  // than the dense GEMMs (rate_name::expert_gemm).
  double expert_gemm_flops = 0;
  int64_t head_groups = 1;
  double attention_forward_flops = 0;   // causal: 2 d flops per (query, key) pair and head, twice (QK^T, PV)
  double attention_backward_flops = 0;  // 2.5x the forward's pairs: dV, dP, dS, dQ, dK
  // Elementwise passes and the optimizer: bytes read and written; also what a GEMM repeated over
  // tiles or chunks of rows moves once per call (its weights read, an fp32 gradient it accumulates
  // read and written), which larger tiles and chunks save.
  double memory_bytes = 0;
  double exposed_copy_bytes = 0;        // host <-> GPU copies the compute waits for (not overlapped)
};

struct MemoryPlan {
  std::vector<PlanTerm> terms;
  // Stamped on every term add() appends; the planner sets it before each provider's plan().
  std::string contributor;
  // Set by the model's plan, which the planner asks first: the head groups its attention half runs
  // one at a time, so a Parallelism sizes one attention call's buffers by num_heads /
  // attention_head_groups query heads.
  int64_t attention_head_groups = 1;
  // Also set by the model's plan: the bytes of each layer it hands to MemoryStrategy::keep() beside
  // the layer's input (its attention output and LSE, when kept from the forward); the memory
  // strategy's plan places them where it places the inputs.
  int64_t kept_bytes_per_layer = 0;
  StepWork work;
  // Also set by the model's plan, for the optimizer's: the model's parameters, whole (each rank
  // holds 1 / PlanInputs::world_size of them when sharded), and of those the GEMM weights, whose
  // gradients are kept in PlanInputs::grad_dtype (the others' in fp32).
  int64_t parameters = 0;
  int64_t gemm_parameters = 0;

  void add(std::string id, std::string name, PlanCategory category, int64_t bytes, std::string phase,
           bool on_host = false);
  // The first term `id` (of `contributor`, when one is named) in the order added; null when none.
  const PlanTerm* find(std::string_view id, std::string_view contributor = {}) const;

  // The phases a peak can occur in, in step order.
  static const std::vector<std::string>& phases();
  static bool live_in(const PlanTerm& t, const std::string& phase);
  // GPU bytes live in `phase`; with_reserve adds the reserve terms (the allocator does not count them).
  int64_t gpu_bytes(const std::string& phase, bool with_reserve = true) const;
  // Pinned host bytes live in `phase`, and their largest over the phases.
  int64_t host_bytes(const std::string& phase) const;
  int64_t host_peak() const;
  struct Peak {
    std::string phase;
    int64_t bytes = 0;
  };
  Peak peak(bool with_reserve = true) const;  // the phase holding the most GPU bytes
  // GPU bytes of one category, summed over its terms (each term once, whatever its phase).
  int64_t category_bytes(PlanCategory c, bool on_host = false) const;
  // The phase whose transient terms sum highest, and that sum.
  Peak largest_transient() const;
};

// The terms of one document-masked attention call (lcx/attention_cost.h attention_call_bytes,
// masked) in the forward, the backward and through the step, for a Parallelism whose calls see
// `rows` query rows of hq query heads: added by the single-rank default, and by a Parallelism
// whose calls see whole sequences, when PlanInputs::documents_masked.
void plan_document_masks(MemoryPlan& plan, int64_t hq, int64_t rows, int64_t d);

}  // namespace lcx
