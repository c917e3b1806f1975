// Attention through cuDNN's fused flash kernels, written against the cuDNN 9 backend API
// (cudnn_graph.h) as operation graphs the runtime-fusion engines recognise:
//  forward:  S = Q K^T (fp32) -> * scale -> causal mask (row index >= column index, else a huge
//            negative) -> softmax as max / sub / exp / sum / div, with stats = max + log(sum) written
//            out (our lse) -> O = P V (P in the input dtype);
//  backward: softmax_sum = rowsum(dO * O); P = exp(scale * Q K^T - stats) under the same mask;
//            dV = P^T dO; dS = P * (dO V^T - softmax_sum) * scale; dK = dS^T Q; dQ = dS K through
//            an fp32 accumulator. GQA reduces the per-query-head dK/dV over each group.
// Operands keep lcx's layouts ([T, heads, d] is b=1, strides (d, heads*d, 1) over (h, s, d)); K and
// V are read transposed through strides, never copied. One plan per shape is built on first use
// (heuristics mode A, first engine config that finalizes) and cached; a shape cuDNN refuses is
// remembered too, and the own kernels take it. cuDNN is loaded with dlopen, so liblcx_core runs
// (and the own kernels serve) where libcudnn.so.9 is absent.
// Taken (the rules are the dispatch's, kernels/attention/dispatch.cpp, which calls in here only
// where they hold): bf16/fp16 q, k, v, out (and dout, dq, dk, dv) of one dtype, head_dim a
// multiple of 8 up to 128 (256 on sm_90), 16-byte aligned rows, and either a full (non-causal) block or a causal
// one with equal query and key positions (T == S, q_offset == k_offset). Ring attention's other
// causal blocks run on the own kernels.
// Padded batches (document masks, documents.cpp) give the graphs a batch dimension b
// and each element's real rows as int32 [b,1,1,1] tensors: a padding mask (row < seq_len_q and
// column < seq_len_kv) before the causal one, and the GEMMs' M/N/K overrides, as NVIDIA's
// cudnn-frontend builds its padded SDPA graphs; that is what its flash engines recognise to skip
// the padded tiles.
// Ragged batches (the same, `ragged`) read and write the documents where they lie in the caller's
// [T, heads, d] tensors, as Transformer Engine's THD layout does: Q, K, V, O, dO, dQ, dK, dV each
// name an int64 [b+1,1,1,1] tensor of element offsets (CUDNN_ATTR_TENSOR_RAGGED_OFFSET_DESC;
// element e starts at offset[e] rather than e * batch stride; Q, O, dO, dQ share the query side's,
// K, V, dK, dV and the backward's K reshaped from K^T the key side's). cuDNN takes them with the
// padding mask only, on Hopper and later; int64 offsets from cuDNN 9.5 (int32 ones overflow past
// 2^31 elements: 131,072 rows of 64 heads of 128). Rows past an element's seq_len are masked where
// read and never written (Transformer Engine's THD with gaps between sequences relies on that;
// AttentionDocumentBatchesOnCudnnTouchOnlyTheirRows in tests/gpu/ops_gpu_test.cpp checks it on the
// loaded cuDNN), so a batch's documents need not be adjacent and its padded rows never reach a
// neighbour. The offsets ascend and the last is the end of the last element's real rows, the
// layout of cuDNN's THD callers. The stats, softmax sums and dQ accumulator stay padded [b, Hq, S]
// buffers: lcx's LSE is [Hq, T], not the [T, Hq] that cuDNN's ragged stats (9.6+) take.
#include "kernels/attention/cudnn/attention_cudnn.h"

#include <dlfcn.h>

#include <cfloat>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "cuda/check_libs.h"
#include "cuda/stream.h"
#include "kernels/attention/dispatch.h"
#include "kernels/cuda/cuda_ops.h"
#include "lcx/log.h"

namespace lcx::cuda {
namespace {

struct Api {
  decltype(&cudnnGetVersion) get_version = nullptr;
  decltype(&cudnnGetErrorString) error_string = nullptr;
  decltype(&cudnnGetLastErrorString) last_error = nullptr;
  decltype(&cudnnCreate) create = nullptr;
  decltype(&cudnnSetStream) set_stream = nullptr;
  decltype(&cudnnBackendCreateDescriptor) make = nullptr;
  decltype(&cudnnBackendDestroyDescriptor) destroy = nullptr;
  decltype(&cudnnBackendSetAttribute) set = nullptr;
  decltype(&cudnnBackendGetAttribute) get = nullptr;
  decltype(&cudnnBackendFinalize) finalize = nullptr;
  decltype(&cudnnBackendExecute) execute = nullptr;
};

// nullptr when libcudnn.so.9 or one of its entry points is missing.
const Api* api() {
  static const Api* loaded = []() -> const Api* {
    void* lib = dlopen("libcudnn.so.9", RTLD_NOW | RTLD_GLOBAL);
    if (!lib) return nullptr;
    static Api a;
    bool ok = true;
    auto sym = [&](const char* name, auto& fn) {
      void* p = dlsym(lib, name);
      ok = ok && p != nullptr;
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(p);
    };
    sym("cudnnGetVersion", a.get_version);
    sym("cudnnGetErrorString", a.error_string);
    sym("cudnnGetLastErrorString", a.last_error);
    sym("cudnnCreate", a.create);
    sym("cudnnSetStream", a.set_stream);
    sym("cudnnBackendCreateDescriptor", a.make);
    sym("cudnnBackendDestroyDescriptor", a.destroy);
    sym("cudnnBackendSetAttribute", a.set);
    sym("cudnnBackendGetAttribute", a.get);
    sym("cudnnBackendFinalize", a.finalize);
    sym("cudnnBackendExecute", a.execute);
    return ok ? &a : nullptr;
  }();
  return loaded;
}

std::mutex g_mu;  // guards the handle and the plan cache

// The run's choice ([run] attention, kernels/attention/dispatch.h): cuDNN forced, or not to run at all.
bool forced() { return ops::attention::choice() == ops::attention::Choice::cudnn; }
bool barred() { return !ops::attention::cudnn_allowed(ops::attention::choice()); }

// One backend descriptor, destroyed with its owner.
class Desc {
 public:
  explicit Desc(cudnnBackendDescriptorType_t t) { LCX_CUDNN_CHECK(api()->make(t, &d_)); }
  ~Desc() {
    if (d_) api()->destroy(d_);
  }
  Desc(const Desc&) = delete;
  Desc& operator=(const Desc&) = delete;
  cudnnBackendDescriptor_t get() const { return d_; }
  Desc& set(cudnnBackendAttributeName_t n, cudnnBackendAttributeType_t t, int64_t count, const void* v) {
    LCX_CUDNN_CHECK(api()->set(d_, n, t, count, v));
    return *this;
  }
  Desc& set_desc(cudnnBackendAttributeName_t n, const Desc& other) {
    cudnnBackendDescriptor_t o = other.get();
    return set(n, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &o);
  }
  Desc& set_type(cudnnBackendAttributeName_t n, cudnnDataType_t t) { return set(n, CUDNN_TYPE_DATA_TYPE, 1, &t); }
  Desc& set_i64(cudnnBackendAttributeName_t n, int64_t v) { return set(n, CUDNN_TYPE_INT64, 1, &v); }
  void finalize() { LCX_CUDNN_CHECK(api()->finalize(d_)); }

 private:
  cudnnBackendDescriptor_t d_ = nullptr;
};
using DescPtr = std::shared_ptr<Desc>;
using Dims = std::vector<int64_t>;

// An operation graph under construction; it owns every descriptor it made, for the plan's life.
class Graph {
 public:
  // offsets: nullptr, or the int64 [b+1,1,1,1] tensor of each batch element's first element (ragged).
  DescPtr tensor(int64_t uid, cudnnDataType_t t, const Dims& dims, const Dims& strides, bool is_virtual = false,
                 bool by_value = false, const DescPtr& offsets = nullptr) {
    auto d = keep(CUDNN_BACKEND_TENSOR_DESCRIPTOR);
    const int64_t align = 16;
    const bool v = is_virtual, bv = by_value;
    d->set_type(CUDNN_ATTR_TENSOR_DATA_TYPE, t)
        .set(CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, static_cast<int64_t>(dims.size()), dims.data())
        .set(CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, static_cast<int64_t>(strides.size()), strides.data())
        .set_i64(CUDNN_ATTR_TENSOR_UNIQUE_ID, uid)
        .set_i64(CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, align)
        .set(CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &v);
    if (by_value) d->set(CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, 1, &bv);
    if (offsets) d->set_desc(CUDNN_ATTR_TENSOR_RAGGED_OFFSET_DESC, *offsets);
    d->finalize();
    return d;
  }
  DescPtr virt(cudnnDataType_t t, const Dims& dims, const Dims& strides, const DescPtr& offsets = nullptr) {
    return tensor(next_virtual_++, t, dims, strides, true, false, offsets);
  }
  // A tensor in memory, at the ragged offsets when `offsets` is given.
  DescPtr io(int64_t uid, cudnnDataType_t t, const Dims& dims, const Dims& strides, const DescPtr& offsets) {
    return tensor(uid, t, dims, strides, false, false, offsets);
  }
  // A float passed by value through the variant pack.
  DescPtr scalar(int64_t uid) { return tensor(uid, CUDNN_DATA_FLOAT, {1, 1, 1, 1}, {1, 1, 1, 1}, false, true); }
  // An int32 passed by value likewise.
  DescPtr scalar_i32(int64_t uid) { return tensor(uid, CUDNN_DATA_INT32, {1, 1, 1, 1}, {1, 1, 1, 1}, false, true); }

  void pointwise(cudnnPointwiseMode_t mode, const DescPtr& x, const DescPtr& b, const DescPtr& y,
                 const DescPtr& t = nullptr, cudnnDataType_t precision = CUDNN_DATA_FLOAT, int64_t axis = -1) {
    auto pw = keep(CUDNN_BACKEND_POINTWISE_DESCRIPTOR);
    pw->set(CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &mode).set_type(CUDNN_ATTR_POINTWISE_MATH_PREC,
                                                                                    precision);
    if (axis >= 0) pw->set_i64(CUDNN_ATTR_POINTWISE_AXIS, axis);
    pw->finalize();
    auto op = keep(CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR);
    op->set_desc(CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, *pw).set_desc(CUDNN_ATTR_OPERATION_POINTWISE_XDESC, *x);
    if (b) op->set_desc(CUDNN_ATTR_OPERATION_POINTWISE_BDESC, *b);
    if (t) op->set_desc(CUDNN_ATTR_OPERATION_POINTWISE_TDESC, *t);
    op->set_desc(CUDNN_ATTR_OPERATION_POINTWISE_YDESC, *y);
    op->finalize();
    ops_.push_back(op);
  }
  void reduction(cudnnReduceTensorOp_t mode, const DescPtr& x, const DescPtr& y) {
    auto red = keep(CUDNN_BACKEND_REDUCTION_DESCRIPTOR);
    red->set(CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1, &mode)
        .set_type(CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_DATA_FLOAT);
    red->finalize();
    auto op = keep(CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR);
    op->set_desc(CUDNN_ATTR_OPERATION_REDUCTION_XDESC, *x)
        .set_desc(CUDNN_ATTR_OPERATION_REDUCTION_YDESC, *y)
        .set_desc(CUDNN_ATTR_OPERATION_REDUCTION_DESC, *red);
    op->finalize();
    ops_.push_back(op);
  }
  // m, n, k: per-batch-element sizes that override the GEMM's (padded batches: the real rows),
  // each an int32 [b,1,1,1] tensor or nullptr.
  void matmul(const DescPtr& a, const DescPtr& b, const DescPtr& c, const DescPtr& m = nullptr,
              const DescPtr& n = nullptr, const DescPtr& k = nullptr) {
    auto mm = keep(CUDNN_BACKEND_MATMUL_DESCRIPTOR);
    mm->set_type(CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_DATA_FLOAT);
    mm->finalize();
    auto op = keep(CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR);
    op->set_desc(CUDNN_ATTR_OPERATION_MATMUL_ADESC, *a)
        .set_desc(CUDNN_ATTR_OPERATION_MATMUL_BDESC, *b)
        .set_desc(CUDNN_ATTR_OPERATION_MATMUL_CDESC, *c)
        .set_desc(CUDNN_ATTR_OPERATION_MATMUL_DESC, *mm);
    if (m) op->set_desc(CUDNN_ATTR_OPERATION_MATMUL_GEMM_M_OVERRIDE_DESC, *m);
    if (n) op->set_desc(CUDNN_ATTR_OPERATION_MATMUL_GEMM_N_OVERRIDE_DESC, *n);
    if (k) op->set_desc(CUDNN_ATTR_OPERATION_MATMUL_GEMM_K_OVERRIDE_DESC, *k);
    op->finalize();
    ops_.push_back(op);
  }
  void reshape(const DescPtr& x, const DescPtr& y) {
    auto op = keep(CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR);
    op->set_desc(CUDNN_ATTR_OPERATION_RESHAPE_XDESC, *x).set_desc(CUDNN_ATTR_OPERATION_RESHAPE_YDESC, *y);
    op->finalize();
    ops_.push_back(op);
  }
  // Keeps s where the row index >= the column index, else `neg` (uid neg_uid): the causal mask. With
  // kv_rows_uid and q_rows_uid (int32 scalars by value, S and T), where the row index + S - T >= the
  // column index: queries at the last T of the S keys' positions, as cuDNN's own SDPA graphs align a
  // causal mask bottom-right for fixed sizes.
  DescPtr causal_mask(const DescPtr& s, const Dims& dims, const Dims& strides, int64_t neg_uid,
                      int64_t kv_rows_uid = -1, int64_t q_rows_uid = -1) {
    auto row = virt(CUDNN_DATA_INT32, dims, strides), col = virt(CUDNN_DATA_INT32, dims, strides);
    pointwise(CUDNN_POINTWISE_GEN_INDEX, s, nullptr, row, nullptr, CUDNN_DATA_INT32, 2);
    pointwise(CUDNN_POINTWISE_GEN_INDEX, s, nullptr, col, nullptr, CUDNN_DATA_INT32, 3);
    if (kv_rows_uid >= 0) {
      auto plus_kv = virt(CUDNN_DATA_INT32, dims, strides), shifted = virt(CUDNN_DATA_INT32, dims, strides);
      pointwise(CUDNN_POINTWISE_ADD, row, scalar_i32(kv_rows_uid), plus_kv, nullptr, CUDNN_DATA_INT32, 3);
      pointwise(CUDNN_POINTWISE_SUB, plus_kv, scalar_i32(q_rows_uid), shifted, nullptr, CUDNN_DATA_INT32, 3);
      row = shifted;
    }
    auto keep_it = virt(CUDNN_DATA_BOOLEAN, dims, strides);
    pointwise(CUDNN_POINTWISE_CMP_GE, row, col, keep_it, nullptr, CUDNN_DATA_BOOLEAN);
    auto out = virt(CUDNN_DATA_FLOAT, dims, strides);
    pointwise(CUDNN_POINTWISE_BINARY_SELECT, s, scalar(neg_uid), out, keep_it);
    return out;
  }
  // Keeps s where the row index < seq_q and the column index < seq_kv (int32 [b,1,1,1], each batch
  // element's real rows), else `neg`: the padding mask, as cuDNN's own SDPA graphs spell it
  // (GEN_INDEX, CMP_LT, LOGICAL_AND, BINARY_SELECT), which is what lets its flash engines skip the
  // padded tiles rather than compute and discard them.
  DescPtr padding_mask(const DescPtr& s, const Dims& dims, const Dims& strides, const DescPtr& seq_q,
                       const DescPtr& seq_kv, int64_t neg_uid) {
    auto row = virt(CUDNN_DATA_INT32, dims, strides), col = virt(CUDNN_DATA_INT32, dims, strides);
    pointwise(CUDNN_POINTWISE_GEN_INDEX, s, nullptr, row, nullptr, CUDNN_DATA_INT32, 2);
    pointwise(CUDNN_POINTWISE_GEN_INDEX, s, nullptr, col, nullptr, CUDNN_DATA_INT32, 3);
    auto row_in = virt(CUDNN_DATA_BOOLEAN, dims, strides), col_in = virt(CUDNN_DATA_BOOLEAN, dims, strides);
    pointwise(CUDNN_POINTWISE_CMP_LT, row, seq_q, row_in, nullptr, CUDNN_DATA_BOOLEAN);
    pointwise(CUDNN_POINTWISE_CMP_LT, col, seq_kv, col_in, nullptr, CUDNN_DATA_BOOLEAN);
    auto keep_it = virt(CUDNN_DATA_BOOLEAN, dims, strides);
    pointwise(CUDNN_POINTWISE_LOGICAL_AND, row_in, col_in, keep_it, nullptr, CUDNN_DATA_BOOLEAN);
    auto out = virt(CUDNN_DATA_FLOAT, dims, strides);
    pointwise(CUDNN_POINTWISE_BINARY_SELECT, s, scalar(neg_uid), out, keep_it);
    return out;
  }
  // Keeps s where the column index + window > the row index, else `neg` (uid neg_uid): the sliding
  // window's left bound (the window, uid window_uid, a float by value; W - (S - T) where the masks
  // are aligned bottom-right), spelled as cuDNN's own SDPA graphs spell their band mask's
  // (GEN_INDEX, ADD in fp32, CMP_GT, BINARY_SELECT) after the causal mask, which its flash engines
  // recognise to skip the key tiles outside the band.
  DescPtr window_mask(const DescPtr& s, const Dims& dims, const Dims& strides, int64_t window_uid, int64_t neg_uid) {
    auto row = virt(CUDNN_DATA_INT32, dims, strides), col = virt(CUDNN_DATA_INT32, dims, strides);
    pointwise(CUDNN_POINTWISE_GEN_INDEX, s, nullptr, row, nullptr, CUDNN_DATA_INT32, 2);
    pointwise(CUDNN_POINTWISE_GEN_INDEX, s, nullptr, col, nullptr, CUDNN_DATA_INT32, 3);
    auto shifted = virt(CUDNN_DATA_FLOAT, dims, strides);
    pointwise(CUDNN_POINTWISE_ADD, col, scalar(window_uid), shifted, nullptr, CUDNN_DATA_FLOAT);
    auto keep_it = virt(CUDNN_DATA_BOOLEAN, dims, strides);
    pointwise(CUDNN_POINTWISE_CMP_GT, shifted, row, keep_it, nullptr, CUDNN_DATA_BOOLEAN);
    auto out = virt(CUDNN_DATA_FLOAT, dims, strides);
    pointwise(CUDNN_POINTWISE_BINARY_SELECT, s, scalar(neg_uid), out, keep_it);
    return out;
  }
  const std::vector<DescPtr>& ops() const { return ops_; }

 private:
  DescPtr keep(cudnnBackendDescriptorType_t t) {
    auto d = std::make_shared<Desc>(t);
    all_.push_back(d);
    return d;
  }
  std::vector<DescPtr> all_, ops_;
  int64_t next_virtual_ = 1000;
};

enum Uid : int64_t {
  kQ = 1, kK, kV, kO, kStats, kScale, kNeg, kDO, kDQ, kDK, kDV, kSoftmaxSum, kDQAccum, kOne, kSeqQ, kSeqKV, kPadNeg,
  kQOffsets, kKOffsets, kWindow, kWindowNeg, kSeqKvRows, kSeqQRows
};

struct Plan {
  Graph graph;
  std::unique_ptr<Desc> op_graph, plan;
  int64_t workspace = 0;
};

cudnnHandle_t handle() {
  static cudnnHandle_t h = [] {
    cudnnHandle_t x = nullptr;
    LCX_CUDNN_CHECK(api()->create(&x));
    return x;
  }();
  return h;
}

// Finalizes the graph and the first engine configuration heuristics mode A offers that builds.
void finalize_plan(Plan& p) {
  std::vector<cudnnBackendDescriptor_t> ops;
  for (const auto& op : p.graph.ops()) ops.push_back(op->get());
  cudnnHandle_t h = handle();
  p.op_graph = std::make_unique<Desc>(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR);
  p.op_graph->set(CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, static_cast<int64_t>(ops.size()),
                  ops.data())
      .set(CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &h);
  p.op_graph->finalize();

  Desc heur(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR);
  const cudnnBackendHeurMode_t mode = CUDNN_HEUR_MODE_A;
  heur.set_desc(CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, *p.op_graph)
      .set(CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode);
  heur.finalize();
  int64_t n = 0;
  LCX_CUDNN_CHECK(api()->get(heur.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &n, nullptr));
  if (n == 0) throw Error("cuDNN heuristics offer no engine for this attention graph");
  std::vector<std::unique_ptr<Desc>> cfgs;
  std::vector<cudnnBackendDescriptor_t> raw;
  for (int64_t i = 0; i < n; ++i) {
    cfgs.push_back(std::make_unique<Desc>(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR));
    raw.push_back(cfgs.back()->get());
  }
  LCX_CUDNN_CHECK(api()->get(heur.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, n, &n, raw.data()));
  std::string last;
  for (int64_t i = 0; i < n; ++i) {
    auto plan = std::make_unique<Desc>(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR);
    plan->set(CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1, &h)
        .set_desc(CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, *cfgs[static_cast<size_t>(i)]);
    const cudnnStatus_t st = api()->finalize(plan->get());
    if (st != CUDNN_STATUS_SUCCESS) {
      last = cudnn_error_string(st);
      continue;
    }
    int64_t count = 0;
    LCX_CUDNN_CHECK(api()->get(plan->get(), CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, CUDNN_TYPE_INT64, 1, &count,
                               &p.workspace));
    p.plan = std::move(plan);
    return;
  }
  throw Error(str("none of cuDNN's ", n, " engine configurations builds this attention graph: ", last));
}

cudnnDataType_t cudnn_type(DType t) { return t == DType::bf16 ? CUDNN_DATA_BFLOAT16 : CUDNN_DATA_HALF; }

// b batch elements, each [T, heads, d] rows in lcx's layout one after another ([b*T, heads, d]);
// b = 1 but for padded batches of documents, whose `padded` graphs carry each element's real rows
// (seq_len, int32 [b,1,1,1]) as the padding mask and the GEMMs' size overrides. `ragged` (with
// padded) places the elements of q, k, v, out and their gradients at offsets given per call.
struct Shape4 {
  int64_t b, T, S, Hq, Hkv, d;
  bool padded = false, ragged = false;
  Dims q_dims() const { return {b, Hq, T, d}; }
  Dims q_strides() const { return {T * Hq * d, d, Hq * d, 1}; }
  Dims kv_dims() const { return {b, Hkv, S, d}; }
  Dims kv_strides() const { return {S * Hkv * d, d, Hkv * d, 1}; }
  Dims kvt_dims() const { return {b, Hkv, d, S}; }
  Dims kvt_strides() const { return {S * Hkv * d, d, 1, Hkv * d}; }
  Dims s_dims() const { return {b, Hq, T, S}; }
  Dims s_strides() const { return {Hq * T * S, T * S, S, 1}; }
  Dims st_dims() const { return {b, Hq, S, T}; }
  Dims st_strides() const { return {Hq * T * S, T * S, 1, S}; }
  Dims row_dims() const { return {b, Hq, T, 1}; }
  Dims row_strides() const { return {Hq * T, T, 1, 1}; }
  Dims len_dims() const { return {b, 1, 1, 1}; }
  Dims offset_dims() const { return {b + 1, 1, 1, 1}; }
};

// A single call's causal mask aligns bottom-right where its keys outnumber its queries: the dispatch
// sends cuDNN such a call only with a window, the queries at the last of the keys' positions (a
// ring's chunk beside the rows before it that its window reaches).
bool bottom_right(const Shape4& s, bool causal) { return causal && !s.padded && s.S != s.T; }

// The query side's and the key side's ragged offsets of a ragged shape's graph, else nullptrs.
std::pair<DescPtr, DescPtr> ragged_offsets(Graph& g, const Shape4& s) {
  if (!s.ragged) return {};
  return {g.tensor(kQOffsets, CUDNN_DATA_INT64, s.offset_dims(), {1, 1, 1, 1}),
          g.tensor(kKOffsets, CUDNN_DATA_INT64, s.offset_dims(), {1, 1, 1, 1})};
}

// The forward graph's operations, each finalized (which checks shapes and types); not yet a plan.
// `windowed`: the band mask after the causal one, the window passed by value with each call.
std::unique_ptr<Plan> forward_plan(const Shape4& s, DType dt, bool causal, bool windowed) {
  auto p = std::make_unique<Plan>();
  Graph& g = p->graph;
  const cudnnDataType_t io = cudnn_type(dt), f32 = CUDNN_DATA_FLOAT;
  const auto [q_at, k_at] = ragged_offsets(g, s);
  auto Q = g.io(kQ, io, s.q_dims(), s.q_strides(), q_at);
  auto KT = g.io(kK, io, s.kvt_dims(), s.kvt_strides(), k_at);
  auto V = g.io(kV, io, s.kv_dims(), s.kv_strides(), k_at);
  auto O = g.io(kO, io, s.q_dims(), s.q_strides(), q_at);
  auto stats = g.tensor(kStats, f32, s.row_dims(), s.row_strides());
  DescPtr seq_q, seq_kv;  // nullptr unless padded
  if (s.padded) {
    seq_q = g.tensor(kSeqQ, CUDNN_DATA_INT32, s.len_dims(), {1, 1, 1, 1});
    seq_kv = g.tensor(kSeqKV, CUDNN_DATA_INT32, s.len_dims(), {1, 1, 1, 1});
  }
  auto S0 = g.virt(f32, s.s_dims(), s.s_strides());
  g.matmul(Q, KT, S0, seq_q, seq_kv);
  auto S1 = g.virt(f32, s.s_dims(), s.s_strides());
  g.pointwise(CUDNN_POINTWISE_MUL, S0, g.scalar(kScale), S1);
  // The padding mask, then the causal one: the order of cuDNN's own SDPA graphs.
  auto padded = s.padded ? g.padding_mask(S1, s.s_dims(), s.s_strides(), seq_q, seq_kv, kPadNeg) : S1;
  auto masked = !causal                   ? padded
                : bottom_right(s, causal) ? g.causal_mask(padded, s.s_dims(), s.s_strides(), kNeg, kSeqKvRows, kSeqQRows)
                                          : g.causal_mask(padded, s.s_dims(), s.s_strides(), kNeg);
  auto scores = windowed ? g.window_mask(masked, s.s_dims(), s.s_strides(), kWindow, kWindowNeg) : masked;
  auto M = g.virt(f32, s.row_dims(), s.row_strides());
  g.reduction(CUDNN_REDUCE_TENSOR_MAX, scores, M);
  auto Z = g.virt(f32, s.s_dims(), s.s_strides());
  g.pointwise(CUDNN_POINTWISE_SUB, scores, M, Z);
  auto E = g.virt(f32, s.s_dims(), s.s_strides());
  g.pointwise(CUDNN_POINTWISE_EXP, Z, nullptr, E);
  auto L = g.virt(f32, s.row_dims(), s.row_strides());
  g.reduction(CUDNN_REDUCE_TENSOR_ADD, E, L);
  auto logL = g.virt(f32, s.row_dims(), s.row_strides());
  g.pointwise(CUDNN_POINTWISE_LOG, L, nullptr, logL);
  g.pointwise(CUDNN_POINTWISE_ADD, M, logL, stats);
  auto P = g.virt(io, s.s_dims(), s.s_strides());
  g.pointwise(CUDNN_POINTWISE_DIV, E, L, P);
  g.matmul(P, V, O, seq_q, nullptr, seq_kv);
  return p;
}

// The backward graph's operations, likewise.
std::unique_ptr<Plan> backward_plan(const Shape4& s, DType dt, bool causal, bool windowed) {
  auto p = std::make_unique<Plan>();
  Graph& g = p->graph;
  const cudnnDataType_t io = cudnn_type(dt), f32 = CUDNN_DATA_FLOAT;
  const auto [q_at, k_at] = ragged_offsets(g, s);
  auto Q = g.io(kQ, io, s.q_dims(), s.q_strides(), q_at);
  auto KT = g.io(kK, io, s.kvt_dims(), s.kvt_strides(), k_at);
  auto VT = g.io(kV, io, s.kvt_dims(), s.kvt_strides(), k_at);
  auto O = g.io(kO, io, s.q_dims(), s.q_strides(), q_at);
  auto stats = g.tensor(kStats, f32, s.row_dims(), s.row_strides());
  auto dO = g.io(kDO, io, s.q_dims(), s.q_strides(), q_at);
  auto dQ = g.io(kDQ, io, s.q_dims(), s.q_strides(), q_at);
  auto dK = g.io(kDK, io, s.kv_dims(), s.kv_strides(), k_at);
  auto dV = g.io(kDV, io, s.kv_dims(), s.kv_strides(), k_at);
  auto softmax_sum = g.tensor(kSoftmaxSum, f32, s.row_dims(), s.row_strides());
  auto dQ_accum = g.tensor(kDQAccum, f32, s.q_dims(), {s.Hq * s.T * s.d, s.T * s.d, s.d, 1});
  auto scale = g.scalar(kScale);
  DescPtr seq_q, seq_kv;  // nullptr unless padded
  if (s.padded) {
    seq_q = g.tensor(kSeqQ, CUDNN_DATA_INT32, s.len_dims(), {1, 1, 1, 1});
    seq_kv = g.tensor(kSeqKV, CUDNN_DATA_INT32, s.len_dims(), {1, 1, 1, 1});
  }

  // softmax_sum = rowsum(dO * O)
  auto dOO = g.virt(f32, s.q_dims(), s.q_strides());
  g.pointwise(CUDNN_POINTWISE_MUL, dO, O, dOO);
  auto rowsum = g.virt(f32, s.row_dims(), s.row_strides());
  g.reduction(CUDNN_REDUCE_TENSOR_ADD, dOO, rowsum);
  g.pointwise(CUDNN_POINTWISE_MUL, rowsum, g.scalar(kOne), softmax_sum);

  // P = exp(scale * Q K^T - stats), masked (padding before the stats, causal and the window after:
  // as cuDNN's own SDPA backward graphs)
  auto S0 = g.virt(f32, s.s_dims(), s.s_strides());
  g.matmul(Q, KT, S0, seq_q, seq_kv);
  auto S1 = g.virt(f32, s.s_dims(), s.s_strides());
  g.pointwise(CUDNN_POINTWISE_MUL, S0, scale, S1);
  auto S1p = s.padded ? g.padding_mask(S1, s.s_dims(), s.s_strides(), seq_q, seq_kv, kPadNeg) : S1;
  auto S2 = g.virt(f32, s.s_dims(), s.s_strides());
  g.pointwise(CUDNN_POINTWISE_SUB, S1p, stats, S2);
  auto S3 = !causal                   ? S2
            : bottom_right(s, causal) ? g.causal_mask(S2, s.s_dims(), s.s_strides(), kNeg, kSeqKvRows, kSeqQRows)
                                      : g.causal_mask(S2, s.s_dims(), s.s_strides(), kNeg);
  auto S4 = windowed ? g.window_mask(S3, s.s_dims(), s.s_strides(), kWindow, kWindowNeg) : S3;
  auto P = g.virt(f32, s.s_dims(), s.s_strides());
  g.pointwise(CUDNN_POINTWISE_EXP, S4, nullptr, P);

  // dV = P^T dO, summed over each GQA group
  auto PT = g.virt(io, s.st_dims(), s.st_strides());
  g.reshape(P, PT);
  const bool gqa = s.Hq != s.Hkv;
  const Dims full_dims{s.b, s.Hq, s.S, s.d}, full_strides{s.Hq * s.S * s.d, s.S * s.d, s.d, 1};
  if (gqa) {
    auto dV_full = g.virt(io, full_dims, full_strides);
    g.matmul(PT, dO, dV_full, seq_kv, nullptr, seq_q);
    g.reduction(CUDNN_REDUCE_TENSOR_ADD, dV_full, dV);
  } else {
    g.matmul(PT, dO, dV, seq_kv, nullptr, seq_q);
  }

  // dS = P * (dO V^T - softmax_sum) * scale
  auto dP = g.virt(f32, s.s_dims(), s.s_strides());
  g.matmul(dO, VT, dP, seq_q, seq_kv);
  auto dP1 = g.virt(f32, s.s_dims(), s.s_strides());
  g.pointwise(CUDNN_POINTWISE_SUB, dP, softmax_sum, dP1);
  auto dS0 = g.virt(f32, s.s_dims(), s.s_strides());
  g.pointwise(CUDNN_POINTWISE_MUL, dP1, P, dS0);
  auto dS = g.virt(f32, s.s_dims(), s.s_strides());
  g.pointwise(CUDNN_POINTWISE_MUL, dS0, scale, dS);

  // dK = dS^T Q, summed over each GQA group
  auto dST = g.virt(io, s.st_dims(), s.st_strides());
  g.reshape(dS, dST);
  if (gqa) {
    auto dK_full = g.virt(io, full_dims, full_strides);
    g.matmul(dST, Q, dK_full, seq_kv, nullptr, seq_q);
    g.reduction(CUDNN_REDUCE_TENSOR_ADD, dK_full, dK);
  } else {
    g.matmul(dST, Q, dK, seq_kv, nullptr, seq_q);
  }

  // dQ = dS K through the fp32 accumulator (K, read through K^T's strides, at K's offsets)
  auto K = g.virt(io, s.kv_dims(), s.kv_strides(), k_at);
  g.reshape(KT, K);
  g.matmul(dS, K, dQ_accum, seq_q, nullptr, seq_kv);
  g.pointwise(CUDNN_POINTWISE_IDENTITY, dQ_accum, nullptr, dQ);
  return p;
}

using PlanKey = std::tuple<bool, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int, bool, bool, bool, bool>;
std::map<PlanKey, std::unique_ptr<Plan>> g_plans;  // nullptr: cuDNN refused the shape

// The cached plan for the call, built on first use; nullptr when cuDNN refuses it (logged once,
// or thrown when the choice is `cudnn`, but for a ragged shape: its padded twin still runs on cuDNN).
// Called under g_mu.
Plan* plan_for(bool backward, const Shape4& s, DType t, bool causal, bool windowed) {
  const PlanKey key{backward, s.b, s.T, s.S, s.Hq, s.Hkv, s.d, static_cast<int>(t), causal, s.padded, s.ragged, windowed};
  auto it = g_plans.find(key);
  if (it == g_plans.end()) {
    std::unique_ptr<Plan> plan;
    try {
      plan = backward ? backward_plan(s, t, causal, windowed) : forward_plan(s, t, causal, windowed);
      finalize_plan(*plan);
    } catch (const Error& e) {
      if (forced() && !s.ragged) throw;
      // A cuDNN without ragged offsets refuses every batch shape of a run alike: one line says so.
      static bool ragged_told = false;
      if (!s.ragged || !std::exchange(ragged_told, true))
        log::warn(str("cuDNN attention ", backward ? "backward" : "forward", " refused b=", s.b,
                      s.ragged ? " (ragged)" : s.padded ? " (padded)" : "", " T=", s.T, " S=", s.S, " Hq=",
                      s.Hq, " Hkv=", s.Hkv, " d=", s.d, causal ? " causal" : " full", windowed ? " windowed" : "",
                      ": ", e.what(),
                      s.ragged ? "; padded copies of its documents run it (later ragged refusals are not logged)"
                               : "; the own kernels run it"));
    }
    it = g_plans.emplace(key, std::move(plan)).first;
  }
  if (!it->second && forced() && !s.ragged)
    throw Error("cuDNN refused this attention shape earlier (see the log)", "run.attention",
                "attention = \"auto\" runs it on lcx's own kernels");
  return it->second.get();
}

// The by-value scalars of a call's masks; they outlive its execute().
struct MaskValues {
  float neg = -FLT_MAX, window = 0;
  int32_t kv_rows = 0, q_rows = 0;
};

// The masks' scalars a plan of shape s reads: the causal mask's fill (and its bottom-right shift),
// the window (counted from the bottom-right diagonal there) and its fill.
void add_masks(const ops::AttentionParams& p, const Shape4& s, MaskValues& m, std::vector<int64_t>& uids,
               std::vector<void*>& ptrs) {
  const bool shifted = bottom_right(s, p.causal);
  if (p.causal) {
    uids.push_back(kNeg);
    ptrs.push_back(&m.neg);
  }
  if (shifted) {
    m.kv_rows = static_cast<int32_t>(s.S);
    m.q_rows = static_cast<int32_t>(s.T);
    uids.insert(uids.end(), {kSeqKvRows, kSeqQRows});
    ptrs.insert(ptrs.end(), {&m.kv_rows, &m.q_rows});
  }
  if (p.window > 0) {
    m.window = static_cast<float>(shifted ? p.window - (s.S - s.T) : p.window);
    uids.insert(uids.end(), {kWindow, kWindowNeg});
    ptrs.insert(ptrs.end(), {&m.window, &m.neg});
  }
}

// cuDNN before 9.6 computes a window aligned bottom-right only where T == S (cuDNN's frontend
// refuses the rest there): its calls of more keys than queries decline to the own kernels, which
// the log says once. Called under g_mu.
bool takes_bottom_right(const Shape4& s, bool causal) {
  if (!bottom_right(s, causal) || api()->get_version() >= 90600) return true;
  static bool told = false;
  if (!std::exchange(told, true))
    log::warn(str("cuDNN ", cudnn_version(), " does not take a windowed chunk beside its halo (queries at the last of ",
                  "more key positions; cuDNN 9.6 does): the own kernels run such calls"));
  return false;
}

// Allocates the plan's workspace, then hands the call to `launch`: first zeroing `accumulator`
// (the backward's fp32 dQ accumulator) where given.
void execute(Plan& plan, const std::vector<int64_t>& uids, const std::vector<void*>& ptrs, Device device,
             ops::Launch launch, const Tensor* accumulator = nullptr) {
  Tensor workspace = Tensor::empty({std::max<int64_t>(1, (plan.workspace + 7) / 8)}, DType::i64, device);
  launch([&] {
    if (accumulator)
      LCX_CUDA_CHECK(cudaMemsetAsync(accumulator->data(), 0, accumulator->nbytes(), current_stream()));
    Desc pack(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR);
    void* ws = workspace.data();
    pack.set(CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, static_cast<int64_t>(uids.size()), uids.data())
        .set(CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, static_cast<int64_t>(ptrs.size()),
             ptrs.data())
        .set(CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &ws);
    pack.finalize();
    LCX_CUDNN_CHECK(api()->set_stream(handle(), current_stream()));
    LCX_CUDNN_CHECK(api()->execute(handle(), plan.plan->get(), pack.get()));
  });
}

}  // namespace

std::string cudnn_error_string(cudnnStatus_t status) {
  const Api* a = api();
  if (!a) return str("cuDNN status ", static_cast<int>(status));
  char msg[512] = {};
  a->last_error(msg, sizeof msg);
  return str(a->error_string(status), msg[0] ? str(" (", msg, ")") : std::string());
}

std::string cudnn_version() {
  const Api* a = api();
  if (!a) return {};
  const size_t v = a->get_version();
  return str(v / 10000, ".", (v % 10000) / 100, ".", v % 100);
}

bool cudnn_attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, Tensor& lse,
                             const ops::AttentionParams& p, ops::Launch launch) {
  std::lock_guard lock(g_mu);
  const Shape4 s{1, q.size(0), k.size(0), q.size(1), k.size(1), q.size(2)};
  if (!takes_bottom_right(s, p.causal)) return false;
  Plan* plan = plan_for(false, s, q.dtype(), p.causal, p.window > 0);
  if (!plan) return false;
  float scale = p.scale;
  MaskValues masks;
  std::vector<int64_t> uids{kQ, kK, kV, kO, kStats, kScale};
  std::vector<void*> ptrs{q.data(), k.data(), v.data(), out.data(), lse.data(), &scale};
  add_masks(p, s, masks, uids, ptrs);
  execute(*plan, uids, ptrs, q.device(), launch);
  return true;
}

int64_t cudnn_attention_workspace(bool backward, int64_t T, int64_t S, int64_t Hq, int64_t Hkv, int64_t d, DType t,
                                  bool causal, bool windowed) {
  std::lock_guard lock(g_mu);
  if (!api() || barred()) return -1;
  const Plan* plan = plan_for(backward, Shape4{1, T, S, Hq, Hkv, d}, t, causal, windowed);
  return plan ? plan->workspace : -1;
}

bool cudnn_attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                              const Tensor& lse, const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv,
                              const ops::AttentionParams& p, ops::Launch launch) {
  std::lock_guard lock(g_mu);
  const Shape4 s{1, q.size(0), k.size(0), q.size(1), k.size(1), q.size(2)};
  if (!takes_bottom_right(s, p.causal)) return false;
  Plan* plan = plan_for(true, s, q.dtype(), p.causal, p.window > 0);
  if (!plan) return false;
  Tensor softmax_sum = Tensor::empty({s.Hq, s.T}, DType::f32, q.device());
  Tensor dq_accum = Tensor::empty({s.Hq, s.T, s.d}, DType::f32, q.device());
  float scale = p.scale, one = 1.f;
  MaskValues masks;
  std::vector<int64_t> uids{kQ, kK, kV, kO, kStats, kScale, kDO, kDQ, kDK, kDV, kSoftmaxSum, kDQAccum, kOne};
  std::vector<void*> ptrs{q.data(),  k.data(),  v.data(),           out.data(),      lse.data(), &scale, dout.data(),
                          dq.data(), dk.data(), dv.data(), softmax_sum.data(), dq_accum.data(), &one};
  add_masks(p, s, masks, uids, ptrs);
  execute(*plan, uids, ptrs, q.device(), launch, &dq_accum);
  return true;
}

namespace {

// Why cuDNN does not take padded batches of this dtype and head size, or "" when it may.
std::string padded_refusal(DType t, int64_t d) {
  if (!api()) return "libcudnn.so.9 is not loadable";
  if (t != DType::bf16 && t != DType::f16) return "cuDNN attention takes bf16 or fp16";
  const int64_t most = ops::attention::cudnn_max_head_dim(ops::cuda::attention_device_caps());
  if (d % 8 != 0 || d > most) return str("cuDNN attention takes head_dim a multiple of 8 up to ", most, " here");
  return {};
}

bool g_ragged = true;  // set_cudnn_ragged_documents; guarded by g_mu

// The batch's plan, padded or ragged, or nullptr (the caller runs its documents another way).
// Called under g_mu.
Plan* batch_plan(bool backward, bool ragged, int64_t B, int64_t Sq, int64_t Sk, int64_t Hq, int64_t Hkv, int64_t d,
                 DType t, bool causal, bool windowed) {
  if (barred() || (ragged && !g_ragged)) return nullptr;
  if (const std::string why = padded_refusal(t, d); !why.empty()) {
    if (forced())
      throw Error(str("[run] attention = \"cudnn\": ", why), "run.attention",
                  "attention = \"auto\" runs these documents on lcx's own kernels");
    return nullptr;
  }
  return plan_for(backward, Shape4{B, Sq, Sk, Hq, Hkv, d, true, ragged}, t, causal, windowed);
}

void* device(const void* p) { return const_cast<void*>(p); }

// The forward of a padded or ragged batch: q, k, v, out and stats where the plan reads them.
void batch_forward(Plan& plan, const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, Tensor& stats,
                   const int32_t* seq_q, const int32_t* seq_kv, const int64_t* q_at, const int64_t* k_at,
                   const ops::AttentionParams& p, ops::Launch launch) {
  float scale = p.scale, neg = -FLT_MAX;
  MaskValues masks;
  std::vector<int64_t> uids{kQ, kK, kV, kO, kStats, kScale, kPadNeg, kSeqQ, kSeqKV};
  std::vector<void*> ptrs{q.data(), k.data(), v.data(), out.data(), stats.data(), &scale, &neg, device(seq_q),
                          device(seq_kv)};
  if (q_at) {
    uids.insert(uids.end(), {kQOffsets, kKOffsets});
    ptrs.insert(ptrs.end(), {device(q_at), device(k_at)});
  }
  add_masks(p, Shape4{0, 0, 0, 0, 0, 0, true}, masks, uids, ptrs);
  execute(plan, uids, ptrs, q.device(), launch);
}

// The backward likewise; its softmax sums and dQ accumulator are [B, Hq, Sq(, d)] fp32 either way.
void batch_backward(Plan& plan, int64_t B, int64_t Sq, const Tensor& q, const Tensor& k, const Tensor& v,
                    const Tensor& out, const Tensor& stats, const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv,
                    const int32_t* seq_q, const int32_t* seq_kv, const int64_t* q_at, const int64_t* k_at,
                    const ops::AttentionParams& p, ops::Launch launch) {
  const int64_t Hq = q.size(1), d = q.size(2);
  Tensor softmax_sum = Tensor::empty({B * Hq * Sq}, DType::f32, q.device());
  Tensor dq_accum = Tensor::empty({B * Hq * Sq * d}, DType::f32, q.device());
  float scale = p.scale, neg = -FLT_MAX, one = 1.f;
  MaskValues masks;
  std::vector<int64_t> uids{kQ,  kK,          kV,       kO,   kStats,  kScale, kDO,    kDQ,
                            kDK, kDV, kSoftmaxSum, kDQAccum, kOne, kPadNeg, kSeqQ, kSeqKV};
  std::vector<void*> ptrs{q.data(),  k.data(),  v.data(),           out.data(),      stats.data(), &scale,
                          dout.data(), dq.data(), dk.data(),        dv.data(),       softmax_sum.data(),
                          dq_accum.data(), &one, &neg, device(seq_q), device(seq_kv)};
  if (q_at) {
    uids.insert(uids.end(), {kQOffsets, kKOffsets});
    ptrs.insert(ptrs.end(), {device(q_at), device(k_at)});
  }
  add_masks(p, Shape4{0, 0, 0, 0, 0, 0, true}, masks, uids, ptrs);
  execute(plan, uids, ptrs, q.device(), launch, &dq_accum);
}

}  // namespace

bool cudnn_batch_attention_ready(bool backward, bool ragged, int64_t B, int64_t Sq, int64_t Sk, int64_t Hq,
                                 int64_t Hkv, int64_t d, DType t, bool causal, bool windowed) {
  std::lock_guard lock(g_mu);
  return batch_plan(backward, ragged, B, Sq, Sk, Hq, Hkv, d, t, causal, windowed) != nullptr;
}

namespace {
// Runs `run` on the batch's cached plan under g_mu (ragged when offsets are given); the plan must
// exist: cudnn_batch_attention_ready said so.
template <class Run>
void with_batch_plan(bool backward, const Tensor& q, const Tensor& k, const int64_t* q_offsets, int64_t B, int64_t Sq,
                     int64_t Sk, const ops::AttentionParams& p, Run run) {
  std::lock_guard lock(g_mu);
  Plan* plan = batch_plan(backward, q_offsets != nullptr, B, Sq, Sk, q.size(1), k.size(1), q.size(2), q.dtype(), p.causal,
                          p.window > 0);
  LCX_CHECK(plan, "a cuDNN batch of documents without a plan: ask cudnn_batch_attention_ready first");
  run(*plan);
}
}  // namespace

void cudnn_batch_attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, Tensor& stats,
                                   const int32_t* seq_q, const int32_t* seq_kv, const int64_t* q_offsets,
                                   const int64_t* k_offsets, int64_t B, int64_t Sq, int64_t Sk,
                                   const ops::AttentionParams& p, ops::Launch launch) {
  with_batch_plan(false, q, k, q_offsets, B, Sq, Sk, p, [&](Plan& plan) {
    batch_forward(plan, q, k, v, out, stats, seq_q, seq_kv, q_offsets, k_offsets, p, launch);
  });
}

void cudnn_batch_attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                                    const Tensor& stats, const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv,
                                    const int32_t* seq_q, const int32_t* seq_kv, const int64_t* q_offsets,
                                    const int64_t* k_offsets, int64_t B, int64_t Sq, int64_t Sk,
                                    const ops::AttentionParams& p, ops::Launch launch) {
  with_batch_plan(true, q, k, q_offsets, B, Sq, Sk, p, [&](Plan& plan) {
    batch_backward(plan, B, Sq, q, k, v, out, stats, dout, dq, dk, dv, seq_q, seq_kv, q_offsets, k_offsets, p,
                   launch);
  });
}

void set_cudnn_ragged_documents(bool on) {
  std::lock_guard lock(g_mu);
  g_ragged = on;
}

}  // namespace lcx::cuda
