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

// The same for rows [row0, row0 + n) of a block's result laid out like the running one (blk_out
// [T,H,d], blk_lse [H,T]: one call of ops::attention_forward_blocks wrote them among other rows).
void merge_rows(Tensor& acc_out, Tensor& acc_lse, const Tensor& blk_out, const Tensor& blk_lse, int64_t row0,
                int64_t n, bool first);

// Rows [row0, row0 + n) of the running result from rows [blk_row0, blk_row0 + n) of a block's,
// whose LSE has blk_T columns.
struct MergeRows {
  int64_t row0, blk_row0, blk_T, n;
  bool first;
};
#ifdef LCX_CP_RING_CUDA
void merge_cuda(Tensor& acc_out, Tensor& acc_lse, const Tensor& blk_out, const Tensor& blk_lse, const MergeRows& m);
#endif

}  // namespace lcx::cp_ring
