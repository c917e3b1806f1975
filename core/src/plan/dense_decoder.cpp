// Core's arithmetic for a dense decoder's memory (plan_dense_decoder in lcx/plan.h), counted from
// what models/qwen3/qwen3_model.cpp allocates: each term names the tensors it stands for. Bytes
// per token are exact for those tensors; what the kernels allocate beyond them is the attention
// provider's (attention workspace) or core's (cuBLASLt workspace, reserve).
#include <algorithm>

#include "lcx/plan.h"

namespace lcx {
namespace {

struct DecoderDims {
  int64_t V, H, I, L, Hq, Hkv, d, qd, kvd;
};

DecoderDims shape_of(const ModelConfig& c) {
  const int64_t d = c.head_dim > 0 ? c.head_dim : c.hidden_size / c.num_heads;
  return {c.vocab_size, c.hidden_size, c.intermediate_size, c.num_layers, c.num_heads, c.num_kv_heads, d,
          c.num_heads * d, c.num_kv_heads * d};
}

// One decoder layer's parameters: input and post-attention norms, q/k/v/o projections, the
// per-head q_norm and k_norm, gate/up/down.
int64_t layer_params(const DecoderDims& s) {
  return 2 * s.H + s.qd * s.H + 2 * s.kvd * s.H + s.H * s.qd + 2 * s.d + 3 * s.I * s.H;
}

}  // namespace

void plan_dense_decoder(const PlanInputs& in, MemoryPlan& plan) {
  const DecoderDims s = shape_of(in.model);
  const int64_t T = in.tokens_per_rank;
  const int64_t ab = static_cast<int64_t>(dtype_size(in.weight_dtype));  // activations take the weights' dtype
  const int64_t head = in.model.tie_word_embeddings ? 0 : s.V * s.H;
  const int64_t n = s.V * s.H + s.L * layer_params(s) + s.H + head;  // embedding, layers, final norm, head
  // ZeRO-3 over the whole mesh (core/src/dist/sharded_params.h): a rank keeps 1/world of each
  // parameter's value, fp32 grad, master and moments.
  const int64_t shards = std::max<int64_t>(1, in.world_size);
  const int64_t per_rank = (n + shards - 1) / shards;
  const bool master = in.master_dtype == DType::f32;
  const int64_t moment = master ? 4 : ab;
  plan.add("parameters (" + std::to_string(n) + ")", PlanCategory::weights, per_rank * ab, plan_phase::always);
  plan.add("fp32 gradients", PlanCategory::gradients, per_rank * 4, plan_phase::always);
  if (master) plan.add("fp32 master copy", PlanCategory::master_weights, per_rank * 4, plan_phase::always);
  plan.add(master ? "AdamW moments m, v (fp32)" : "AdamW moments m, v (weight dtype)", PlanCategory::optimizer,
           2 * per_rank * moment, plan_phase::always);
  if (shards > 1) {
    // Gathered around each layer: the full values for its forward, values and zeroed fp32 grads
    // for its recompute + backward until reduce_grads; the head's for the loss.
    const int64_t lp = layer_params(s);
    plan.add("one layer's gathered weights", PlanCategory::communication, lp * ab, plan_phase::forward);
    plan.add("one layer's gathered weights + full fp32 grads", PlanCategory::communication, lp * (ab + 4),
             plan_phase::backward);
    plan.add("gathered head weight + its full fp32 grad", PlanCategory::communication, s.V * s.H * (ab + 4),
             plan_phase::loss);
  }

  // layer_forward at its end (LayerActs, then o and m): h1, x1, h2, o, m [T,H]; q, qr, attn
  // [T,Hq*d]; k, v, kr [T,Hkv*d]; fp32 rstd1, rstd2 [T], rstd_q, lse [Hq,T], rstd_k [Hkv,T]. The
  // MLP's own [T,I] work buffers are the MLP slot's terms (lcx/mlp_strategy.h).
  const int64_t f32_rows = 4 * (2 + 2 * s.Hq + s.Hkv);
  plan.add("layer forward: q, k, v, normed q/k, attn out; h1, x1, h2, o, mlp out", PlanCategory::transient,
           T * (3 * s.qd + 3 * s.kvd + 5 * s.H) * ab, plan_phase::forward);
  plan.add("layer forward: fp32 norm rstd and attention LSE", PlanCategory::transient, T * f32_rows,
           plan_phase::forward);

  // layer_backward while the MLP slot's backward runs: the recomputed LayerActs up to h2 (o is
  // gone with forward()) plus every gradient buffer of the layer, all taken before the MLP's
  // backward so the peak is this sum plus the MLP slot's terms.
  plan.add("recompute: q, k, v, normed q/k, attn out", PlanCategory::transient, T * (3 * s.qd + 3 * s.kvd) * ab,
           plan_phase::backward);
  plan.add("backward: dattn, dq, dk, dv, dq/dk before norm", PlanCategory::transient,
           T * (3 * s.qd + 3 * s.kvd) * ab, plan_phase::backward);
  plan.add("recompute/backward: h1, x1, h2, dh2, dx1, dh1 [T,H]", PlanCategory::transient, 6 * T * s.H * ab,
           plan_phase::backward);
  plan.add("recompute: fp32 norm rstd and attention LSE", PlanCategory::transient, T * f32_rows,
           plan_phase::backward);

  // final_norm_backward recomputes the norm: y [T,H] and fp32 rstd [T].
  plan.add("final norm recompute: y [T,H], rstd", PlanCategory::transient, T * (s.H * ab + 4),
           plan_phase::final_norm);
}

}  // namespace lcx
