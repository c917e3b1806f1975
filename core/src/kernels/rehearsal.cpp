// The rehearsal's attention (lcx-train --rehearse): each call runs the computing path's allocations
// (cuDNN's workspace and accumulators, the document batches' tables and padded copies, the own
// kernels' scratch) with a launch that drops the work, then writes zeros to its outputs. On the
// CPU nothing is allocated, so only the zeros are written.
#include <functional>

#include "kernels/attention_blocks.h"
#include "kernels/attention_table.h"

namespace lcx::ops {
namespace {

void drop_work(const std::function<void()>&) {}

void rehearse_forward(bool cuda, const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, Tensor& lse,
                      const AttentionParams& p) {
#ifdef LCX_HAVE_CUDA
  if (cuda) gpu_attention_forward(q, k, v, out, lse, p, drop_work);
#else
  (void)cuda, (void)q, (void)k, (void)v, (void)p;
#endif
  out.zero();
  lse.zero();
}

void rehearse_backward(bool cuda, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                       const Tensor& lse, const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv,
                       const AttentionParams& p) {
#ifdef LCX_HAVE_CUDA
  if (cuda) gpu_attention_backward(q, k, v, out, lse, dout, dq, dk, dv, p, drop_work);
#else
  (void)cuda, (void)q, (void)k, (void)v, (void)out, (void)lse, (void)dout, (void)p;
#endif
  dq.zero();
  dk.zero();
  dv.zero();
}

const AttentionTable kRehearsal{rehearse_forward, rehearse_backward, drop_work};

}  // namespace

const AttentionTable& rehearsal_attention() { return kRehearsal; }

}  // namespace lcx::ops
