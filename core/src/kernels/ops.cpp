// The op dispatch: every op checks its arguments here once (dtypes, shapes, one common device),
// naming the op, the argument and the shapes involved, then routes to the CPU reference
// (kernels/cpu) or, in a CUDA build, to the CUDA kernels (kernels/cuda). Both backends may
// therefore assume valid tensors. Values that cost a pass over the data (token ids, targets) are
// range-checked only on the CPU; the CUDA kernels guard their own reads. Each op runs inside a
// ProfileScope of its kind, so a profiled step (lcx/profile.h) times every op, the model's and the
// plugins' alike.
#include "lcx/ops.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <initializer_list>
#include <numeric>
#include <span>
#include <utility>
#include <vector>

#include "kernels/attention_cut.h"
#include "kernels/cpu/cpu_ops.h"
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

namespace {
std::atomic<bool> g_attention_cut{false};
}  // namespace

void set_attention_cut(bool on) { g_attention_cut.store(on); }
bool attention_cut() { return g_attention_cut.load(std::memory_order_relaxed); }

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
  AttentionParams r = p;
  if (r.scale == 0.f) r.scale = 1.f / std::sqrt(static_cast<float>(q.size(2)));
  // One document holding every query and key masks nothing: the unmasked kernels serve.
  if (!d.empty()) {
    const auto last = std::upper_bound(d.begin(), d.end(), std::min(p.q_offset, p.k_offset));
    if (last != d.end() && *last >= std::max(p.q_offset + q.size(0), p.k_offset + k.size(0))) r.documents = {};
  }
  // Every key at or before the first query: the causal mask hides nothing, and as a full block it
  // runs on cuDNN, which takes causal blocks only at equal positions (a ring's piece of one
  // document against its earlier chunk would otherwise fall to the own kernels).
  if (r.causal && r.documents.empty() && p.k_offset + k.size(0) <= p.q_offset + 1) r.causal = false;
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

#ifdef LCX_HAVE_CUDA
// Document-masked attention on the GPU: the work is the sum of the documents' squared lengths.
// Where the queries and keys are the same rows (one GPU, whole sequences after an all-to-all), the
// documents run on cuDNN as padded batches of few shapes (kernels/document_batches.h, kernels/cuda/
// attention_documents.cpp), whose plans a new mix of lengths reuses; in a ring's piece with queries
// and keys apart, so do the documents whose keys all precede their queries (full attention). What
// cuDNN does not take (a document's keys and queries interleaved, LCX_ATTENTION=own, no cuDNN, a
// refused shape) runs on lcx's own kernels once per document, on row slices. Each document's query
// rows meet its key rows at their own positions; queries of a document with no key here see nothing
// (out 0, lse -inf), keys of one with no query get no gradient. The LSE [Hq,T] is strided per
// document: a contiguous copy serves. Under a rehearsal's cut (kernels/attention_cut.h) each
// document still allocates what its kernels allocate, and nothing launches: the caller writes the
// zeros.
struct DocumentSlice {
  int64_t q_begin, q_end, k_begin, k_end;  // rows of q and of k
  int64_t q_pos, k_pos;                    // their first positions
};
std::vector<DocumentSlice> document_slices(const Tensor& q, const Tensor& k, const AttentionParams& p) {
  std::vector<DocumentSlice> out;
  const int64_t T = q.size(0), S = k.size(0);
  for (size_t i = 0; i + 1 < p.documents.size(); ++i) {
    const int64_t a = p.documents[i], b = p.documents[i + 1];
    const int64_t qb = std::clamp<int64_t>(a - p.q_offset, 0, T), qe = std::clamp<int64_t>(b - p.q_offset, 0, T);
    const int64_t kb = std::clamp<int64_t>(a - p.k_offset, 0, S), ke = std::clamp<int64_t>(b - p.k_offset, 0, S);
    if (qb < qe || kb < ke) out.push_back({qb, qe, kb, ke, p.q_offset + qb, p.k_offset + kb});
  }
  return out;
}

// The documents cuDNN's padded batches may take, with their query and key spans: all of them when
// the queries and keys are the same rows; else (a ring's query chunk against another key chunk)
// those with queries and keys whose attention is full: not causal, or every key of the document
// before every query. Those run with `full` (p not causal). Returns their indices into `slices`.
std::vector<size_t> cudnn_documents(const Tensor& q, const Tensor& k, const AttentionParams& p,
                                    const std::vector<DocumentSlice>& slices, std::vector<cuda::DocumentSpan>& q_spans,
                                    std::vector<cuda::DocumentSpan>& k_spans, AttentionParams& full) {
  std::vector<size_t> which;
  full = p;
  if (q.size(0) == k.size(0) && p.q_offset == p.k_offset) {
    for (size_t i = 0; i < slices.size(); ++i)
      if (slices[i].q_end > slices[i].q_begin) {
        which.push_back(i);
        q_spans.push_back({slices[i].q_begin, slices[i].q_end - slices[i].q_begin});
      }
    k_spans = q_spans;
    return which;
  }
  full.causal = false;
  for (size_t i = 0; i < slices.size(); ++i) {
    const DocumentSlice& s = slices[i];
    const int64_t nq = s.q_end - s.q_begin, nk = s.k_end - s.k_begin;
    if (nq == 0 || nk == 0 || (p.causal && s.k_pos + nk > s.q_pos)) continue;
    which.push_back(i);
    q_spans.push_back({s.q_begin, nq});
    k_spans.push_back({s.k_begin, nk});
  }
  return which;
}

// Marks the slices the padded batches ran; the rest go to the own kernels.
template <class Run>
std::vector<char> run_on_cudnn(const Tensor& q, const Tensor& k, const AttentionParams& p,
                               const std::vector<DocumentSlice>& slices, Run run) {
  std::vector<char> done(slices.size(), 0);
  std::vector<cuda::DocumentSpan> q_spans, k_spans;
  AttentionParams full;
  const std::vector<size_t> which = cudnn_documents(q, k, p, slices, q_spans, k_spans, full);
  if (which.empty()) return done;
  const std::vector<char> ran = run(full, q_spans, k_spans);
  for (size_t j = 0; j < which.size(); ++j) done[which[j]] = ran[j];
  return done;
}

AttentionParams one_document(const AttentionParams& p, const DocumentSlice& s) {
  AttentionParams r = p;
  r.documents = {};
  r.q_offset = s.q_pos;
  r.k_offset = s.k_pos;
  return r;
}

void attention_forward_by_document(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, Tensor& lse,
                                   const AttentionParams& p) {
  const bool cut = attention_cut();
  const std::vector<DocumentSlice> slices = document_slices(q, k, p);
  const std::vector<char> done =
      run_on_cudnn(q, k, p, slices, [&](const AttentionParams& r, const auto& q_spans, const auto& k_spans) {
        return cuda::attention_forward_documents(q, k, v, out, lse, r, q_spans, k_spans);
      });
  // Queries with no key here (in a ring's piece, the documents of the query chunk that the key
  // chunk does not hold; most of them with short documents) see nothing: out 0, LSE -inf. Such
  // documents follow one another in q's rows, so each run of them is one zero fill and one column
  // copy from a single -inf block uploaded once per call on the stream (a host copy per document,
  // each a wait on the device, cost a ring's piece of short documents more than its attention).
  std::vector<std::pair<int64_t, int64_t>> unseen;  // runs of query rows
  for (size_t i = 0; i < slices.size(); ++i) {
    const DocumentSlice& s = slices[i];
    const int64_t n = s.q_end - s.q_begin;
    if (n == 0 || done[i]) continue;
    if (s.k_begin == s.k_end) {
      if (!unseen.empty() && unseen.back().second == s.q_begin) unseen.back().second = s.q_end;
      else unseen.emplace_back(s.q_begin, s.q_end);
      continue;
    }
    Tensor o = out.rows(s.q_begin, s.q_end);
    Tensor l = Tensor::empty({q.size(1), n}, DType::f32, q.device());
    cuda::attention_forward_own(q.rows(s.q_begin, s.q_end), k.rows(s.k_begin, s.k_end), v.rows(s.k_begin, s.k_end),
                                o, l, one_document(p, s));
    if (!cut) cuda::copy_columns(l, 0, lse, s.q_begin, n);
  }
  if (unseen.empty()) return;
  int64_t widest = 0;
  for (const auto& [b, e] : unseen) widest = std::max(widest, e - b);
  Tensor none = Tensor::empty({q.size(1), widest}, DType::f32, q.device());
  if (cut) return;
  cuda::upload(std::vector<float>(static_cast<size_t>(none.numel()), -INFINITY).data(), none);
  for (const auto& [b, e] : unseen) {
    out.rows(b, e).zero();
    cuda::copy_columns(none, 0, lse, b, e - b);
  }
}

void attention_backward_by_document(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                                    const Tensor& lse, const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv,
                                    const AttentionParams& p) {
  const bool cut = attention_cut();
  const std::vector<DocumentSlice> slices = document_slices(q, k, p);
  const std::vector<char> done =
      run_on_cudnn(q, k, p, slices, [&](const AttentionParams& r, const auto& q_spans, const auto& k_spans) {
        return cuda::attention_backward_documents(q, k, v, out, lse, dout, dq, dk, dv, r, q_spans, k_spans);
      });
  for (size_t i = 0; i < slices.size(); ++i) {
    const DocumentSlice& s = slices[i];
    if (done[i]) continue;
    const int64_t n = s.q_end - s.q_begin;
    Tensor dqs = dq.rows(s.q_begin, s.q_end), dks = dk.rows(s.k_begin, s.k_end), dvs = dv.rows(s.k_begin, s.k_end);
    if (n == 0 || s.k_begin == s.k_end) {
      if (cut) continue;
      if (n > 0) dqs.zero();
      if (s.k_begin < s.k_end) {
        dks.zero();
        dvs.zero();
      }
      continue;
    }
    Tensor l = Tensor::empty({q.size(1), n}, DType::f32, q.device());
    if (!cut) cuda::copy_columns(lse, s.q_begin, l, 0, n);
    cuda::attention_backward_own(q.rows(s.q_begin, s.q_end), k.rows(s.k_begin, s.k_end), v.rows(s.k_begin, s.k_end),
                                 out.rows(s.q_begin, s.q_end), l, dout.rows(s.q_begin, s.q_end), dqs, dks, dvs,
                                 one_document(p, s));
  }
}

// The GPU backend's attention: per document under a mask, else cuDNN or the own kernels.
void gpu_attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, Tensor& lse,
                           const AttentionParams& p) {
  if (!p.documents.empty()) return attention_forward_by_document(q, k, v, out, lse, p);
  cuda::attention_forward(q, k, v, out, lse, p);
}

void gpu_attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                            const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv, const AttentionParams& p) {
  if (!p.documents.empty()) return attention_backward_by_document(q, k, v, out, lse, dout, dq, dk, dv, p);
  cuda::attention_backward(q, k, v, out, lse, dout, dq, dk, dv, p);
}
#endif
}  // namespace

void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, Tensor& lse,
                       const AttentionParams& p) {
  const char* op = "attention_forward";
  const bool cuda = on_cuda(op, {{"q", &q}, {"k", &k}, {"v", &v}, {"out", &out}, {"lse", &lse}});
  const AttentionParams r = check_attention(op, q, k, v, out, lse, p);
  ProfileScope scope(OpKind::attention_fwd, op);
  if (attention_cut()) {
#ifdef LCX_HAVE_CUDA
    // The GPU backend allocates the call's workspace (each document's, under a mask) and stops
    // before the math; the CPU's allocates nothing.
    if (cuda) gpu_attention_forward(q, k, v, out, lse, r);
#endif
    out.zero();
    lse.zero();
    return;
  }
#ifdef LCX_HAVE_CUDA
  if (cuda) return gpu_attention_forward(q, k, v, out, lse, r);
#endif
  LCX_ROUTE(cuda, attention_forward, q, k, v, out, lse, r);
}

void attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                        const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv, const AttentionParams& p) {
  const char* op = "attention_backward";
  const CheckedBackward checked = check_attention_backward(op, q, k, v, out, lse, dout, dq, dk, dv, p);
  const bool cuda = checked.cuda;
  const AttentionParams& r = checked.params;
  ProfileScope scope(OpKind::attention_bwd, op);
  if (attention_cut()) {
#ifdef LCX_HAVE_CUDA
    if (cuda) gpu_attention_backward(q, k, v, out, lse, dout, dq, dk, dv, r);
#endif
    dq.zero();
    dk.zero();
    dv.zero();
    return;
  }
#ifdef LCX_HAVE_CUDA
  if (cuda) return gpu_attention_backward(q, k, v, out, lse, dout, dq, dk, dv, r);
#endif
  LCX_ROUTE(cuda, attention_backward, q, k, v, out, lse, dout, dq, dk, dv, r);
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

AttentionParams block_params(float scale, bool causal) {
  AttentionParams p;
  p.scale = scale;
  p.causal = causal;
  return p;
}

// One block as a plain call on row slices; its LSE columns through a contiguous copy.
void forward_block(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, Tensor& lse, float scale,
                   bool causal, const AttentionBlock& b) {
  Tensor o = out.rows(b.q_begin, b.q_begin + b.q_rows);
  Tensor l = Tensor::empty({q.size(1), b.q_rows}, DType::f32, q.device());
  attention_forward(q.rows(b.q_begin, b.q_begin + b.q_rows), k.rows(b.k_begin, b.k_begin + b.k_rows),
                    v.rows(b.k_begin, b.k_begin + b.k_rows), o, l, block_params(scale, causal));
  copy_columns(l, 0, lse, b.q_begin, b.q_rows);
}

void backward_block(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                    const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv, float scale, bool causal,
                    const AttentionBlock& b) {
  const int64_t q0 = b.q_begin, q1 = b.q_begin + b.q_rows, k0 = b.k_begin, k1 = b.k_begin + b.k_rows;
  Tensor l = Tensor::empty({q.size(1), b.q_rows}, DType::f32, q.device());
  copy_columns(lse, q0, l, 0, b.q_rows);
  Tensor dqs = dq.rows(q0, q1), dks = dk.rows(k0, k1), dvs = dv.rows(k0, k1);
  attention_backward(q.rows(q0, q1), k.rows(k0, k1), v.rows(k0, k1), out.rows(q0, q1), l, dout.rows(q0, q1), dqs, dks,
                     dvs, block_params(scale, causal));
}

#ifdef LCX_HAVE_CUDA
// The blocks as cuDNN's document batches take them (each block one document), in runs whose query
// rows and key rows both ascend (the layout of cuDNN's packed callers, whose ragged offsets we
// mirror: a ring's rounds make one run); per block whether it ran there.
template <class Run>
std::vector<char> blocks_on_cudnn(std::span<const AttentionBlock> blocks, Run run) {
  std::vector<size_t> order;
  for (size_t i = 0; i < blocks.size(); ++i)
    if (blocks[i].q_rows > 0 && blocks[i].k_rows > 0) order.push_back(i);
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return blocks[a].q_begin < blocks[b].q_begin; });
  std::vector<char> done(blocks.size(), 0);
  for (size_t from = 0; from < order.size();) {
    std::vector<cuda::DocumentSpan> q_spans, k_spans;
    size_t to = from;
    for (; to < order.size(); ++to) {
      const AttentionBlock& b = blocks[order[to]];
      if (!k_spans.empty() && b.k_begin < k_spans.back().begin + k_spans.back().length) break;
      q_spans.push_back({b.q_begin, b.q_rows});
      k_spans.push_back({b.k_begin, b.k_rows});
    }
    const std::vector<char> ran = run(q_spans, k_spans);
    for (size_t j = from; j < to; ++j) done[order[j]] = ran[j - from];
    from = to;
  }
  return done;
}
#endif

}  // namespace

void attention_forward_blocks(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, Tensor& lse, float scale,
                              bool causal, std::span<const AttentionBlock> blocks) {
  const char* op = "attention_forward_blocks";
  const bool cuda = on_cuda(op, {{"q", &q}, {"k", &k}, {"v", &v}, {"out", &out}, {"lse", &lse}});
  const AttentionParams r = check_attention(op, q, k, v, out, lse, block_params(scale, causal));
  check_blocks(op, q, k, causal, blocks);
  ProfileScope scope(OpKind::attention_fwd, op);
  std::vector<char> done(blocks.size(), 0);
#ifdef LCX_HAVE_CUDA
  if (cuda)
    done = blocks_on_cudnn(blocks, [&](const auto& q_spans, const auto& k_spans) {
      return cuda::attention_forward_documents(q, k, v, out, lse, r, q_spans, k_spans);
    });
#else
  (void)cuda;
#endif
  for (size_t i = 0; i < blocks.size(); ++i)
    if (!done[i] && blocks[i].q_rows > 0 && blocks[i].k_rows > 0)
      forward_block(q, k, v, out, lse, r.scale, causal, blocks[i]);
}

void attention_backward_blocks(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                               const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv, float scale, bool causal,
                               std::span<const AttentionBlock> blocks) {
  const char* op = "attention_backward_blocks";
  const CheckedBackward checked =
      check_attention_backward(op, q, k, v, out, lse, dout, dq, dk, dv, block_params(scale, causal));
  const bool cuda = checked.cuda;
  const AttentionParams& r = checked.params;
  check_blocks(op, q, k, causal, blocks);
  ProfileScope scope(OpKind::attention_bwd, op);
  std::vector<char> done(blocks.size(), 0);
#ifdef LCX_HAVE_CUDA
  if (cuda)
    done = blocks_on_cudnn(blocks, [&](const auto& q_spans, const auto& k_spans) {
      return cuda::attention_backward_documents(q, k, v, out, lse, dout, dq, dk, dv, r, q_spans, k_spans);
    });
#else
  (void)cuda;
#endif
  for (size_t i = 0; i < blocks.size(); ++i)
    if (!done[i] && blocks[i].q_rows > 0 && blocks[i].k_rows > 0)
      backward_block(q, k, v, out, lse, dout, dq, dk, dv, r.scale, causal, blocks[i]);
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
