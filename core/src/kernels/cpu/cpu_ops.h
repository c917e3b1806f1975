// The CPU reference of every op in lcx/ops.h, plus the small helpers its files share.
// ops.cpp checks shapes, dtypes and devices before calling in here, so these functions assume
// valid, contiguous, host tensors. Math is fp32 whatever the storage dtype: rows are widened to
// fp32 scratch, computed, and rounded back on store (round to nearest even, as torch does).
#pragma once
#include <algorithm>
#include <cstdint>
#include <thread>
#include <vector>

#include "lcx/ops.h"

namespace lcx::ops::cpu {

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
void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, Tensor& lse,
                       const AttentionParams& p);
void attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                        const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv, const AttentionParams& p);
// Row t of the logits: returns its loss (0 when target < 0, ignored) and, when dlogits is given,
// writes grad_scale * (softmax - onehot) (zeros when ignored) into its row t. `x` is V floats of
// scratch, so dlogits may be the logits themselves. Both cross entropies below are this per row.
double cross_entropy_row(const Tensor& logits, int64_t t, int64_t target, double grad_scale, Tensor* dlogits,
                         std::vector<float>& x);
double cross_entropy_forward_backward(const Tensor& logits, const Tensor& targets, double grad_scale,
                                      Tensor* dlogits, int64_t* valid);
void cross_entropy_chunk(const Tensor& logits, const Tensor& targets, float grad_scale, Tensor& row_loss,
                         Tensor* dlogits);

// n elements starting at element `offset` of a float tensor, widened to fp32.
inline void load_f32(const Tensor& t, int64_t offset, int64_t n, float* dst) {
  switch (t.dtype()) {
    case DType::f32: std::copy_n(t.data_as<const float>() + offset, n, dst); break;
    case DType::bf16: {
      const bf16* s = t.data_as<const bf16>() + offset;
      for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_float(s[i]);
      break;
    }
    case DType::f16: {
      const f16* s = t.data_as<const f16>() + offset;
      for (int64_t i = 0; i < n; ++i) dst[i] = f16_to_float(s[i]);
      break;
    }
    default: LCX_CHECK(false, "load_f32 on ", dtype_name(t.dtype()));
  }
}

// n fp32 values into a float tensor at element `offset`, rounded to its dtype.
inline void store_f32(const float* src, int64_t n, Tensor& t, int64_t offset) {
  switch (t.dtype()) {
    case DType::f32: std::copy_n(src, n, t.data_as<float>() + offset); break;
    case DType::bf16: {
      bf16* d = t.data_as<bf16>() + offset;
      for (int64_t i = 0; i < n; ++i) d[i] = float_to_bf16(src[i]);
      break;
    }
    case DType::f16: {
      f16* d = t.data_as<f16>() + offset;
      for (int64_t i = 0; i < n; ++i) d[i] = float_to_f16(src[i]);
      break;
    }
    default: LCX_CHECK(false, "store_f32 on ", dtype_name(t.dtype()));
  }
}

// The value v takes once stored in dtype t: what torch's intermediate casts do.
inline float round_to(DType t, float v) {
  switch (t) {
    case DType::bf16: return bf16_to_float(float_to_bf16(v));
    case DType::f16: return f16_to_float(float_to_f16(v));
    default: return v;
  }
}

inline std::vector<float> to_f32(const Tensor& t) {
  std::vector<float> v(static_cast<size_t>(t.numel()));
  load_f32(t, 0, t.numel(), v.data());
  return v;
}

// Runs fn(task) for task in [0, n) on a few threads (tests share two cores; more buys nothing for
// a reference). fn must only write memory that its task owns.
template <typename Fn>
void parallel_tasks(int64_t n, Fn fn) {
  const int64_t hw = std::max<int64_t>(1, std::thread::hardware_concurrency());
  const int64_t workers = std::min<int64_t>({n, hw, 4});
  if (workers <= 1) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  std::vector<std::thread> pool;
  for (int64_t w = 0; w < workers; ++w)
    pool.emplace_back([&, w] {
      for (int64_t i = w; i < n; i += workers) fn(i);
    });
  for (auto& t : pool) t.join();
}

}  // namespace lcx::ops::cpu
