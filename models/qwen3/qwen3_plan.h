// The Qwen3 dense decoder's memory (RMSNorm, GQA attention with q/k norms, SwiGLU MLP) as core's
// step runs this module: parameters and their optimizer state, one layer's forward and its
// recompute + backward. The module's plan() (lcx/plan.h) calls it with its head groups.
#pragma once
#include <cstdint>

#include "lcx/plan.h"

namespace lcx::qwen3 {

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
// moe_tile_rows: the tokens a sparse layer runs at once (0: all of them).
void plan_dense_decoder(const PlanInputs& in, MemoryPlan& plan, const DenseDecoderAttention& attention = {},
                        int64_t moe_tile_rows = 0);

}  // namespace lcx::qwen3
