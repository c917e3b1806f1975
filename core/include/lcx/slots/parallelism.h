// Parallelism slot: how one sequence is cut across ranks and how attention still sees every
// earlier token. The result must equal a single big device's.
#pragma once
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "lcx/plugin.h"
#include "lcx/sequence.h"
#include "lcx/tensor.h"

namespace lcx {

struct PlanInputs;
struct MemoryPlan;

// Facts about the model that a strategy checks before the first step.
struct ParallelModelInfo {
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  std::vector<std::string> layer_types;  // "full_attention" / "sliding_attention" / ...
  int64_t sliding_window = 0;            // ModelConfig::sliding_window
};

struct AttentionArgs {
  float scale = 0;  // softmax scale, usually 1/sqrt(head_dim)
  bool causal = true;
  // The shard's document_bounds (lcx/sequence.h), over the whole sequence: a token attends only
  // to its own document. Empty: to every earlier token.
  std::span<const int64_t> documents;
  // > 0 (causal only): a query at position p sees only keys at positions > p - window, as
  // transformers' sliding_attention layers mask (with documents, both masks at once).
  int64_t window = 0;
};

class Mesh;

class Parallelism : public Plugin {
 public:
  // `mesh` is this rank's mesh (lcx/comm.h: its dp, cp and sp communicators and coordinates),
  // kept for the run; null where one rank runs alone (no communicators, every axis 1).
  virtual void configure(const ParallelModelInfo& info, Mesh* mesh) = 0;
  virtual int size() const = 0;  // ranks sharing one sequence
  // The [distributed] axis ("cp", "sp") whose ranks share a sequence under this provider; "" for
  // none. A plan that does not fit raises it when plan_offer() is not empty.
  virtual std::string mesh_axis() const { return {}; }
  // Whether this rank's attention takes any subset of the heads, so a model may run its
  // attention one head group at a time; false when the provider needs every head in one call
  // (it cuts heads across ranks, or each call costs a ring pass).
  virtual bool attention_takes_head_groups() const { return size() == 1; }
  // Whether attention_forward/backward honour AttentionArgs::documents. A provider that does not
  // is refused by name when [data] attend_across_documents = false, never run unmasked.
  virtual bool masks_documents() const { return false; }
  // This rank's share of `seq`. Called on the step's thread and also on a worker thread while this
  // rank's attention runs: the trainer cuts a step's later sequences and the next step's ahead, so
  // whatever a provider computes per sequence (and keeps, under a lock) is ready when the step
  // needs it. It must therefore leave alone, or lock, any state the attention calls use.
  virtual Shard shard(const Sequence& seq, int rank) const = 0;
  // q [T,Hq,d], k/v [T,Hkv,d] of this rank; out [T,Hq,d]; lse fp32 [Hq,T] (natural log).
  virtual void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out,
                                 Tensor& lse, const AttentionArgs& args) = 0;
  // Writes dq, dk, dv (not accumulated).
  virtual void attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                                  const Tensor& lse, const Tensor& dout, Tensor& dq, Tensor& dk,
                                  Tensor& dv, const AttentionArgs& args) = 0;
  // Adds what this provider holds during a step to `plan` (lcx/plan.h); the default adds nothing.
  virtual void plan(const PlanInputs& /*in*/, MemoryPlan& /*plan*/) const {}
  // Two-dimensional sequence parallelism (ABI 3.1): two providers serving different mesh axes may
  // stack, one running its attention through the other's. Core asks each loaded provider whether
  // it stacks over the other and keeps the pair only when exactly one does; that one (the outer)
  // becomes the run's Parallelism and gets the other through set_inner() before configure(). From
  // then on the outer answers for both: size() is the ranks of both axes, shard() takes the rank's
  // place among them, configure() and plan() reach the inner with what it runs on.
  virtual bool stacks_over(const Parallelism& /*inner*/) const { return false; }
  virtual void set_inner(std::shared_ptr<Parallelism> /*inner*/) {}
};

}  // namespace lcx
