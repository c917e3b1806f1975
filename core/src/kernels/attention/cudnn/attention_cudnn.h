// Attention through cuDNN's fused flash kernels (cuDNN 9 backend graph API), forward with the
// log-sum-exp ("stats") output and backward: the `cudnn` backend of kernels/attention/dispatch.h,
// which calls in here where cuDNN serves the call by its rules; see attention_cudnn.cpp.
#pragma once
#include <string>

#include "kernels/launch.h"
#include "lcx/ops.h"

namespace lcx::cuda {

// The loaded cuDNN's version (e.g. "9.10.2"), or "" when libcudnn.so.9 could not be loaded.
std::string cudnn_version();

// true when the call ran on cuDNN (its workspace allocated, its work handed to `launch`); false,
// launching nothing, where cuDNN refused the call's plan (logged once a shape; an error under
// [run] attention = "cudnn"). The dispatch asks only where cuDNN's rules take the call.
bool cudnn_attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, Tensor& lse,
                             const ops::AttentionParams& p, ops::Launch launch);
bool cudnn_attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                              const Tensor& lse, const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv,
                              const ops::AttentionParams& p, ops::Launch launch);

// The workspace in bytes cuDNN asks of one attention call of this shape (`windowed`: under a window) (what execute() allocates
// beside the call's tensors); -1 when cuDNN is absent or refuses the shape. Builds and caches the
// plan the call would use; allocates no device memory. For the memory plan's checks.
int64_t cudnn_attention_workspace(bool backward, int64_t T, int64_t S, int64_t Hq, int64_t Hkv, int64_t d, DType t,
                                  bool causal, bool windowed = false);

// Batches of B documents (documents.cpp), each element padded to Sq query and Sk key
// rows, its first seq_q[b] queries and seq_kv[b] keys real; seq_q, seq_kv int32 [B] on the device,
// 16-byte aligned (the same table when queries and keys are the same rows); stats [B, Hq, Sq] fp32.
// Causal (p.causal, which needs Sq = Sk and equal lengths) within each element; with p.window > 0
// (causal only) the window too, counted from each element's first row (`windowed` in ready()).
// - Padded (q_offsets and k_offsets nullptr): q, out, dout, dq [B*Sq, Hq, d] and k, v, dk, dv
//   [B*Sk, Hkv, d], element b's rows one after another, the padded rows zero; their outputs are
//   meaningless.
// - Ragged: the elements read and written in place in the caller's unpadded tensors, q, out, dout,
//   dq [Tq, Hq, d] and k, v, dk, dv [Tk, Hkv, d], element b's rows from q_offsets[b] / (Hq d) and
//   k_offsets[b] / (Hkv d) (int64 [B+1] element offsets on the device, 16-byte aligned, ascending,
//   the last the end of the last element's real rows). Only the real rows are read into the result
//   and written: rows outside every element are left alone.
// ready() builds and caches the plan of (B, Sq, Sk) and says whether cuDNN takes it: false for a
// padded batch lets the own kernels run its documents; false for a ragged one lets padded copies
// run them (never an error, [run] attention = "cudnn" too, since they still run on cuDNN). False
// where the run's choice keeps cuDNN out. The calls need
// it to have said true.
bool cudnn_batch_attention_ready(bool backward, bool ragged, int64_t B, int64_t Sq, int64_t Sk, int64_t Hq,
                                 int64_t Hkv, int64_t d, DType t, bool causal, bool windowed = false);
void cudnn_batch_attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, Tensor& stats,
                                   const int32_t* seq_q, const int32_t* seq_kv, const int64_t* q_offsets,
                                   const int64_t* k_offsets, int64_t B, int64_t Sq, int64_t Sk,
                                   const ops::AttentionParams& p, ops::Launch launch);
void cudnn_batch_attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                                    const Tensor& stats, const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv,
                                    const int32_t* seq_q, const int32_t* seq_kv, const int64_t* q_offsets,
                                    const int64_t* k_offsets, int64_t B, int64_t Sq, int64_t Sk,
                                    const ops::AttentionParams& p, ops::Launch launch);
// Whether ready() may offer ragged plans (default true); false keeps documents on padded batches
// (tests of that fallback, and measuring what the ragged reads and writes save).
void set_cudnn_ragged_documents(bool on);

}  // namespace lcx::cuda
