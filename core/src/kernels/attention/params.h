// The parameters of lcx's own attention kernels (hopper/, mma/, reference/) and their launchers.
// The GPU attention entry points (launch_cuda.cpp) call a launcher only where dispatch.h said its
// backend serves the call, inside the call's `launch` (kernels/launch.h). Plain C++: the entry
// points are host code.
#pragma once
#include <cstdint>

#include "lcx/dtype.h"

namespace lcx::ops::cuda::attn {

struct Params {
  const void* q;
  const void* k;
  const void* v;
  const void* out;
  const void* dout;
  void* o;  // forward output, or dq in the dq pass
  void* dk;
  void* dv;
  DType tq, tk, tv, to, tdo, tdq, tdk, tdv;
  const float* lse_in;
  float* lse_out;
  float* delta;  // rowsum(dout * out), fp32 [Hq, T]
  int64_t T, S, Hq, Hkv, d;
  int64_t q_offset, k_offset;
  float scale;       // softmax scale
  float scale_log2;  // scale * log2(e): scores live in the exp2 domain
  bool causal;
  // > 0: query row i sees key j only where k_offset + j > q_offset + i - window (the sliding
  // window, W keys ending at the query's own position); 0: no window.
  int64_t window;
};

// hopper/forward_sm90a.cu: bf16, head_dim 128, on sm_90.
void hopper_forward(const Params& p);
// hopper/backward_sm90a.cu: its own per-row pass (the LSE and delta side by side) and fp32 dQ
// accumulator in `scratch`, hopper_backward_scratch bytes the caller allocates.
int64_t hopper_backward_scratch(int64_t T, int64_t Hq);
void hopper_backward(const Params& p, void* scratch);
// mma/forward.cu, mma/backward.cu: bf16 or fp16, head_dim 64, 128 or 256; the backward reads p.delta,
// which backward_delta fills.
void mma_forward(const Params& p);
void mma_backward(const Params& p);
// reference/forward.cu, reference/backward.cu: any float dtype, head_dim up to 128.
void reference_forward(const Params& p);
void reference_backward(const Params& p);
// p.delta = rowsum(dout * out), fp32 [Hq, T] (reference/backward.cu), for the mma and reference backwards.
void backward_delta(const Params& p);

}  // namespace lcx::ops::cuda::attn
