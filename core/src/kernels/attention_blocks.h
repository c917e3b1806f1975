// The attention algorithms between the ops' checks (ops.cpp) and the kernels
// (attention_blocks.cpp). Arguments checked, params resolved (check_attention); the GPU work goes
// to `launch`, the installed attention table's (kernels/attention_table.h).
#pragma once
#include <span>

#include "kernels/launch.h"
#include "lcx/ops.h"

namespace lcx::ops {

#ifdef LCX_HAVE_CUDA
// The GPU backend's attention: per document under a mask, else cuDNN or the own kernels.
void gpu_attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, Tensor& lse,
                           const AttentionParams& p, Launch launch);
void gpu_attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                            const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv, const AttentionParams& p,
                            Launch launch);
#endif

// A block's params: no document mask, no offsets.
inline AttentionParams block_params(float scale, bool causal) {
  AttentionParams p;
  p.scale = scale;
  p.causal = causal;
  return p;
}

// The blocks (checked: inside q and k, no two sharing a row) on the GPU as cuDNN's document batches
// where it takes them, each other block a plain ops::attention_forward (_backward) on its rows, at
// `causal` as the caller asked; r: the call's resolved params.
void forward_blocks(bool cuda, const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, Tensor& lse,
                    const AttentionParams& r, bool causal, std::span<const AttentionBlock> blocks, Launch launch);
void backward_blocks(bool cuda, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                     const Tensor& lse, const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv,
                     const AttentionParams& r, bool causal, std::span<const AttentionBlock> blocks, Launch launch);

}  // namespace lcx::ops
