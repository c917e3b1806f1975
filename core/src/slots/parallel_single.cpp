#include "lcx/ops.h"
#include "lcx/defaults.h"
#include "lcx/plan.h"

namespace lcx {
namespace {

class SingleRank final : public Parallelism {
 public:
  void configure(const ParallelModelInfo&) override {}
  int size() const override { return 1; }
  Shard shard(const Sequence& seq, int rank) const override {
    LCX_CHECK(rank == 0, "single-rank parallelism has no rank ", rank);
    Shard s;
    s.tokens = seq.tokens;
    s.targets = seq.targets;
    s.global_length = seq.tokens.size(0);
    s.positions = Tensor::empty({s.global_length}, DType::i64);
    for (int64_t i = 0; i < s.global_length; ++i) s.positions.data_as<int64_t>()[i] = i;
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
  // The attention kernels keep no [T,T] matrix; the backward's one buffer is the fp32 row sums
  // delta [Hq,T] (out . dout). The LSE belongs to the model's layer.
  void plan(const PlanInputs& in, MemoryPlan& plan) const override {
    plan.add("attention backward delta [Hq,T] fp32", PlanCategory::transient,
             in.model.num_heads * in.tokens_per_rank * 4, plan_phase::backward);
  }

 private:
  static ops::AttentionParams params(const AttentionArgs& a) {
    ops::AttentionParams p;
    p.scale = a.scale;
    p.causal = a.causal;
    return p;
  }
};

}  // namespace

std::unique_ptr<Parallelism> make_single_rank() { return std::make_unique<SingleRank>(); }

}  // namespace lcx
