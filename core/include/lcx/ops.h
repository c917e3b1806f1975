// The ops every backend provides with one signature. Each dispatches on the tensors' device to
// a CPU reference (fp32 math, plain loops, BLAS for GEMM) or a CUDA kernel (bf16 storage, fp32
// accumulation). Layouts are row-major and contiguous; shapes are checked and named on mismatch.
#pragma once
#include <span>

#include "lcx/tensor.h"

namespace lcx::ops {

// c = alpha * op(a) @ op(b) + beta * c, a [M,K] (or [K,M] when trans_a), b [K,N] (or [N,K]).
void matmul(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, Tensor& c,
            float alpha = 1.f, float beta = 0.f);

// ids int32 [T], table [V,H] -> out [T,H]; backward accumulates into grad_table (fp32).
void embedding_forward(const Tensor& ids, const Tensor& table, Tensor& out);
void embedding_backward(const Tensor& ids, const Tensor& grad_out, Tensor& grad_table);

// Over the last dimension: y = cast(x * rstd) * w, as transformers' Qwen3RMSNorm. rstd fp32
// [rows]. Backward writes dx and accumulates dw (fp32). Per-head norms pass x as [T*heads, d].
void rmsnorm_forward(const Tensor& x, const Tensor& w, float eps, Tensor& y, Tensor& rstd);
void rmsnorm_backward(const Tensor& x, const Tensor& w, const Tensor& rstd, const Tensor& dy,
                      Tensor& dx, Tensor& dw);

// Over the last dimension with the weight read as (offset + w): y = cast(x * rstd * (offset + w))
// computed in fp32 and rounded once, as transformers' Gemma3RMSNorm (offset 1: weights stored
// around 0). Backward writes dx and accumulates dw += dy * x * rstd (fp32).
void rmsnorm_offset_forward(const Tensor& x, const Tensor& w, float offset, float eps, Tensor& y, Tensor& rstd);
void rmsnorm_offset_backward(const Tensor& x, const Tensor& w, float offset, const Tensor& rstd, const Tensor& dy,
                             Tensor& dx, Tensor& dw);

// x [T,heads,d] in place, rotate-half convention; cos/sin fp32 [T, d/2].
void rotary_forward(Tensor& x, const Tensor& cos, const Tensor& sin);
void rotary_backward(Tensor& dx, const Tensor& cos, const Tensor& sin);

// out = silu(gate) * up; backward writes dgate, dup.
void swiglu_forward(const Tensor& gate, const Tensor& up, Tensor& out);
void swiglu_backward(const Tensor& gate, const Tensor& up, const Tensor& dout, Tensor& dgate,
                     Tensor& dup);
// GPT-OSS's clamped SwiGLU over gate and up interleaved in one row (gate_up [N,2I]: gate the even
// columns, up the odd ones): g = min(gate, limit), u = clamp(up, -limit, limit),
// out [N,I] = (u + 1) * g * sigmoid(alpha * g). The backward writes dgate_up [N,2I] (zero where a
// clamp held the value, as torch's clamp passes no gradient outside its range).
void swiglu_clamped_forward(const Tensor& gate_up, float alpha, float limit, Tensor& out);
void swiglu_clamped_backward(const Tensor& gate_up, const Tensor& dout, float alpha, float limit, Tensor& dgate_up);

// out = gelu_tanh(gate) * up, gelu_tanh(g) = 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))) (torch's
// gelu with approximate="tanh", transformers' gelu_pytorch_tanh); backward writes dgate, dup.
void geglu_tanh_forward(const Tensor& gate, const Tensor& up, Tensor& out);
void geglu_tanh_backward(const Tensor& gate, const Tensor& up, const Tensor& dout, Tensor& dgate,
                         Tensor& dup);
// The gated MLP's activation: silu (SwiGLU) or gelu_tanh (GeGLU), and the ops computing it.
enum class GateActivation : uint8_t { silu, gelu_tanh };
void gated_forward(GateActivation act, const Tensor& gate, const Tensor& up, Tensor& out);
void gated_backward(GateActivation act, const Tensor& gate, const Tensor& up, const Tensor& dout, Tensor& dgate,
                    Tensor& dup);

void add(const Tensor& a, const Tensor& b, Tensor& out);  // out may alias a or b
void add_inplace(Tensor& acc, const Tensor& x);             // acc += x (any float dtypes)
void scale_inplace(Tensor& x, float s);
void cast(const Tensor& src, Tensor& dst);  // between float dtypes, same shape
// dst[:, dst_col : dst_col + cols] = src[:, src_col : src_col + cols] over 2-D views (leading
// dimensions folded into rows) of one dtype and one row count: a block of columns, such as one head
// group's columns of a projection weight, gathered into or scattered from a contiguous tensor.
void copy_columns(const Tensor& src, int64_t src_col, Tensor& dst, int64_t dst_col, int64_t cols);
// Inverted dropout over x [n, cols]: out = beta * out + x * keep / (1 - p), keep(rows[i], col0 + j)
// with rows int64 [n] on x's device (each row's index in its sequence: a tile's or a rank's rows
// draw what the whole sequence's would), or i where rows is undefined, and col0 + cols <= 2^20 (x
// may be a block of a wider matrix's columns, as a head group's are); drawn from `key` by a counter-based hash (kernels/dropout_mask.h), the same
// bits on every backend and every call: a recompute or a backward draws the forward's mask again
// with nothing stored. In fp32, rounded once; beta 0 writes out without reading it. out may be x.
void dropout(const Tensor& x, float p, uint64_t key, const Tensor& rows, int64_t col0, Tensor& out, float beta = 0.f);

// Attention on q [T,Hq,d], k,v [S,Hkv,d] (GQA: Hq % Hkv == 0). Query row i sits at position
// q_offset + i and key j at k_offset + j; with causal, a query sees keys at positions <= its own.
// out [T,Hq,d]; lse fp32 [Hq,T] natural log (-inf for a row that sees nothing). Blockwise with a
// running log-sum-exp: never an T x S matrix.
// With documents (cumulative bounds {0, ..., L} over the same positions), a query sees only keys
// of its own document: work goes with the sum of the documents' squared lengths.
struct AttentionParams {
  float scale = 0;
  bool causal = true;
  int64_t q_offset = 0;
  int64_t k_offset = 0;
  std::span<const int64_t> documents;  // empty: one document
  // > 0 (causal only): a query at position p sees only keys at positions > p - window (W keys,
  // itself included), as transformers' sliding_attention layers mask; with documents, both.
  int64_t window = 0;
};
void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, Tensor& lse,
                       const AttentionParams& p);
// Writes dq, dk, dv.
void attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                        const Tensor& lse, const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv,
                        const AttentionParams& p);

// Learned attention sinks (GPT-OSS): one logit s_h per query head joins every row's softmax
// denominator with a zero value vector. After attention_forward's out and lse (over all the keys:
// after a ring's merge), in place: lse' = logaddexp(lse, s_h), out' = out * exp(lse - lse'). Heads
// [0, H) of out [T,H,d] and lse fp32 [H,T] take sinks[head0 + h] (a head group's, an sp rank's);
// sinks [>= head0 + H] of any float dtype. The attention backward given out' and lse' is then the
// sinks' exact backward for q, k and v (the sink's value is zero); attention_sinks_backward adds
// dsinks[head0 + h] -= sum over rows i of exp(s_h - lse'_i) * dot(dout_i, out'_i) into dsinks fp32.
void attention_sinks_forward(Tensor& out, Tensor& lse, const Tensor& sinks, int64_t head0);
void attention_sinks_backward(const Tensor& out, const Tensor& lse, const Tensor& dout, const Tensor& sinks,
                              int64_t head0, Tensor& dsinks);

// Attention of separate blocks in one call (a ring step's chunk pairs under document masks): block
// i's query rows [q_begin, q_begin + q_rows) of q see its key rows [k_begin, k_begin + k_rows) of
// k, all of them, or with causal (then q_rows == k_rows, the two at equal positions) those at or
// before their own. No two blocks share a query row or a key row. Writes out and lse only on the
// blocks' query rows (the backward: dq on their query rows, dk and dv on their key rows); every
// other row is left as it was. On the GPU the blocks run batched like document masks, a few calls
// however many blocks (lcx/attention_cost.h attention_work counts them).
struct AttentionBlock {
  int64_t q_begin = 0, q_rows = 0, k_begin = 0, k_rows = 0;
};
void attention_forward_blocks(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, Tensor& lse,
                              float scale, bool causal, std::span<const AttentionBlock> blocks);
void attention_backward_blocks(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                               const Tensor& lse, const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv, float scale,
                               bool causal, std::span<const AttentionBlock> blocks);

// Cross entropy over rows of logits [T,V] (fp32 math) against targets int64 [T] (-100 ignored).
// Returns the loss sum; writes dlogits = grad_scale * (softmax - onehot) for valid rows, 0 else.
double cross_entropy_forward_backward(const Tensor& logits, const Tensor& targets, double grad_scale,
                                      Tensor* dlogits, int64_t* valid);

// One chunk of a chunked loss, fused and with no host sync: rows of logits fp32 [n,V] against
// targets int64 [n] (-100 ignored). Writes each row's loss (log-sum-exp minus the target logit, 0
// when ignored) into row_loss fp32 [n]: a slice of a per-token buffer that stays on the device
// until the caller sums it once. With dlogits, writes grad_scale * (softmax - onehot), 0 for
// ignored rows: fp32 dlogits may be the logits themselves (in place); bf16/fp16 dlogits receive
// the rounded gradient directly, ready for the GEMMs against the head.
void cross_entropy_chunk(const Tensor& logits, const Tensor& targets, float grad_scale, Tensor& row_loss,
                         Tensor* dlogits);


// Mixture-of-experts routing as transformers' Qwen3MoeSparseMoeBlock computes it: the softmax of
// the router logits [T,E] (any float dtype) in fp32, its k largest per row (descending, ties to the
// lower expert), renormalized to sum 1 when norm_topk. Writes weights fp32 [T,k], experts int32
// [T,k] and, when given, probs fp32 [T,E] (the whole softmax, which the load-balancing loss reads).
void moe_route(const Tensor& logits, int64_t k, bool norm_topk, Tensor& weights, Tensor& experts, Tensor* probs);
// The T*k (token, choice) slots (slot s = t*k + j) sorted by expert, stably (slot order within an
// expert), the same on every backend: order int32 [T*k] is the slot at each sorted place,
// position int32 [T*k] the sorted place of each slot (order's inverse), offsets int64 [E+1] where
// each expert's rows begin (offsets[E] = T*k). No expert is dropped, however many rows it gets.
void moe_permute(const Tensor& experts, int64_t num_experts, Tensor& order, Tensor& position, Tensor& offsets);
// out[i] = x[rows[i] / divide] over x [T,H], rows int32 [N], out [N,H] of x's dtype (bytes only);
// with moe_permute's order and divide = k, each expert's tokens in sorted order.
void gather_rows(const Tensor& x, const Tensor& rows, int64_t divide, Tensor& out);
// out[t] = sum over j of weights[t,j] * y[position[t*k + j]], in fp32, rounded once: y [T*k,H] the
// experts' outputs in sorted order, position int32 [T*k] (moe_permute's), weights fp32 [T,k],
// out [T,H]. Each row sums its own k terms in order: no atomics, the same bits every run.
void moe_combine(const Tensor& y, const Tensor& position, const Tensor& weights, Tensor& out);
// The backward of moe_combine: dy[i] = w[s] * dout[s / k] for the slot s = order[i] at sorted
// place i (dy [T*k,H] in y's sorted order), dweights[s] = dot(dout[s / k], y[position[s]]) in fp32.
// The input's gradient through gather_rows is moe_combine of the experts' input gradients with
// unit weights.
void moe_combine_backward(const Tensor& dout, const Tensor& y, const Tensor& order, const Tensor& position,
                          const Tensor& weights, Tensor& dy, Tensor& dweights);
// The backward of moe_route from the gradient of its weights (dweights fp32 [T,k]) and, when
// given, aux_grad fp32 [E]: a gradient added to every token's whole-softmax probability of expert e
// (the load-balancing loss's, already scaled). Through the renormalization (norm_topk), the top-k
// pick and the softmax; writes dlogits [T,E] (any float dtype). probs, experts and weights are
// moe_route's outputs.
void moe_route_backward(const Tensor& probs, const Tensor& experts, const Tensor& weights, const Tensor& dweights,
                        bool norm_topk, const Tensor* aux_grad, Tensor& dlogits);

// The experts' GEMMs over the sorted rows. Rows of x [N,K] in groups (group g: rows [offsets[g],
// offsets[g+1]), offsets on the host, G+1 entries from 0 to N, as moe_permute's offsets once copied
// to the host), each multiplied by its own matrix: y[rows of g] = alpha * x[rows of g] @ op(w[g]) +
// beta * y[rows of g], w [G,Nout,K] when trans_w (the experts' [out,in] weights: the forward), else
// [G,K,Nout] (the same weights give the input's gradient); w of x's dtype, y [N,Nout] of x's dtype
// or fp32. A group with no rows writes nothing. One call for all groups on the GPU: no host loop over
// groups. On the GPU, 16-bit rows must start 16-byte aligned (K and Nout multiples of 8).
void grouped_matmul(const Tensor& x, const Tensor& w, bool trans_w, std::span<const int64_t> offsets, Tensor& y,
                    float alpha = 1.f, float beta = 0.f);
// The weights' gradient of grouped_matmul with trans_w: dw[g] = alpha * dy[rows of g]^T @ x[rows of g]
// + beta * dw[g], dy [N,Nout], x [N,K] of one dtype, dw [G,Nout,K] fp32 or the operands' dtype
// (beta = 1 accumulates a step's microbatches in fp32); a group with no rows gets beta * dw[g] (0 when
// beta is 0).
void grouped_matmul_wgrad(const Tensor& dy, const Tensor& x, std::span<const int64_t> offsets, Tensor& dw,
                          float alpha = 1.f, float beta = 1.f);

}  // namespace lcx::ops
