// The op dispatch: every op checks its arguments here once (dtypes, shapes, one common device),
// naming the op, the argument and the shapes involved, then routes to the CPU reference
// (kernels/cpu) or, in a CUDA build, to the CUDA kernels (kernels/cuda). Both backends may
// therefore assume valid tensors. Values that cost a pass over the data (token ids, targets) are
// range-checked only on the CPU; the CUDA kernels guard their own reads. Each op runs inside a
// ProfileScope of its kind, so a profiled step (lcx/profile.h) times every op, the model's and the
// plugins' alike. Attention goes through the table the run installed (kernels/attention_table.h);
// the algorithms above its kernels (documents, blocks) are in attention_blocks.cpp.
#include "lcx/ops.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <functional>
#include <initializer_list>
#include <span>
#include <utility>
#include <vector>

#include "kernels/attention_blocks.h"
#include "kernels/attention_table.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/dropout_mask.h"
#include "kernels/grouped_gemm_choice.h"
#include "lcx/profile.h"
#ifdef LCX_HAVE_CUDA
#include "kernels/cuda/cuda_ops.h"
#endif

namespace lcx::ops {
namespace {

using Arg = std::pair<const char*, const Tensor*>;

[[noreturn]] void fail(const char* op, const std::string& what, const std::string& fix = {}) {
  throw Error(str(op, ": ", what), {}, fix);
}

std::string desc(const char* name, const Tensor& t) {
  return str(name, " ", dtype_name(t.dtype()), shape_str(t.shape()));
}

// All tensors defined and on one device; true when that device is a GPU this build can use.
bool on_cuda(const char* op, std::initializer_list<Arg> args) {
  const Arg& first = *args.begin();
  for (const Arg& a : args) {
    if (!a.second->defined()) fail(op, str("argument ", a.first, " is an undefined tensor"));
    if (a.second->device() != first.second->device())
      fail(op, str(a.first, " is on ", device_name(a.second->device()), " but ", first.first, " is on ",
                   device_name(first.second->device())),
           "move all arguments of one op to the same device");
  }
  const bool cuda = first.second->device().is_cuda();
#ifndef LCX_HAVE_CUDA
  if (cuda)
    fail(op, str(first.first, " is on ", device_name(first.second->device()), " but this build has no CUDA backend"),
         "rebuild where nvcc, cuDNN and NCCL are found, or keep tensors on the CPU");
#endif
  return cuda;
}

void need_float(const char* op, const char* name, const Tensor& t) {
  if (!is_floating(t.dtype()))
    fail(op, str(desc(name, t), " must be a float tensor (bf16, fp16 or fp32)"));
}
void need_dtype(const char* op, const char* name, const Tensor& t, DType want) {
  if (t.dtype() != want) fail(op, str(desc(name, t), " must be ", dtype_name(want)));
}
void need_dim(const char* op, const char* name, const Tensor& t, int64_t dims) {
  if (t.dim() != dims) fail(op, str(desc(name, t), " must have ", dims, " dimensions"));
}
// t must have shape `want`, which follows from `from` (named in the message).
void need_shape(const char* op, const char* name, const Tensor& t, const Shape& want, const char* from_name,
                const Tensor& from) {
  if (t.shape() != want)
    fail(op, str(desc(name, t), " must have shape ", shape_str(want), " to match ", desc(from_name, from)));
}
void need_same_shape(const char* op, const char* name, const Tensor& t, const char* other_name,
                     const Tensor& other) {
  need_shape(op, name, t, other.shape(), other_name, other);
}

// Product of all but the last dimension: the rows an op sees when it works along the last one.
int64_t rows_of(const Tensor& t) {
  int64_t r = 1;
  for (int64_t i = 0; i + 1 < t.dim(); ++i) r *= t.size(i);
  return r;
}

}  // namespace

// One call on the chosen backend. Without CUDA, on_cuda() has already refused device tensors.
#ifdef LCX_HAVE_CUDA
#define LCX_ROUTE(cuda_on, fn, ...) return (cuda_on) ? cuda::fn(__VA_ARGS__) : cpu::fn(__VA_ARGS__)
#else
#define LCX_ROUTE(cuda_on, fn, ...) return ((void)(cuda_on), cpu::fn(__VA_ARGS__))
#endif

void matmul(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, Tensor& c, float alpha, float beta) {
  const char* op = "matmul";
  const bool cuda = on_cuda(op, {{"a", &a}, {"b", &b}, {"c", &c}});
  for (Arg x : {Arg{"a", &a}, Arg{"b", &b}, Arg{"c", &c}}) {
    need_float(op, x.first, *x.second);
    if (x.second->dim() < 1) fail(op, str(desc(x.first, *x.second), " must have at least one dimension"));
  }
  // Leading dimensions fold into rows: an [T,heads,d] activation is a [T*heads, d] matrix.
  const int64_t ar = rows_of(a), ac = a.size(-1), br = rows_of(b), bc = b.size(-1);
  const int64_t M = trans_a ? ac : ar, K = trans_a ? ar : ac;
  const int64_t Kb = trans_b ? bc : br, N = trans_b ? br : bc;
  if (K != Kb)
    fail(op, str("inner dimensions differ: ", desc("a", a), trans_a ? " transposed" : "", " has K=", K, ", ",
                 desc("b", b), trans_b ? " transposed" : "", " has K=", Kb));
  if (rows_of(c) != M || c.size(-1) != N)
    fail(op, str(desc("c", c), " must be [", M, ",", N, "] for ", desc("a", a), trans_a ? " transposed" : "",
                 " and ", desc("b", b), trans_b ? " transposed" : ""));
  constexpr int64_t kIntMax = 2147483647;
  if (M > kIntMax || N > kIntMax || K > kIntMax || ac > kIntMax || bc > kIntMax)
    fail(op, str("dimensions of ", desc("a", a), " and ", desc("b", b), " exceed the 32-bit BLAS range"));
  ProfileScope scope(OpKind::gemm, op);
  if (scope.recording()) scope.detail(str("M=", M, " N=", N, " K=", K, " ", dtype_name(a.dtype())));
  LCX_ROUTE(cuda, matmul, a, trans_a, b, trans_b, c, alpha, beta);
}

void embedding_forward(const Tensor& ids, const Tensor& table, Tensor& out) {
  const char* op = "embedding_forward";
  const bool cuda = on_cuda(op, {{"ids", &ids}, {"table", &table}, {"out", &out}});
  need_dtype(op, "ids", ids, DType::i32);
  need_dim(op, "ids", ids, 1);
  need_float(op, "table", table);
  need_dim(op, "table", table, 2);
  need_float(op, "out", out);
  need_shape(op, "out", out, {ids.size(0), table.size(1)}, "table", table);
  if (!cuda) {
    const int32_t* id = ids.data_as<const int32_t>();
    for (int64_t t = 0; t < ids.numel(); ++t)
      if (id[t] < 0 || id[t] >= table.size(0))
        fail(op, str("token id ", id[t], " at position ", t, " is outside ", desc("table", table)),
             "check that the tokenizer and the model's vocabulary agree");
  }
  ProfileScope scope(OpKind::embedding, op);
  LCX_ROUTE(cuda, embedding_forward, ids, table, out);
}

void embedding_backward(const Tensor& ids, const Tensor& grad_out, Tensor& grad_table) {
  const char* op = "embedding_backward";
  const bool cuda = on_cuda(op, {{"ids", &ids}, {"grad_out", &grad_out}, {"grad_table", &grad_table}});
  need_dtype(op, "ids", ids, DType::i32);
  need_dim(op, "ids", ids, 1);
  need_dtype(op, "grad_table", grad_table, DType::f32);
  need_dim(op, "grad_table", grad_table, 2);
  need_float(op, "grad_out", grad_out);
  need_shape(op, "grad_out", grad_out, {ids.size(0), grad_table.size(1)}, "grad_table", grad_table);
  if (!cuda) {
    const int32_t* id = ids.data_as<const int32_t>();
    for (int64_t t = 0; t < ids.numel(); ++t)
      if (id[t] < 0 || id[t] >= grad_table.size(0))
        fail(op, str("token id ", id[t], " at position ", t, " is outside ", desc("grad_table", grad_table)));
  }
  ProfileScope scope(OpKind::embedding, op);
  LCX_ROUTE(cuda, embedding_backward, ids, grad_out, grad_table);
}

namespace {
void check_rmsnorm(const char* op, const Tensor& x, const Tensor& w, const Tensor& rstd) {
  need_float(op, "x", x);
  if (x.dim() < 1) fail(op, str(desc("x", x), " must have at least one dimension"));
  need_float(op, "w", w);
  need_shape(op, "w", w, {x.size(-1)}, "x", x);
  need_dtype(op, "rstd", rstd, DType::f32);
  if (rstd.numel() != rows_of(x))
    fail(op, str(desc("rstd", rstd), " must hold one value per row (", rows_of(x), ") of ", desc("x", x)));
}
}  // namespace

void rmsnorm_forward(const Tensor& x, const Tensor& w, float eps, Tensor& y, Tensor& rstd) {
  const char* op = "rmsnorm_forward";
  const bool cuda = on_cuda(op, {{"x", &x}, {"w", &w}, {"y", &y}, {"rstd", &rstd}});
  check_rmsnorm(op, x, w, rstd);
  need_float(op, "y", y);
  need_same_shape(op, "y", y, "x", x);
  ProfileScope scope(OpKind::norm, op);
  LCX_ROUTE(cuda, rmsnorm_forward, x, w, eps, y, rstd);
}

void rmsnorm_backward(const Tensor& x, const Tensor& w, const Tensor& rstd, const Tensor& dy, Tensor& dx,
                      Tensor& dw) {
  const char* op = "rmsnorm_backward";
  const bool cuda = on_cuda(op, {{"x", &x}, {"w", &w}, {"rstd", &rstd}, {"dy", &dy}, {"dx", &dx}, {"dw", &dw}});
  check_rmsnorm(op, x, w, rstd);
  need_float(op, "dy", dy);
  need_same_shape(op, "dy", dy, "x", x);
  need_float(op, "dx", dx);
  need_same_shape(op, "dx", dx, "x", x);
  need_dtype(op, "dw", dw, DType::f32);
  need_same_shape(op, "dw", dw, "w", w);
  ProfileScope scope(OpKind::norm, op);
  LCX_ROUTE(cuda, rmsnorm_backward, x, w, rstd, dy, dx, dw);
}

void rmsnorm_offset_forward(const Tensor& x, const Tensor& w, float offset, float eps, Tensor& y, Tensor& rstd) {
  const char* op = "rmsnorm_offset_forward";
  const bool cuda = on_cuda(op, {{"x", &x}, {"w", &w}, {"y", &y}, {"rstd", &rstd}});
  check_rmsnorm(op, x, w, rstd);
  need_float(op, "y", y);
  need_same_shape(op, "y", y, "x", x);
  ProfileScope scope(OpKind::norm, op);
  LCX_ROUTE(cuda, rmsnorm_offset_forward, x, w, offset, eps, y, rstd);
}

void rmsnorm_offset_backward(const Tensor& x, const Tensor& w, float offset, const Tensor& rstd, const Tensor& dy,
                             Tensor& dx, Tensor& dw) {
  const char* op = "rmsnorm_offset_backward";
  const bool cuda = on_cuda(op, {{"x", &x}, {"w", &w}, {"rstd", &rstd}, {"dy", &dy}, {"dx", &dx}, {"dw", &dw}});
  check_rmsnorm(op, x, w, rstd);
  need_float(op, "dy", dy);
  need_same_shape(op, "dy", dy, "x", x);
  need_float(op, "dx", dx);
  need_same_shape(op, "dx", dx, "x", x);
  need_dtype(op, "dw", dw, DType::f32);
  need_same_shape(op, "dw", dw, "w", w);
  ProfileScope scope(OpKind::norm, op);
  LCX_ROUTE(cuda, rmsnorm_offset_backward, x, w, offset, rstd, dy, dx, dw);
}

namespace {
void check_rotary(const char* op, const char* name, const Tensor& x, const Tensor& cos, const Tensor& sin) {
  need_float(op, name, x);
  need_dim(op, name, x, 3);
  if (x.size(2) % 2 != 0) fail(op, str(desc(name, x), " needs an even head dimension"));
  need_dtype(op, "cos", cos, DType::f32);
  need_dtype(op, "sin", sin, DType::f32);
  need_shape(op, "cos", cos, {x.size(0), x.size(2) / 2}, name, x);
  need_shape(op, "sin", sin, {x.size(0), x.size(2) / 2}, name, x);
}
}  // namespace

void rotary_forward(Tensor& x, const Tensor& cos, const Tensor& sin) {
  const char* op = "rotary_forward";
  const bool cuda = on_cuda(op, {{"x", &x}, {"cos", &cos}, {"sin", &sin}});
  check_rotary(op, "x", x, cos, sin);
  ProfileScope scope(OpKind::rotary, op);
  LCX_ROUTE(cuda, rotary_forward, x, cos, sin);
}

void rotary_backward(Tensor& dx, const Tensor& cos, const Tensor& sin) {
  const char* op = "rotary_backward";
  const bool cuda = on_cuda(op, {{"dx", &dx}, {"cos", &cos}, {"sin", &sin}});
  check_rotary(op, "dx", dx, cos, sin);
  ProfileScope scope(OpKind::rotary, op);
  LCX_ROUTE(cuda, rotary_backward, dx, cos, sin);
}

void swiglu_forward(const Tensor& gate, const Tensor& up, Tensor& out) {
  const char* op = "swiglu_forward";
  const bool cuda = on_cuda(op, {{"gate", &gate}, {"up", &up}, {"out", &out}});
  for (Arg x : {Arg{"gate", &gate}, Arg{"up", &up}, Arg{"out", &out}}) need_float(op, x.first, *x.second);
  need_same_shape(op, "up", up, "gate", gate);
  need_same_shape(op, "out", out, "gate", gate);
  ProfileScope scope(OpKind::swiglu, op);
  LCX_ROUTE(cuda, swiglu_forward, gate, up, out);
}

void swiglu_backward(const Tensor& gate, const Tensor& up, const Tensor& dout, Tensor& dgate, Tensor& dup) {
  const char* op = "swiglu_backward";
  const bool cuda =
      on_cuda(op, {{"gate", &gate}, {"up", &up}, {"dout", &dout}, {"dgate", &dgate}, {"dup", &dup}});
  for (Arg x : {Arg{"gate", &gate}, Arg{"up", &up}, Arg{"dout", &dout}, Arg{"dgate", &dgate}, Arg{"dup", &dup}}) {
    need_float(op, x.first, *x.second);
    need_same_shape(op, x.first, *x.second, "gate", gate);
  }
  ProfileScope scope(OpKind::swiglu, op);
  LCX_ROUTE(cuda, swiglu_backward, gate, up, dout, dgate, dup);
}

void geglu_tanh_forward(const Tensor& gate, const Tensor& up, Tensor& out) {
  const char* op = "geglu_tanh_forward";
  const bool cuda = on_cuda(op, {{"gate", &gate}, {"up", &up}, {"out", &out}});
  for (Arg x : {Arg{"gate", &gate}, Arg{"up", &up}, Arg{"out", &out}}) need_float(op, x.first, *x.second);
  need_same_shape(op, "up", up, "gate", gate);
  need_same_shape(op, "out", out, "gate", gate);
  ProfileScope scope(OpKind::swiglu, op);
  LCX_ROUTE(cuda, geglu_tanh_forward, gate, up, out);
}

void geglu_tanh_backward(const Tensor& gate, const Tensor& up, const Tensor& dout, Tensor& dgate, Tensor& dup) {
  const char* op = "geglu_tanh_backward";
  const bool cuda =
      on_cuda(op, {{"gate", &gate}, {"up", &up}, {"dout", &dout}, {"dgate", &dgate}, {"dup", &dup}});
  for (Arg x : {Arg{"gate", &gate}, Arg{"up", &up}, Arg{"dout", &dout}, Arg{"dgate", &dgate}, Arg{"dup", &dup}}) {
    need_float(op, x.first, *x.second);
    need_same_shape(op, x.first, *x.second, "gate", gate);
  }
  ProfileScope scope(OpKind::swiglu, op);
  LCX_ROUTE(cuda, geglu_tanh_backward, gate, up, dout, dgate, dup);
}

void gated_forward(GateActivation act, const Tensor& gate, const Tensor& up, Tensor& out) {
  if (act == GateActivation::gelu_tanh) return geglu_tanh_forward(gate, up, out);
  swiglu_forward(gate, up, out);
}

void gated_backward(GateActivation act, const Tensor& gate, const Tensor& up, const Tensor& dout, Tensor& dgate,
                    Tensor& dup) {
  if (act == GateActivation::gelu_tanh) return geglu_tanh_backward(gate, up, dout, dgate, dup);
  swiglu_backward(gate, up, dout, dgate, dup);
}

namespace {
void check_swiglu_clamped(const char* op, const Tensor& gate_up, const char* half_name, const Tensor& half, float alpha,
                          float limit) {
  need_float(op, "gate_up", gate_up);
  need_float(op, half_name, half);
  need_dim(op, "gate_up", gate_up, 2);
  if (gate_up.size(1) % 2 != 0) fail(op, str(desc("gate_up", gate_up), " needs an even width (gate and up interleaved)"));
  need_shape(op, half_name, half, {gate_up.size(0), gate_up.size(1) / 2}, "gate_up", gate_up);
  if (!(limit > 0) || !(alpha > 0)) fail(op, str("alpha ", alpha, " and limit ", limit, " must be positive"));
}
}  // namespace

void swiglu_clamped_forward(const Tensor& gate_up, float alpha, float limit, Tensor& out) {
  const char* op = "swiglu_clamped_forward";
  const bool cuda = on_cuda(op, {{"gate_up", &gate_up}, {"out", &out}});
  check_swiglu_clamped(op, gate_up, "out", out, alpha, limit);
  ProfileScope scope(OpKind::swiglu, op);
  LCX_ROUTE(cuda, swiglu_clamped_forward, gate_up, alpha, limit, out);
}

void swiglu_clamped_backward(const Tensor& gate_up, const Tensor& dout, float alpha, float limit, Tensor& dgate_up) {
  const char* op = "swiglu_clamped_backward";
  const bool cuda = on_cuda(op, {{"gate_up", &gate_up}, {"dout", &dout}, {"dgate_up", &dgate_up}});
  check_swiglu_clamped(op, gate_up, "dout", dout, alpha, limit);
  need_float(op, "dgate_up", dgate_up);
  need_same_shape(op, "dgate_up", dgate_up, "gate_up", gate_up);
  ProfileScope scope(OpKind::swiglu, op);
  LCX_ROUTE(cuda, swiglu_clamped_backward, gate_up, dout, alpha, limit, dgate_up);
}

void add(const Tensor& a, const Tensor& b, Tensor& out) {
  const char* op = "add";
  const bool cuda = on_cuda(op, {{"a", &a}, {"b", &b}, {"out", &out}});
  for (Arg x : {Arg{"a", &a}, Arg{"b", &b}, Arg{"out", &out}}) {
    need_float(op, x.first, *x.second);
    need_same_shape(op, x.first, *x.second, "a", a);
  }
  ProfileScope scope(OpKind::other, op);
  LCX_ROUTE(cuda, add, a, b, out);
}

void add_inplace(Tensor& acc, const Tensor& x) {
  const char* op = "add_inplace";
  const bool cuda = on_cuda(op, {{"acc", &acc}, {"x", &x}});
  need_float(op, "acc", acc);
  need_float(op, "x", x);
  need_same_shape(op, "x", x, "acc", acc);
  ProfileScope scope(OpKind::other, op);
  LCX_ROUTE(cuda, add_inplace, acc, x);
}

void scale_inplace(Tensor& x, float s) {
  const char* op = "scale_inplace";
  const bool cuda = on_cuda(op, {{"x", &x}});
  need_float(op, "x", x);
  ProfileScope scope(OpKind::other, op);
  LCX_ROUTE(cuda, scale_inplace, x, s);
}

void cast(const Tensor& src, Tensor& dst) {
  const char* op = "cast";
  const bool cuda = on_cuda(op, {{"src", &src}, {"dst", &dst}});
  need_float(op, "src", src);
  need_float(op, "dst", dst);
  need_same_shape(op, "dst", dst, "src", src);
  ProfileScope scope(OpKind::other, op);
  LCX_ROUTE(cuda, cast, src, dst);
}

void dropout(const Tensor& x, float p, uint64_t key, const Tensor& rows, int64_t col0, Tensor& out, float beta) {
  const char* op = "dropout";
  const bool cuda = rows.defined() ? on_cuda(op, {{"x", &x}, {"rows", &rows}, {"out", &out}}) : on_cuda(op, {{"x", &x}, {"out", &out}});
  need_float(op, "x", x);
  need_float(op, "out", out);
  need_dim(op, "x", x, 2);
  need_same_shape(op, "out", out, "x", x);
  if (!(p >= 0.f && p < 1.f)) fail(op, str("p = ", p, " must be in [0, 1)"));
  if (rows.defined()) {
    need_dtype(op, "rows", rows, DType::i64);
    if (rows.dim() != 1 || rows.size(0) != x.size(0)) fail(op, str(desc("rows", rows), " must hold one index per row of ", desc("x", x)));
  }
  if (col0 < 0 || col0 + x.size(1) > (int64_t{1} << kDropoutColumnBits))
    fail(op, str("columns [", col0, ", ", col0 + x.size(1), ") of ", desc("x", x), ": the mask counts columns in [0, ",
                 int64_t{1} << kDropoutColumnBits, ")"));
  ProfileScope scope(OpKind::other, op);
  LCX_ROUTE(cuda, dropout, x, p, key, rows, col0, out, beta);
}

void copy_columns(const Tensor& src, int64_t src_col, Tensor& dst, int64_t dst_col, int64_t cols) {
  const char* op = "copy_columns";
  const bool cuda = on_cuda(op, {{"src", &src}, {"dst", &dst}});
  need_dtype(op, "dst", dst, src.dtype());
  if (src.dim() < 1 || dst.dim() < 1) fail(op, "src and dst must have at least one dimension");
  if (rows_of(src) != rows_of(dst))
    fail(op, str(desc("src", src), " and ", desc("dst", dst), " must have the same number of rows"));
  if (cols < 0 || src_col < 0 || dst_col < 0 || src_col + cols > src.size(-1) || dst_col + cols > dst.size(-1))
    fail(op, str("columns [", src_col, ",", src_col + cols, ") of ", desc("src", src), " into [", dst_col, ",",
                 dst_col + cols, ") of ", desc("dst", dst), " fall outside a row"));
  ProfileScope scope(OpKind::copy, op);
  LCX_ROUTE(cuda, copy_columns, src, src_col, dst, dst_col, cols);
}

void moe_route(const Tensor& logits, int64_t k, bool norm_topk, Tensor& weights, Tensor& experts, Tensor* probs) {
  const char* op = "moe_route";
  const bool cuda = probs ? on_cuda(op, {{"logits", &logits}, {"weights", &weights}, {"experts", &experts}, {"probs", probs}})
                          : on_cuda(op, {{"logits", &logits}, {"weights", &weights}, {"experts", &experts}});
  need_float(op, "logits", logits);
  need_dim(op, "logits", logits, 2);
  const int64_t T = logits.size(0), E = logits.size(1);
  if (k < 1 || k > E) fail(op, str("top-k of ", k, " over ", E, " experts: k must be in [1, ", E, "]"));
  need_dtype(op, "weights", weights, DType::f32);
  need_shape(op, "weights", weights, {T, k}, "logits", logits);
  need_dtype(op, "experts", experts, DType::i32);
  need_shape(op, "experts", experts, {T, k}, "logits", logits);
  if (probs) {
    need_dtype(op, "probs", *probs, DType::f32);
    need_shape(op, "probs", *probs, {T, E}, "logits", logits);
  }
  ProfileScope scope(OpKind::other, op);
  LCX_ROUTE(cuda, moe_route, logits, k, norm_topk, weights, experts, probs);
}

void moe_permute(const Tensor& experts, int64_t num_experts, Tensor& order, Tensor& position, Tensor& offsets) {
  const char* op = "moe_permute";
  const bool cuda = on_cuda(op, {{"experts", &experts}, {"order", &order}, {"position", &position}, {"offsets", &offsets}});
  need_dtype(op, "experts", experts, DType::i32);
  if (num_experts < 1) fail(op, str(num_experts, " experts"));
  const int64_t n = experts.numel();
  need_dtype(op, "order", order, DType::i32);
  need_dtype(op, "position", position, DType::i32);
  need_dtype(op, "offsets", offsets, DType::i64);
  if (order.numel() != n || position.numel() != n)
    fail(op, str(desc("order", order), " and ", desc("position", position), " must hold one entry per slot of ",
                 desc("experts", experts)));
  if (offsets.numel() != num_experts + 1) fail(op, str(desc("offsets", offsets), " must hold ", num_experts + 1, " entries"));
  if (n >= (int64_t{1} << 31)) fail(op, str(n, " slots do not fit int32 indices"));
  ProfileScope scope(OpKind::other, op);
  LCX_ROUTE(cuda, moe_permute, experts, num_experts, order, position, offsets);
}

void gather_rows(const Tensor& x, const Tensor& rows, int64_t divide, Tensor& out) {
  const char* op = "gather_rows";
  const bool cuda = on_cuda(op, {{"x", &x}, {"rows", &rows}, {"out", &out}});
  need_dim(op, "x", x, 2);
  need_dtype(op, "rows", rows, DType::i32);
  need_dtype(op, "out", out, x.dtype());
  need_shape(op, "out", out, {rows.numel(), x.size(1)}, "rows", rows);
  if (divide < 1) fail(op, str("divide = ", divide, " must be >= 1"));
  ProfileScope scope(OpKind::copy, op);
  LCX_ROUTE(cuda, gather_rows, x, rows, divide, out);
}

void moe_combine(const Tensor& y, const Tensor& position, const Tensor& weights, Tensor& out) {
  const char* op = "moe_combine";
  const bool cuda = on_cuda(op, {{"y", &y}, {"position", &position}, {"weights", &weights}, {"out", &out}});
  need_float(op, "y", y);
  need_dim(op, "y", y, 2);
  need_dtype(op, "weights", weights, DType::f32);
  need_dim(op, "weights", weights, 2);
  const int64_t T = weights.size(0), k = weights.size(1);
  need_dtype(op, "position", position, DType::i32);
  if (position.numel() != T * k || y.size(0) != T * k)
    fail(op, str(desc("y", y), " and ", desc("position", position), " must hold the T*k = ", T * k, " slots of ",
                 desc("weights", weights)));
  need_float(op, "out", out);
  need_shape(op, "out", out, {T, y.size(1)}, "y", y);
  ProfileScope scope(OpKind::other, op);
  LCX_ROUTE(cuda, moe_combine, y, position, weights, out);
}

void moe_combine_backward(const Tensor& dout, const Tensor& y, const Tensor& order, const Tensor& position,
                          const Tensor& weights, Tensor& dy, Tensor& dweights) {
  const char* op = "moe_combine_backward";
  const bool cuda = on_cuda(op, {{"dout", &dout}, {"y", &y}, {"order", &order}, {"position", &position},
                                 {"weights", &weights}, {"dy", &dy}, {"dweights", &dweights}});
  need_float(op, "dout", dout);
  need_dim(op, "dout", dout, 2);
  need_dtype(op, "weights", weights, DType::f32);
  need_dim(op, "weights", weights, 2);
  const int64_t T = weights.size(0), k = weights.size(1), H = dout.size(1);
  need_shape(op, "y", y, {T * k, H}, "weights", weights);
  need_float(op, "dy", dy);
  need_shape(op, "dy", dy, {T * k, H}, "y", y);
  need_dtype(op, "order", order, DType::i32);
  need_dtype(op, "position", position, DType::i32);
  if (order.numel() != T * k || position.numel() != T * k || dout.size(0) != T)
    fail(op, str(desc("order", order), ", ", desc("position", position), " and ", desc("dout", dout),
                 " must match the ", T, " tokens and ", T * k, " slots of ", desc("weights", weights)));
  need_dtype(op, "dweights", dweights, DType::f32);
  need_shape(op, "dweights", dweights, {T, k}, "weights", weights);
  ProfileScope scope(OpKind::other, op);
  LCX_ROUTE(cuda, moe_combine_backward, dout, y, order, position, weights, dy, dweights);
}

void moe_route_backward(const Tensor& probs, const Tensor& experts, const Tensor& weights, const Tensor& dweights,
                        bool norm_topk, const Tensor* aux_grad, Tensor& dlogits) {
  const char* op = "moe_route_backward";
  const bool cuda = aux_grad ? on_cuda(op, {{"probs", &probs}, {"experts", &experts}, {"weights", &weights},
                                            {"dweights", &dweights}, {"aux_grad", aux_grad}, {"dlogits", &dlogits}})
                             : on_cuda(op, {{"probs", &probs}, {"experts", &experts}, {"weights", &weights},
                                            {"dweights", &dweights}, {"dlogits", &dlogits}});
  need_dtype(op, "probs", probs, DType::f32);
  need_dim(op, "probs", probs, 2);
  const int64_t T = probs.size(0), E = probs.size(1);
  need_dtype(op, "experts", experts, DType::i32);
  need_dim(op, "experts", experts, 2);
  const int64_t k = experts.size(1);
  need_shape(op, "experts", experts, {T, k}, "probs", probs);
  need_dtype(op, "weights", weights, DType::f32);
  need_shape(op, "weights", weights, {T, k}, "experts", experts);
  need_dtype(op, "dweights", dweights, DType::f32);
  need_shape(op, "dweights", dweights, {T, k}, "experts", experts);
  if (aux_grad) {
    need_dtype(op, "aux_grad", *aux_grad, DType::f32);
    need_shape(op, "aux_grad", *aux_grad, {E}, "probs", probs);
  }
  need_float(op, "dlogits", dlogits);
  need_shape(op, "dlogits", dlogits, {T, E}, "probs", probs);
  ProfileScope scope(OpKind::other, op);
  LCX_ROUTE(cuda, moe_route_backward, probs, experts, weights, dweights, norm_topk, aux_grad, dlogits);
}

namespace {

// The row groups of the grouped GEMMs: G+1 host offsets rising from 0 to the rows of `rows`.
void check_offsets(const char* op, std::span<const int64_t> offsets, int64_t groups, const char* groups_name,
                   const Tensor& grouped, const char* rows_name, const Tensor& rows) {
  const int64_t n = rows.size(0);
  if (static_cast<int64_t>(offsets.size()) != groups + 1)
    fail(op, str("offsets holds ", offsets.size(), " entries but ", desc(groups_name, grouped), " has ", groups,
                 " groups: it needs G+1 = ", groups + 1));
  if (offsets.front() != 0 || offsets.back() != n)
    fail(op, str("offsets run from ", offsets.front(), " to ", offsets.back(), " but must run from 0 to the ", n,
                 " rows of ", desc(rows_name, rows)));
  for (size_t g = 1; g < offsets.size(); ++g)
    if (offsets[g] < offsets[g - 1])
      fail(op, str("offsets[", g, "] = ", offsets[g], " is below offsets[", g - 1, "] = ", offsets[g - 1],
                   ": a group's rows end where they begin or later"));
}

// The result of a grouped GEMM: the operands' dtype or fp32.
void need_result_dtype(const char* op, const char* name, const Tensor& t, const char* operand_name,
                       const Tensor& operand) {
  if (t.dtype() != operand.dtype() && t.dtype() != DType::f32)
    fail(op, str(desc(name, t), " must be fp32 or the dtype of ", desc(operand_name, operand)));
}

bool past_blas_range(std::initializer_list<int64_t> dims) {
  return std::any_of(dims.begin(), dims.end(), [](int64_t d) { return d > 2147483647; });
}

}  // namespace

namespace {
std::atomic<bool> g_own_grouped_gemm{false};
}  // namespace

void set_own_grouped_gemm(bool allowed) { g_own_grouped_gemm.store(allowed); }
bool own_grouped_gemm() { return g_own_grouped_gemm.load(); }

void grouped_matmul(const Tensor& x, const Tensor& w, bool trans_w, std::span<const int64_t> offsets, Tensor& y,
                    float alpha, float beta) {
  const char* op = "grouped_matmul";
  const bool cuda = on_cuda(op, {{"x", &x}, {"w", &w}, {"y", &y}});
  need_float(op, "x", x);
  need_dim(op, "x", x, 2);
  need_dtype(op, "w", w, x.dtype());
  need_dim(op, "w", w, 3);
  const int64_t G = w.size(0), N = x.size(0), K = x.size(1);
  const int64_t Kw = w.size(trans_w ? 2 : 1), Nout = w.size(trans_w ? 1 : 2);
  if (Kw != K)
    fail(op, str("inner dimensions differ: ", desc("x", x), " has K=", K, ", ", desc("w", w),
                 trans_w ? " as [G,Nout,K]" : " as [G,K,Nout]", " has K=", Kw));
  need_result_dtype(op, "y", y, "x", x);
  need_shape(op, "y", y, {N, Nout}, "w", w);
  check_offsets(op, offsets, G, "w", w, "x", x);
  if (past_blas_range({N, K, Nout}))
    fail(op, str("dimensions of ", desc("x", x), " and ", desc("w", w), " exceed the 32-bit BLAS range"));
  ProfileScope scope(OpKind::gemm, op);
  if (scope.recording()) scope.detail(str("G=", G, " rows=", N, " N=", Nout, " K=", K, " ", dtype_name(x.dtype())));
  LCX_ROUTE(cuda, grouped_matmul, x, w, trans_w, offsets, y, alpha, beta);
}

void grouped_matmul_wgrad(const Tensor& dy, const Tensor& x, std::span<const int64_t> offsets, Tensor& dw, float alpha,
                          float beta) {
  const char* op = "grouped_matmul_wgrad";
  const bool cuda = on_cuda(op, {{"dy", &dy}, {"x", &x}, {"dw", &dw}});
  need_float(op, "dy", dy);
  need_dim(op, "dy", dy, 2);
  need_dtype(op, "x", x, dy.dtype());
  need_dim(op, "x", x, 2);
  if (x.size(0) != dy.size(0))
    fail(op, str(desc("dy", dy), " and ", desc("x", x), " must have the same number of rows"));
  need_result_dtype(op, "dw", dw, "dy", dy);
  need_dim(op, "dw", dw, 3);
  const int64_t G = dw.size(0), N = x.size(0), K = x.size(1), Nout = dy.size(1);
  need_shape(op, "dw", dw, {G, Nout, K}, "x", x);
  check_offsets(op, offsets, G, "dw", dw, "x", x);
  if (past_blas_range({N, K, Nout}))
    fail(op, str("dimensions of ", desc("dy", dy), " and ", desc("x", x), " exceed the 32-bit BLAS range"));
  ProfileScope scope(OpKind::gemm, op);
  if (scope.recording()) scope.detail(str("G=", G, " rows=", N, " N=", Nout, " K=", K, " ", dtype_name(x.dtype())));
  LCX_ROUTE(cuda, grouped_matmul_wgrad, dy, x, offsets, dw, alpha, beta);
}

namespace {
// Checks q, k, v, out, lse and returns the params with a zero scale resolved to 1/sqrt(d).
AttentionParams check_attention(const char* op, const Tensor& q, const Tensor& k, const Tensor& v,
                                const Tensor& out, const Tensor& lse, const AttentionParams& p) {
  need_float(op, "q", q);
  need_dim(op, "q", q, 3);
  need_dtype(op, "k", k, q.dtype());
  need_dim(op, "k", k, 3);
  need_dtype(op, "v", v, q.dtype());
  need_same_shape(op, "v", v, "k", k);
  if (k.size(2) != q.size(2))
    fail(op, str("head dimensions differ: ", desc("q", q), " and ", desc("k", k)));
  if (k.size(1) == 0 || q.size(1) % k.size(1) != 0)
    fail(op, str("query heads of ", desc("q", q), " must be a multiple of the kv heads of ", desc("k", k)));
  need_float(op, "out", out);
  need_same_shape(op, "out", out, "q", q);
  need_dtype(op, "lse", lse, DType::f32);
  need_shape(op, "lse", lse, {q.size(1), q.size(0)}, "q", q);
  const auto& d = p.documents;
  if (!d.empty()) {
    const int64_t first = std::min(p.q_offset, p.k_offset);
    const int64_t last = std::max(p.q_offset + q.size(0), p.k_offset + k.size(0));
    if (d.size() < 2 || d.front() > first || d.back() < last)
      fail(op, str("the document bounds must run from at most position ", first, " to at least ", last,
                   " (the queries' and keys' positions), got ", d.size(), " bounds from ", d.front(), " to ", d.back()));
    for (size_t i = 1; i < d.size(); ++i)
      if (d[i] <= d[i - 1])
        fail(op, str("document bound ", i, " (", d[i], ") does not follow bound ", i - 1, " (", d[i - 1], ")"));
  }
  if (p.window < 0 || (p.window > 0 && !p.causal))
    fail(op, str("window is ", p.window, (p.causal ? "" : " with causal false"),
                 "; a sliding window is 0 (none) or > 0 on causal attention (the W keys ending at the query)"));
  AttentionParams r = p;
  if (r.scale == 0.f) r.scale = 1.f / std::sqrt(static_cast<float>(q.size(2)));
  // A window reaching back past the first key from the last query hides nothing.
  if (r.window > 0 && p.q_offset + q.size(0) - r.window <= p.k_offset) r.window = 0;
  // One document holding every query and key masks nothing: the unmasked kernels serve.
  if (!d.empty()) {
    const auto last = std::upper_bound(d.begin(), d.end(), std::min(p.q_offset, p.k_offset));
    if (last != d.end() && *last >= std::max(p.q_offset + q.size(0), p.k_offset + k.size(0))) r.documents = {};
  }
  // Every key at or before the first query: the causal mask hides nothing, and as a full block it
  // runs on cuDNN, which takes causal blocks only at equal positions (a ring's piece of one
  // document against its earlier chunk would otherwise fall to the own kernels). A window still
  // masks such a block, so it stays causal.
  if (r.causal && r.documents.empty() && r.window == 0 && p.k_offset + k.size(0) <= p.q_offset + 1) r.causal = false;
  return r;
}

// The backward's arguments: the forward's, then dout and dq shaped like q, dk and dv like k.
// Returns whether they are on the GPU, and the params as check_attention resolves them.
struct CheckedBackward {
  bool cuda;
  AttentionParams params;
};
CheckedBackward check_attention_backward(const char* op, const Tensor& q, const Tensor& k, const Tensor& v,
                                         const Tensor& out, const Tensor& lse, const Tensor& dout, const Tensor& dq,
                                         const Tensor& dk, const Tensor& dv, const AttentionParams& p) {
  const bool cuda = on_cuda(op, {{"q", &q},
                                 {"k", &k},
                                 {"v", &v},
                                 {"out", &out},
                                 {"lse", &lse},
                                 {"dout", &dout},
                                 {"dq", &dq},
                                 {"dk", &dk},
                                 {"dv", &dv}});
  const AttentionParams r = check_attention(op, q, k, v, out, lse, p);
  for (Arg x : {Arg{"dout", &dout}, Arg{"dq", &dq}}) {
    need_float(op, x.first, *x.second);
    need_same_shape(op, x.first, *x.second, "q", q);
  }
  for (Arg x : {Arg{"dk", &dk}, Arg{"dv", &dv}}) {
    need_float(op, x.first, *x.second);
    need_same_shape(op, x.first, *x.second, "k", k);
  }
  return {cuda, r};
}

}  // namespace

void run_work(const std::function<void()>& work) { work(); }

namespace {

void compute_forward(bool cuda, const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, Tensor& lse,
                     const AttentionParams& p) {
#ifdef LCX_HAVE_CUDA
  if (cuda) return gpu_attention_forward(q, k, v, out, lse, p, run_work);
#else
  (void)cuda;
#endif
  cpu::attention_forward(q, k, v, out, lse, p);
}

void compute_backward(bool cuda, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                      const Tensor& lse, const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv,
                      const AttentionParams& p) {
#ifdef LCX_HAVE_CUDA
  if (cuda) return gpu_attention_backward(q, k, v, out, lse, dout, dq, dk, dv, p, run_work);
#else
  (void)cuda;
#endif
  cpu::attention_backward(q, k, v, out, lse, dout, dq, dk, dv, p);
}

const AttentionTable kComputing{compute_forward, compute_backward, run_work};
std::atomic<const AttentionTable*> g_attention{&kComputing};

}  // namespace

const AttentionTable& computing_attention() { return kComputing; }
void install_attention(const AttentionTable& table) { g_attention.store(&table); }
const AttentionTable& attention_table() { return *g_attention.load(std::memory_order_relaxed); }

void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, Tensor& lse,
                       const AttentionParams& p) {
  const char* op = "attention_forward";
  const bool cuda = on_cuda(op, {{"q", &q}, {"k", &k}, {"v", &v}, {"out", &out}, {"lse", &lse}});
  const AttentionParams r = check_attention(op, q, k, v, out, lse, p);
  ProfileScope scope(OpKind::attention_fwd, op);
  attention_table().forward(cuda, q, k, v, out, lse, r);
}

void attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                        const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv, const AttentionParams& p) {
  const char* op = "attention_backward";
  const CheckedBackward checked = check_attention_backward(op, q, k, v, out, lse, dout, dq, dk, dv, p);
  ProfileScope scope(OpKind::attention_bwd, op);
  attention_table().backward(checked.cuda, q, k, v, out, lse, dout, dq, dk, dv, checked.params);
}

namespace {
// out [T,H,d], lse fp32 [H,T], sinks with a logit for heads head0 .. head0 + H - 1.
void check_sinks(const char* op, const Tensor& out, const Tensor& lse, const Tensor& sinks, int64_t head0) {
  need_float(op, "out", out);
  need_dim(op, "out", out, 3);
  need_dtype(op, "lse", lse, DType::f32);
  need_shape(op, "lse", lse, {out.size(1), out.size(0)}, "out", out);
  need_float(op, "sinks", sinks);
  need_dim(op, "sinks", sinks, 1);
  if (head0 < 0 || head0 + out.size(1) > sinks.size(0))
    fail(op, str("heads ", head0, " to ", head0 + out.size(1) - 1, " of ", desc("out", out), " have no logit in ",
                 desc("sinks", sinks), "; head0 + heads must be at most the sinks' length"));
}
}  // namespace

void attention_sinks_forward(Tensor& out, Tensor& lse, const Tensor& sinks, int64_t head0) {
  const char* op = "attention_sinks_forward";
  const bool cuda = on_cuda(op, {{"out", &out}, {"lse", &lse}, {"sinks", &sinks}});
  check_sinks(op, out, lse, sinks, head0);
  ProfileScope scope(OpKind::attention_fwd, op);
  LCX_ROUTE(cuda, attention_sinks_forward, out, lse, sinks, head0);
}

void attention_sinks_backward(const Tensor& out, const Tensor& lse, const Tensor& dout, const Tensor& sinks,
                              int64_t head0, Tensor& dsinks) {
  const char* op = "attention_sinks_backward";
  const bool cuda =
      on_cuda(op, {{"out", &out}, {"lse", &lse}, {"dout", &dout}, {"sinks", &sinks}, {"dsinks", &dsinks}});
  check_sinks(op, out, lse, sinks, head0);
  need_same_shape(op, "dout", dout, "out", out);
  need_dtype(op, "dout", dout, out.dtype());
  need_dtype(op, "dsinks", dsinks, DType::f32);
  need_same_shape(op, "dsinks", dsinks, "sinks", sinks);
  ProfileScope scope(OpKind::attention_bwd, op);
  LCX_ROUTE(cuda, attention_sinks_backward, out, lse, dout, sinks, head0, dsinks);
}

namespace {

// A block's rows within q and k; causal blocks square; no two blocks sharing a query or a key row.
void check_blocks(const char* op, const Tensor& q, const Tensor& k, bool causal,
                  std::span<const AttentionBlock> blocks) {
  std::vector<std::pair<int64_t, int64_t>> qs, ks;
  for (size_t i = 0; i < blocks.size(); ++i) {
    const AttentionBlock& b = blocks[i];
    if (b.q_begin < 0 || b.q_rows < 0 || b.q_begin + b.q_rows > q.size(0) || b.k_begin < 0 || b.k_rows < 0 ||
        b.k_begin + b.k_rows > k.size(0))
      fail(op, str("block ", i, " (query rows ", b.q_begin, " + ", b.q_rows, ", key rows ", b.k_begin, " + ", b.k_rows,
                   ") lies outside ", desc("q", q), " or ", desc("k", k)));
    if (causal && b.q_rows != b.k_rows)
      fail(op, str("block ", i, " is causal with ", b.q_rows, " query rows and ", b.k_rows,
                   " key rows; a causal block has its queries and keys at equal positions"));
    if (b.q_rows == 0 || b.k_rows == 0) continue;
    qs.emplace_back(b.q_begin, b.q_begin + b.q_rows);
    ks.emplace_back(b.k_begin, b.k_begin + b.k_rows);
  }
  for (auto* rows : {&qs, &ks}) {
    std::sort(rows->begin(), rows->end());
    for (size_t i = 1; i < rows->size(); ++i)
      if ((*rows)[i].first < (*rows)[i - 1].second)
        fail(op, str("two blocks share ", rows == &qs ? "query" : "key", " rows ", (*rows)[i].first, " to ",
                     std::min((*rows)[i].second, (*rows)[i - 1].second), "; each row is written by one block"));
  }
}

}  // namespace

void attention_forward_blocks(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, Tensor& lse, float scale,
                              bool causal, std::span<const AttentionBlock> blocks) {
  const char* op = "attention_forward_blocks";
  const bool cuda = on_cuda(op, {{"q", &q}, {"k", &k}, {"v", &v}, {"out", &out}, {"lse", &lse}});
  const AttentionParams r = check_attention(op, q, k, v, out, lse, block_params(scale, causal));
  check_blocks(op, q, k, causal, blocks);
  ProfileScope scope(OpKind::attention_fwd, op);
  forward_blocks(cuda, q, k, v, out, lse, r, causal, blocks, attention_table().launch);
}

void attention_backward_blocks(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                               const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv, float scale, bool causal,
                               std::span<const AttentionBlock> blocks) {
  const char* op = "attention_backward_blocks";
  const CheckedBackward checked =
      check_attention_backward(op, q, k, v, out, lse, dout, dq, dk, dv, block_params(scale, causal));
  check_blocks(op, q, k, causal, blocks);
  ProfileScope scope(OpKind::attention_bwd, op);
  backward_blocks(checked.cuda, q, k, v, out, lse, dout, dq, dk, dv, checked.params, causal, blocks,
                  attention_table().launch);
}

namespace {

// On the CPU a target past the vocabulary fails here, naming it; the CUDA kernels cannot stop
// the host, so they write NaN for that row's loss instead.
void need_targets_in_vocabulary(const char* op, const Tensor& targets, const Tensor& logits) {
  const int64_t* tg = targets.data_as<const int64_t>();
  for (int64_t t = 0; t < targets.numel(); ++t)
    if (tg[t] != -100 && (tg[t] < 0 || tg[t] >= logits.size(1)))
      fail(op, str("target ", tg[t], " at row ", t, " is outside ", desc("logits", logits),
                   " (and is not the ignore index -100)"));
}

}  // namespace

double cross_entropy_forward_backward(const Tensor& logits, const Tensor& targets, double grad_scale,
                                      Tensor* dlogits, int64_t* valid) {
  const char* op = "cross_entropy_forward_backward";
  const bool cuda = dlogits ? on_cuda(op, {{"logits", &logits}, {"targets", &targets}, {"dlogits", dlogits}})
                            : on_cuda(op, {{"logits", &logits}, {"targets", &targets}});
  need_float(op, "logits", logits);
  need_dim(op, "logits", logits, 2);
  need_dtype(op, "targets", targets, DType::i64);
  need_shape(op, "targets", targets, {logits.size(0)}, "logits", logits);
  if (dlogits) {
    need_float(op, "dlogits", *dlogits);
    need_same_shape(op, "dlogits", *dlogits, "logits", logits);
  }
  if (!cuda) need_targets_in_vocabulary(op, targets, logits);
  ProfileScope scope(OpKind::loss, op);
  LCX_ROUTE(cuda, cross_entropy_forward_backward, logits, targets, grad_scale, dlogits, valid);
}

void cross_entropy_chunk(const Tensor& logits, const Tensor& targets, float grad_scale, Tensor& row_loss,
                         Tensor* dlogits) {
  const char* op = "cross_entropy_chunk";
  const bool cuda =
      dlogits ? on_cuda(op, {{"logits", &logits}, {"targets", &targets}, {"row_loss", &row_loss}, {"dlogits", dlogits}})
              : on_cuda(op, {{"logits", &logits}, {"targets", &targets}, {"row_loss", &row_loss}});
  need_dtype(op, "logits", logits, DType::f32);
  need_dim(op, "logits", logits, 2);
  need_dtype(op, "targets", targets, DType::i64);
  need_shape(op, "targets", targets, {logits.size(0)}, "logits", logits);
  need_dtype(op, "row_loss", row_loss, DType::f32);
  need_shape(op, "row_loss", row_loss, {logits.size(0)}, "logits", logits);
  if (dlogits) {
    need_float(op, "dlogits", *dlogits);
    need_same_shape(op, "dlogits", *dlogits, "logits", logits);
  }
  if (!cuda) need_targets_in_vocabulary(op, targets, logits);
  ProfileScope scope(OpKind::loss, op);
  LCX_ROUTE(cuda, cross_entropy_chunk, logits, targets, grad_scale, row_loss, dlogits);
}

#undef LCX_ROUTE

}  // namespace lcx::ops
