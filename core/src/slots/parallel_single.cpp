#include <algorithm>

#include "kernels/cudnn_sizes.h"
#include "lcx/defaults.h"
#include "lcx/ops.h"
#include "lcx/plan.h"

namespace lcx {

namespace {

class SingleRank final : public Parallelism {
 public:
  void configure(const ParallelModelInfo&, Mesh*) override {}
  int size() const override { return 1; }
  bool masks_documents() const override { return true; }
  Shard shard(const Sequence& seq, int rank) const override {
    LCX_CHECK(rank == 0, "single-rank parallelism has no rank ", rank);
    Shard s;
    s.tokens = seq.tokens;
    s.targets = seq.targets;
    s.global_length = seq.tokens.size(0);
    s.document_bounds = seq.document_bounds;
    s.positions = Tensor::empty({s.global_length}, DType::i64);
    fill_positions(s.positions, 0, s.document_bounds, 0, s.global_length);
    s.indices = Tensor::empty({s.global_length}, DType::i64);
    fill_indices(s.indices, 0, 0, s.global_length);
    return s;
  }
  void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, Tensor& lse,
                         const AttentionArgs& args) override {
    ops::attention_forward(q, k, v, out, lse, params(args));
  }
  void attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                          const Tensor& lse, const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv,
                          const AttentionArgs& args) override {
    ops::attention_backward(q, k, v, out, lse, dout, dq, dk, dv, params(args));
  }
  // The attention kernels keep no [T,T] matrix; the backward holds the fp32 row sums delta [Hq,T]
  // (out . dout) and, in cuDNN's kernel (the GPU's default where it loads), an fp32 dQ
  // accumulator [Hq,T,d] and cuDNN's workspaces (kernels/cudnn_sizes.h); masked by document, cuDNN's batches
  // of documents hold those per padded row instead (plan_document_masks). Hq is one
  // call's: the model's head groups divide it. The LSE belongs to the model's layer.
  void plan(const PlanInputs& in, MemoryPlan& plan) const override {
    const int64_t hq = in.model.num_heads / std::max<int64_t>(1, plan.attention_head_groups);
    const int64_t d = in.model.head_dim > 0 ? in.model.head_dim : in.model.hidden_size / std::max<int64_t>(1, in.model.num_heads);
    plan.add("attention_delta", "attention backward delta [Hq,T] fp32", PlanCategory::transient,
             hq * in.tokens_per_rank * 4, plan_phase::backward);
    if (in.documents_masked)  // cuDNN's batches of documents, in place of one unmasked call
      return plan_document_masks(plan, hq, in.tokens_per_rank, d);
    plan.add("attention_dq_accumulator", "attention backward dQ accumulator [Hq,T,d] fp32 (cuDNN)",
             PlanCategory::transient, cudnn_dq_accumulator_bytes(hq, in.tokens_per_rank, d), plan_phase::backward);
    plan.add("attention_forward_workspace", "attention forward workspace (cuDNN)", PlanCategory::transient,
             kCudnnForwardWorkspace, plan_phase::forward);
    plan.add("attention_backward_workspace", "attention backward workspace (cuDNN) [Hq,T,d] fp32 + 256 B",
             PlanCategory::transient, cudnn_backward_workspace_bytes(hq, in.tokens_per_rank, d), plan_phase::backward);
  }

 private:
  static ops::AttentionParams params(const AttentionArgs& a) {
    ops::AttentionParams p;
    p.scale = a.scale;
    p.causal = a.causal;
    p.documents = a.documents;
    p.window = a.window;
    return p;
  }
};

}  // namespace

std::unique_ptr<Parallelism> make_single_rank() { return std::make_unique<SingleRank>(); }

}  // namespace lcx
