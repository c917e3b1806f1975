// The one elementwise op ring attention needs beyond lcx/ops.h: folding a block's partial
// attention into the running result by log-sum-exp, in fp32,
//   lse = log(e^lse_acc + e^lse_blk),  out = e^(lse_acc - lse) out_acc + e^(lse_blk - lse) out_blk.
// A CPU loop here and a CUDA kernel in ring_merge.cu (CUDA builds), dispatched on the device.
#pragma once
#include <lcx/tensor.h>

namespace lcx::cp_ring {

// Folds a block's result into query rows [row0, row0 + n) of the running one.
//   acc_out fp32 [T,H,d], acc_lse fp32 [H,T]; blk_out [n,H,d] any float dtype, blk_lse fp32 [H,n].
// first: those rows have no result yet, so the block's is copied (acc needs no initial fill).
void merge_partial(Tensor& acc_out, Tensor& acc_lse, int64_t row0, const Tensor& blk_out, const Tensor& blk_lse,
                   bool first);

#ifdef LCX_CP_RING_CUDA
void merge_partial_cuda(Tensor& acc_out, Tensor& acc_lse, int64_t row0, const Tensor& blk_out, const Tensor& blk_lse,
                        bool first);
#endif

}  // namespace lcx::cp_ring
