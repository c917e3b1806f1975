// The CUDA twin of every op in lcx/ops.h, one signature each. ops.cpp checks shapes, dtypes and
// devices before calling in here (and turns a zero attention scale into 1/sqrt(d)), so these
// functions assume valid, contiguous device tensors.
// Storage is bf16 (fp16 and fp32 where the CPU reference accepts them), math is fp32; kernels run
// on lcx::cuda::current_stream() (core/src/cuda/stream.h).
#pragma once
#include <vector>

#include "kernels/attention/dispatch.h"
#include "kernels/launch.h"
#include "lcx/ops.h"

namespace lcx::ops::cuda {

void matmul(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, Tensor& c, float alpha, float beta);
void embedding_forward(const Tensor& ids, const Tensor& table, Tensor& out);
void embedding_backward(const Tensor& ids, const Tensor& grad_out, Tensor& grad_table);
void rmsnorm_forward(const Tensor& x, const Tensor& w, float eps, Tensor& y, Tensor& rstd);
void rmsnorm_backward(const Tensor& x, const Tensor& w, const Tensor& rstd, const Tensor& dy, Tensor& dx,
                      Tensor& dw);
void rotary_forward(Tensor& x, const Tensor& cos, const Tensor& sin);
void rotary_backward(Tensor& dx, const Tensor& cos, const Tensor& sin);
void swiglu_forward(const Tensor& gate, const Tensor& up, Tensor& out);
void swiglu_backward(const Tensor& gate, const Tensor& up, const Tensor& dout, Tensor& dgate, Tensor& dup);
void geglu_tanh_forward(const Tensor& gate, const Tensor& up, Tensor& out);
void geglu_tanh_backward(const Tensor& gate, const Tensor& up, const Tensor& dout, Tensor& dgate, Tensor& dup);
void rmsnorm_offset_forward(const Tensor& x, const Tensor& w, float offset, float eps, Tensor& y, Tensor& rstd);
void rmsnorm_offset_backward(const Tensor& x, const Tensor& w, float offset, const Tensor& rstd, const Tensor& dy,
                             Tensor& dx, Tensor& dw);
void swiglu_clamped_forward(const Tensor& gate_up, float alpha, float limit, Tensor& out);
void swiglu_clamped_backward(const Tensor& gate_up, const Tensor& dout, float alpha, float limit, Tensor& dgate_up);
void add(const Tensor& a, const Tensor& b, Tensor& out);
void add_inplace(Tensor& acc, const Tensor& x);
void scale_inplace(Tensor& x, float s);
void cast(const Tensor& src, Tensor& dst);
void dropout(const Tensor& x, float p, uint64_t key, const Tensor& rows, int64_t col0, Tensor& out, float beta);
void copy_columns(const Tensor& src, int64_t src_col, Tensor& dst, int64_t dst_col, int64_t cols);
void attention_sinks_forward(Tensor& out, Tensor& lse, const Tensor& sinks, int64_t head0);
void attention_sinks_backward(const Tensor& out, const Tensor& lse, const Tensor& dout, const Tensor& sinks,
                              int64_t head0, Tensor& dsinks);
void moe_route(const Tensor& logits, int64_t k, bool norm_topk, Tensor& weights, Tensor& experts, Tensor* probs);
void moe_permute(const Tensor& experts, int64_t num_experts, Tensor& order, Tensor& position, Tensor& offsets);
void gather_rows(const Tensor& x, const Tensor& rows, int64_t divide, Tensor& out);
void moe_combine(const Tensor& y, const Tensor& position, const Tensor& weights, Tensor& out);
void moe_combine_backward(const Tensor& dout, const Tensor& y, const Tensor& order, const Tensor& position,
                          const Tensor& weights, Tensor& dy, Tensor& dweights);
void moe_route_backward(const Tensor& probs, const Tensor& experts, const Tensor& weights, const Tensor& dweights,
                        bool norm_topk, const Tensor* aux_grad, Tensor& dlogits);
void grouped_matmul(const Tensor& x, const Tensor& w, bool trans_w, std::span<const int64_t> offsets, Tensor& y,
                    float alpha, float beta);
void grouped_matmul_wgrad(const Tensor& dy, const Tensor& x, std::span<const int64_t> offsets, Tensor& dw, float alpha,
                          float beta);
// dst.nbytes() bytes of host memory into dst, in order on the current stream. Unlike Tensor::to,
// whose synchronous copy waits for the whole device, the host goes on queueing work; `host` may
// be freed on return (pageable memory is staged before the call returns).
void upload(const void* host, Tensor& dst);
// The attention calls (kernels/attention/launch_cuda.cpp) allocate their scratch, then hand their
// kernels, copies and fills to `launch` (kernels/launch.h). The backend is the dispatch's
// (kernels/attention/dispatch.h) under the run's [run] attention.
void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, Tensor& lse,
                       const AttentionParams& p, Launch launch);
void attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                        const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv, const AttentionParams& p,
                        Launch launch);
// The same on lcx's own kernels, never cuDNN: for calls of many distinct lengths (one per packed
// document), for each of which cuDNN would build and cache a plan.
void attention_forward_own(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, Tensor& lse,
                           const AttentionParams& p, Launch launch);
void attention_backward_own(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                            const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv, const AttentionParams& p,
                            Launch launch);
// The current GPU as the attention backends judge it (capability, shared memory, cuDNN loaded).
attention::DeviceCaps attention_device_caps();
// Whether the Hopper backend (kernels/attention/hopper/) serves a forward of these tensors on the
// current device: bf16, head_dim 128, a compute capability 9.0 GPU.
bool attention_forward_hopper_applies(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out);
// Document-masked attention on cuDNN (kernels/attention/cudnn/documents.cpp): document i's query rows
// q_spans[i] of q meet its key rows k_spans[i] of k. Either each document's query and key spans
// are of one length at equal positions (causal as p says; the same rows of one tensor, or blocks of
// ops::attention_forward_blocks), or p is not causal and each document's attention is full (a
// ring's query chunk against an earlier key chunk, every key before every query). The documents run as
// padded batches; returns per document whether it ran (false where cuDNN is off, absent or refuses
// the shape: the caller runs that document on the own kernels). Lengths are positive.
struct DocumentSpan {
  int64_t begin, length;
  bool operator==(const DocumentSpan&) const = default;
};
std::vector<char> attention_forward_documents(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out,
                                              Tensor& lse, const AttentionParams& p,
                                              const std::vector<DocumentSpan>& q_spans,
                                              const std::vector<DocumentSpan>& k_spans, Launch launch);
std::vector<char> attention_backward_documents(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                                               const Tensor& lse, const Tensor& dout, Tensor& dq, Tensor& dk,
                                               Tensor& dv, const AttentionParams& p,
                                               const std::vector<DocumentSpan>& q_spans,
                                               const std::vector<DocumentSpan>& k_spans, Launch launch);
double cross_entropy_forward_backward(const Tensor& logits, const Tensor& targets, double grad_scale,
                                      Tensor* dlogits, int64_t* valid);
void cross_entropy_chunk(const Tensor& logits, const Tensor& targets, float grad_scale, Tensor& row_loss,
                         Tensor* dlogits);

}  // namespace lcx::ops::cuda
