// A decoder's memory (RMSNorm, GQA attention with optional q/k norms and q/k/v biases, SwiGLU MLP or experts) as core's
// step runs this module: parameters and their optimizer state, one layer's forward and its
// recompute + backward. The module's plan() (lcx/plan.h) calls it with its head groups.
#pragma once
#include <cstdint>
#include <span>

#include "lcx/plan.h"

namespace lcx::decoder {

struct DenseDecoderAttention {
  // The attention half runs on num_kv_heads / head_groups kv heads (and their query heads) at a
  // time; it must divide num_kv_heads.
  int64_t head_groups = 1;
  // With several groups: each group's output and LSE are kept from the backward's recompute (else
  // the group's attention forward runs again in its backward).
  bool keep_outputs = false;
  // Every group's output and LSE kept from the forward through the memory strategy (selective
  // recompute): the backward rebuilds x1 from them with o_proj and never runs an attention forward.
  bool keep_from_forward = false;
};
// The weights a family's layer carries beside the projections and norms every decoder has.
struct DecoderLayerShape {
  bool qk_norm = true;    // per-head q_norm and k_norm [head_dim] each (Qwen3)
  bool qkv_bias = false;  // biases of q, k and v [Hq*d], [Hkv*d], [Hkv*d] (Qwen2)
  bool sinks = false;     // attention sinks [Hq] (GPT-OSS)
  // Gemma's four norms a layer: two [H] more, the attention's output held before its norm, and the
  // MLP's output recomputed in the backward for its norm's.
  bool sandwich_norms = false;
};
// moe_tile_rows: the tokens a sparse layer runs at once (0: all of them).
void plan_dense_decoder(const PlanInputs& in, MemoryPlan& plan, const DenseDecoderAttention& attention = {},
                        int64_t moe_tile_rows = 0, const DecoderLayerShape& layer = {});

// Model::step_flops of a decoder of this layer shape: 6 per token for each GEMM weight a token
// meets (q, k, v, o, the biases, the dense MLP's or the router and its top-k experts', the
// head), plus per layer 6 * heads * head_dim per (query, key) pair: the QK^T and PV products
// (2 d FLOPs each per pair and head) over the causal square counted whole, x3 for the backward.
// With document bounds only each document's own square counts; a sliding_attention layer counts
// twice its window's pairs (lcx/attention_cost.h causal_pairs) in place of the square.
double decoder_step_flops(const ModelConfig& c, const DecoderLayerShape& layer, int64_t tokens,
                          std::span<const int64_t> document_bounds);

}  // namespace lcx::decoder
