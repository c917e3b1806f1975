// sp_ulysses: Ulysses sequence parallelism. Each of the sp ranks of a sequence holds a contiguous
// slice of L/sp tokens everywhere except inside attention. Around attention an all-to-all trades
// the slicing: q, k, v go from [L/sp tokens, all heads, d] to [L tokens, heads/sp, d], each rank
// runs plain causal attention over the whole sequence on its heads, and the output goes back the
// same way. The result is the single-rank one up to summation order (only the gradients of
// replicated kv heads are summed differently).
//
// Heads: rank r takes query heads [r Hq/sp, (r+1) Hq/sp). With Hkv >= sp it takes kv heads
// [r Hkv/sp, (r+1) Hkv/sp); with Hkv < sp (sp a multiple of Hkv) it takes the one kv head
// r Hkv/sp, so the sp/Hkv ranks of one GQA group each get a replica and their dk/dv are summed
// on the way back. Both follow GQA's rule that query head h reads kv head h / (Hq/Hkv).
//
// Layout moves are row gathers (ops::embedding_forward on a table of rows) and, for the replica
// sums, its fp32 scatter-add (ops::embedding_backward), so the same code runs on every backend
// with no kernels of its own. all_to_all sends dim-0 block j to rank j: packing puts block j =
// rank j's heads for this rank's tokens; what arrives is already [L, heads/sp, d] in token order.
//
// Stacked over a cp provider (two-dimensional sequence parallelism, README.md): the rank mesh is
// dp x cp x sp, placed with sp or cp on neighbouring ranks (lcx/mesh_shape.h); either way the sp
// communicator ranks its group by sp coordinate and the cp one by cp coordinate, so the plugin
// reads no placement. A group of sp ranks holds one cp shard of the inner (cp_ring's zigzag shard
// of rank cp), each rank its contiguous 1/sp of that shard's rows. The all-to-all gives every rank
// of the group the whole cp shard on its heads, and the attention over it is the inner's (the
// ring over the cp communicator, among the ranks holding the same heads) instead of the plain op;
// the rest is unchanged.
//
// The head-layout q, k, v, out and LSE of the last forward are kept (with the caller's tensors,
// so their addresses cannot be reused) and the backward that follows the recompute only sends
// dout forward and dq, dk, dv back. A backward for other tensors moves its inputs again.
#include <lcx/comm.h>
#include <lcx/defaults.h>
#include <lcx/log.h>
#include <lcx/ops.h>
#include <lcx/attention_cost.h>
#include <lcx/plan.h>
#include <lcx/plugin.h>
#include <lcx/size_math.h>
#include <lcx/slots/parallelism.h>

#include <algorithm>
#include <map>
#include <tuple>

namespace lcx {
namespace {

class Ulysses final : public Parallelism {
 public:
  Ulysses(int64_t size, std::string table) : sp_(size), table_(std::move(table)) {}

  // Any provider of the cp axis whose shard() takes the cp coordinate and whose attention takes
  // any number of heads (it is configured with this rank's).
  bool stacks_over(const Parallelism& inner) const override { return inner.mesh_axis() == "cp"; }
  void set_inner(std::shared_ptr<Parallelism> inner) override { inner_ = std::move(inner); }

  void configure(const ParallelModelInfo& info, Mesh* mesh) override {
    const std::string key = "distributed.sp";
    // Every rank holds the whole sequence of its heads, so a sliding window applies as it is; a
    // chunked layer's mask the attention ops do not compute.
    for (size_t l = 0; l < info.layer_types.size(); ++l)
      if (info.layer_types[l] != "full_attention" && info.layer_types[l] != "sliding_attention")
        throw Error(str(table_, ": layer ", l, " is ", info.layer_types[l],
                        "; Ulysses computes full causal and sliding-window attention only"),
                    "layer_types", "use a model with full or sliding-window attention layers, or drop sp_ulysses");
    if (info.num_heads % sp_ != 0)
      throw Error(str(table_, ": ", info.num_heads, " query heads do not divide over sp = ", sp_,
                      " ranks (each rank takes num_heads / sp of them)"),
                  key, str("use an sp that divides ", info.num_heads));
    if (info.num_kv_heads >= sp_ && info.num_kv_heads % sp_ != 0)
      throw Error(str(table_, ": ", info.num_kv_heads, " key/value heads do not divide over sp = ", sp_, " ranks"),
                  key, str("use an sp that divides ", info.num_kv_heads));
    if (info.num_kv_heads < sp_ && sp_ % info.num_kv_heads != 0)
      throw Error(str(table_, ": ", info.num_kv_heads, " key/value heads cannot be replicated evenly over sp = ", sp_,
                      " ranks (a rank's query heads must share one kv head)"),
                  key, str("use an sp that is a multiple of ", info.num_kv_heads));
    if (mesh) check_mesh(*mesh);
    mesh_ = mesh;
    info_ = info;
    kv_local_ = std::max<int64_t>(1, info.num_kv_heads / sp_);
    kv_blocks_ = info.num_kv_heads / kv_local_;
    if (inner_) {
      // The inner attends over this rank's heads only: its query heads and its (replicated) kv heads.
      ParallelModelInfo mine = info;
      mine.num_heads = info.num_heads / sp_;
      mine.num_kv_heads = kv_local_;
      inner_->configure(mine, mesh);
    }
    configured_ = true;
  }

  int size() const override { return static_cast<int>(sp_) * (inner_ ? inner_->size() : 1); }
  std::string mesh_axis() const override { return "sp"; }

  bool masks_documents() const override { return inner_ ? inner_->masks_documents() : true; }
  // Stacked, `rank` is the place among cp x sp ranks, cp * sp_size + sp (seq_index, lcx/mesh_shape.h).
  Shard shard(const Sequence& seq, int rank) const override {
    if (inner_) return stacked_shard(seq, rank);
    const int64_t L = seq.tokens.size(0);
    LCX_CHECK(rank >= 0 && rank < sp_, "sp_ulysses has no rank ", rank, " of ", sp_);
    if (L % sp_ != 0)
      throw Error(str(table_, ": a sequence of ", L, " tokens does not split into sp = ", sp_,
                      " equal contiguous shards"),
                  "data.seq_len", str("set [data] seq_len to a multiple of ", sp_, " and pad_to_multiple_of = ", sp_,
                                        " (a short final sequence is padded to it)"));
    const int64_t T = L / sp_, begin = rank * T;
    Shard s;
    s.tokens = seq.tokens.rows(begin, begin + T);
    s.targets = seq.targets.rows(begin, begin + T);
    s.positions = Tensor::empty({T}, DType::i64);
    fill_positions(s.positions, 0, seq.document_bounds, begin, T);
    s.indices = Tensor::empty({T}, DType::i64);
    fill_indices(s.indices, 0, begin, T);
    s.global_length = L;
    s.document_bounds = seq.document_bounds;
    return s;
  }

  void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, Tensor& lse,
                         const AttentionArgs& args) override {
    // One rank is plain attention over whatever heads come (a model may pass one head group).
    if (sp_ == 1) return attend_forward(q, k, v, out, lse, args);
    check_inputs(q, k, v);
    cache_ = {};  // the previous layer's buffers go before this one's arrive
    Communicator& c = comm();
    const int64_t T = q.size(0), L = T * sp_, Hr = heads_per_rank(), d = info_.head_dim;
    if (!logged_ && mesh_->world().rank() == 0) log_traffic(T, q.dtype());
    logged_ = true;

    Cache h;
    h.q = q;
    h.k = k;
    h.v = v;
    h.out = out;
    h.qh = to_heads(c, q, sp_, Hr);
    h.kh = to_heads(c, k, kv_blocks_, kv_local_);
    h.vh = to_heads(c, v, kv_blocks_, kv_local_);
    h.oh = Tensor::empty({L, Hr, d}, out.dtype(), out.device(), MemoryCategory::communication);
    h.lseh = Tensor::empty({Hr, L}, DType::f32, out.device(), MemoryCategory::communication);
    attend_forward(h.qh, h.kh, h.vh, h.oh, h.lseh, args);

    from_heads(c, h.oh, out, sp_);
    // LSE [Hr, sp, T] -> blocks per destination [sp, Hr, T]; what arrives is [Hq, T] in head order.
    Tensor send = Tensor::empty({Hr * sp_, T}, DType::f32, lse.device(), MemoryCategory::communication);
    ops::embedding_forward(pack_ids(Hr, sp_, lse.device()), h.lseh.view({Hr * sp_, T}), send);
    c.all_to_all(send, lse);
    cache_ = std::move(h);
  }

  void attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                          const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv, const AttentionArgs& args) override {
    if (sp_ == 1) return attend_backward(q, k, v, out, lse, dout, dq, dk, dv, args);
    check_inputs(q, k, v);
    Communicator& c = comm();
    const int64_t T = q.size(0), L = T * sp_, Hr = heads_per_rank(), d = info_.head_dim;
    Cache h = std::move(cache_);
    cache_ = {};
    if (!h.holds(q, k, v, out)) {
      h = {};
      h.qh = to_heads(c, q, sp_, Hr);
      h.kh = to_heads(c, k, kv_blocks_, kv_local_);
      h.vh = to_heads(c, v, kv_blocks_, kv_local_);
      h.oh = to_heads(c, out, sp_, Hr);
      // lse [Hq, T] is already blocked by destination; what arrives is [sp, Hr, T] -> [Hr, sp, T].
      Tensor recv = Tensor::empty({sp_ * Hr, T}, DType::f32, lse.device(), MemoryCategory::communication);
      c.all_to_all(lse, recv);
      h.lseh = Tensor::empty({Hr, L}, DType::f32, lse.device(), MemoryCategory::communication);
      Tensor lseh = h.lseh.view({Hr * sp_, T});
      ops::embedding_forward(unpack_ids(Hr, lse.device()), recv, lseh);
    }
    Tensor dqh = Tensor::empty({L, Hr, d}, dq.dtype(), dq.device(), MemoryCategory::communication);
    Tensor dkh = Tensor::empty({L, kv_local_, d}, dk.dtype(), dk.device(), MemoryCategory::communication);
    Tensor dvh = Tensor::empty({L, kv_local_, d}, dv.dtype(), dv.device(), MemoryCategory::communication);
    {
      const Tensor douth = to_heads(c, dout, sp_, Hr);
      attend_backward(h.qh, h.kh, h.vh, h.oh, h.lseh, douth, dqh, dkh, dvh, args);
    }
    h = {};
    from_heads(c, dqh, dq, sp_);
    dqh = Tensor();
    from_heads(c, dkh, dk, kv_blocks_);
    dkh = Tensor();
    from_heads(c, dvh, dv, kv_blocks_);
  }

  // Per rank, T = L/sp tokens: the head-layout tensors are the size of the sequence-layout ones
  // (kv times sp/Hkv when replicated). Forward keeps q, k, v, out and the LSE for the backward
  // and moves one tensor at a time through one staging buffer (the send side on the way in, the
  // receive side on the way out: the other side is a head-layout tensor); the backward adds dout,
  // dq, dk, dv in head layout, the kernel's fp32 delta and, with replicas, an fp32 [T,Hkv,d] sum.
  // Through the loss the last layer's forward buffers are still held (its recompute replaces them).
  void plan(const PlanInputs& in, MemoryPlan& plan) const override {
    const int64_t sp = std::max<int64_t>(1, in.sp), T = in.tokens_per_rank, d = in.model.head_dim;
    const int64_t Hq = in.model.num_heads, Hkv = in.model.num_kv_heads;
    if (sp == 1) return inner_ ? inner_->plan(in, plan) : make_single_rank()->plan(in, plan);
    const int64_t ab = static_cast<int64_t>(dtype_size(in.weight_dtype));
    const int64_t kv_sent = std::max(Hkv, sp);  // kv heads per token leaving a rank, replicas included
    const int64_t heads = T * (2 * Hq + 2 * kv_sent) * d * ab;
    const int64_t one_buffer = T * std::max(Hq, kv_sent) * d * ab;
    const int64_t ids = 4 * sp * T * (Hkv < sp ? 3 : 2);
    plan.add("head_layout_forward", "all-to-all: q, k, v, out in head layout [L,heads/sp,d], kept for the backward",
             PlanCategory::communication, heads, plan_phase::forward);
    plan.add("head_layout_lse", "all-to-all: fp32 LSE in head layout [Hq/sp,L]", PlanCategory::communication,
             T * Hq * 4, plan_phase::forward);
    plan.add("staging", "all-to-all: staging buffer of one tensor, row index tables", PlanCategory::communication,
             one_buffer + ids, plan_phase::forward);
    plan.add("head_layout_backward", "all-to-all: q, k, v, out and dout, dq, dk, dv in head layout",
             PlanCategory::communication, 2 * heads, plan_phase::backward);
    plan.add("head_layout_lse_delta", "all-to-all: fp32 LSE and attention backward delta [Hq/sp,L]",
             PlanCategory::communication, 2 * T * Hq * 4, plan_phase::backward);
    plan.add("staging", "all-to-all: staging buffer of one tensor, row index tables", PlanCategory::communication,
             one_buffer + ids, plan_phase::backward);
    // The last layer's forward buffers wait for its recompute, through the loss.
    const int64_t inputs = T * (2 * Hq + 2 * Hkv) * d * ab;
    for (const char* phase : {plan_phase::loss, plan_phase::final_norm})
      plan.add("last_layer_head_layout",
               "all-to-all: last layer's head-layout q, k, v, out, LSE and its q, k, v, out, until its recompute",
               PlanCategory::communication, heads + T * Hq * 4 + inputs, phase);
    if (inner_) {
      // Stacked: the inner's attention (the ring) over this rank's heads and the cp shard's sp T rows.
      PlanInputs mine = in;
      mine.tokens_per_rank = sp * T;
      mine.model.num_heads = Hq / sp;
      mine.model.num_kv_heads = std::max<int64_t>(1, Hkv / sp);
      mine.sp = 1;
      inner_->plan(mine, plan);
    } else if (in.documents_masked) {
      // One attention call masked by document: cuDNN's padded batches of documents.
      plan_document_masks(plan, Hq / sp, sp * T, d);
    } else {
      // One attention call: Hq/sp heads over all L = sp T rows (lcx/attention_cost.h: what the call allocates).
      const AttentionBytes call = attention_call_bytes(Hq / sp, sp * T, d);
      plan.add("attention_forward_workspace", "attention forward workspace (cuDNN)", PlanCategory::transient,
               call.forward, plan_phase::forward);
      plan.add("attention_backward_call",
               "attention backward dQ accumulator and workspace (cuDNN) [Hq/sp,L,d] fp32 x 2", PlanCategory::transient,
               call.backward, plan_phase::backward);
    }
    if (Hkv < sp)
      plan.add("replicated_dkv_sum", "all-to-all: fp32 sum of replicated dk/dv [T,Hkv,d]", PlanCategory::communication,
               T * Hkv * d * 4, plan_phase::backward);
  }

 private:
  // Attention on the head layout: the plain op over the whole sequence, or stacked, the inner's
  // over its shard (its ring runs on these heads' rows of the cp shard).
  void attend_forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, Tensor& lse,
                      const AttentionArgs& args) {
    if (inner_) return inner_->attention_forward(q, k, v, out, lse, args);
    ops::attention_forward(q, k, v, out, lse, params(args));
  }
  void attend_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                       const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv, const AttentionArgs& args) {
    if (inner_) return inner_->attention_backward(q, k, v, out, lse, dout, dq, dk, dv, args);
    ops::attention_backward(q, k, v, out, lse, dout, dq, dk, dv, params(args));
  }

  // The inner's shard for the rank's cp coordinate, cut in sp contiguous parts. The zigzag ring
  // cuts 2 x cp chunks (none at cp 1), and each cp shard must cut in sp: 2 x cp x sp divides the
  // sequence.
  Shard stacked_shard(const Sequence& seq, int rank) const {
    const int64_t cp = inner_->size(), L = seq.tokens.size(0), multiple = (cp > 1 ? 2 * cp : 1) * sp_;
    LCX_CHECK(rank >= 0 && rank < cp * sp_, "sp_ulysses over a cp of ", cp, " has no rank ", rank, " of ", cp * sp_);
    if (L % multiple != 0)
      throw Error(str(table_, ": a sequence of ", L, " tokens does not split over cp = ", cp, " x sp = ", sp_,
                      " ranks: the ring's 2 x cp zigzag chunks, each cp shard cut in sp contiguous parts, need a "
                      "multiple of 2 x cp x sp = ", multiple),
                  "data.pad_to_multiple_of",
                  str("set data.pad_to_multiple_of = ", multiple, " and [data] seq_len to a multiple of ", multiple));
    const Shard whole = inner_->shard(seq, static_cast<int>(rank / sp_));
    const int64_t T = whole.tokens.size(0) / sp_, begin = (rank % sp_) * T;
    Shard s;
    s.tokens = whole.tokens.rows(begin, begin + T);
    s.targets = whole.targets.rows(begin, begin + T);
    s.positions = whole.positions.rows(begin, begin + T);
    if (whole.indices.defined()) s.indices = whole.indices.rows(begin, begin + T);
    s.global_length = whole.global_length;
    s.document_bounds = whole.document_bounds;
    return s;
  }

  struct Cache {
    Tensor q, k, v, out;           // the caller's tensors, held so their addresses stay theirs
    Tensor qh, kh, vh, oh, lseh;   // head layout
    bool holds(const Tensor& q2, const Tensor& k2, const Tensor& v2, const Tensor& o2) const {
      auto same = [](const Tensor& a, const Tensor& b) {
        return a.defined() && a.data() == b.data() && a.shape() == b.shape() && a.dtype() == b.dtype();
      };
      return same(q, q2) && same(k, k2) && same(v, v2) && same(out, o2);
    }
  };

  int64_t heads_per_rank() const { return info_.num_heads / sp_; }

  void check_mesh(const Mesh& m) const {
    if (m.shape().sp != sp_)
      throw Error(str(table_, " was created for sp = ", sp_, " but the mesh's sp axis is ", m.shape().sp),
                  "distributed.sp", "create the plugin with the [distributed] shape its mesh has (PluginArgs::mesh)");
    if (m.shape().cp != 1 && !inner_)
      throw Error(str(table_, " shards a sequence over the sp axis only, but the mesh has cp = ", m.shape().cp),
                  "distributed.cp", "set [distributed] cp = 1 with sp_ulysses, or load cp_ring beside it for the cp axis");
  }

  Communicator& comm() const {
    if (!mesh_)
      throw Error(str(table_, ": sp = ", sp_, " needs a mesh, and configure() was given none"), "distributed.sp",
                  "configure the plugin with its rank's mesh (the trainer does), or run with sp = 1");
    return mesh_->sp();
  }

  void check_inputs(const Tensor& q, const Tensor& k, const Tensor& v) const {
    LCX_CHECK(configured_, "sp_ulysses: attention before configure()");
    LCX_CHECK(q.dim() == 3 && q.size(1) == info_.num_heads && q.size(2) == info_.head_dim, "q is ",
              shape_str(q.shape()));
    LCX_CHECK(k.shape() == v.shape() && k.dim() == 3 && k.size(0) == q.size(0) && k.size(1) == info_.num_kv_heads &&
                  k.size(2) == info_.head_dim,
              "k is ", shape_str(k.shape()), ", v is ", shape_str(v.shape()));
  }

  static ops::AttentionParams params(const AttentionArgs& a) {
    ops::AttentionParams p;
    p.scale = a.scale;
    p.causal = a.causal;
    p.documents = a.documents;  // the all-to-all gives each rank whole sequences: bounds hold as they are
    p.window = a.window;        // ... and the window, over the same positions
    return p;
  }

  // x [T, blocks * per, d] in sequence layout -> [sp T, per, d] in head layout. Send block j holds
  // head block j*blocks/sp of every token (blocks < sp sends one block to several ranks).
  Tensor to_heads(Communicator& c, const Tensor& x, int64_t blocks, int64_t per) {
    const int64_t T = x.size(0), row = per * info_.head_dim;
    Tensor send = Tensor::empty({sp_ * T, row}, x.dtype(), x.device(), MemoryCategory::communication);
    ops::embedding_forward(pack_ids(T, blocks, x.device()), x.view({T * blocks, row}), send);
    Tensor recv = Tensor::empty({sp_ * T, per, info_.head_dim}, x.dtype(), x.device(), MemoryCategory::communication);
    c.all_to_all(send, recv);
    return recv;
  }

  // The inverse: xh [sp T, per, d] -> x [T, blocks * per, d]. Block i of what arrives is rank i's
  // heads for this rank's tokens; replicas of one head block (blocks < sp) are summed in fp32.
  void from_heads(Communicator& c, const Tensor& xh, Tensor& x, int64_t blocks) {
    const int64_t T = x.size(0), row = xh.size(1) * info_.head_dim;
    Tensor recv = Tensor::empty({sp_ * T, row}, xh.dtype(), xh.device(), MemoryCategory::communication);
    c.all_to_all(xh, recv);
    Tensor rows = x.view({T * blocks, row});
    if (blocks == sp_) {
      ops::embedding_forward(unpack_ids(T, x.device()), recv, rows);
      return;
    }
    if (x.dtype() == DType::f32) {
      rows.zero();
      ops::embedding_backward(pack_ids(T, blocks, x.device()), recv, rows);
      return;
    }
    Tensor sum = Tensor::zeros({T * blocks, row}, DType::f32, x.device(), MemoryCategory::communication);
    ops::embedding_backward(pack_ids(T, blocks, x.device()), recv, sum);
    ops::cast(sum, rows);
  }

  // Rows of a [n, blocks] grid to send blocks: ids[j n + t] = t blocks + j blocks / sp.
  const Tensor& pack_ids(int64_t n, int64_t blocks, Device dev) {
    return ids(0, n, blocks, dev, [&](int32_t* id) {
      for (int64_t j = 0; j < sp_; ++j)
        for (int64_t t = 0; t < n; ++t) id[j * n + t] = static_cast<int32_t>(t * blocks + j * blocks / sp_);
    });
  }
  // Received blocks [sp, n] back to a [n, sp] grid: ids[t sp + j] = j n + t.
  const Tensor& unpack_ids(int64_t n, Device dev) {
    return ids(1, n, sp_, dev, [&](int32_t* id) {
      for (int64_t t = 0; t < n; ++t)
        for (int64_t j = 0; j < sp_; ++j) id[t * sp_ + j] = static_cast<int32_t>(j * n + t);
    });
  }
  template <typename Fill>
  const Tensor& ids(int kind, int64_t n, int64_t blocks, Device dev, Fill fill) {
    LCX_CHECK(n * std::max(blocks, sp_) < (int64_t{1} << 31), "sp_ulysses: ", n, " rows overflow int32 row ids");
    auto key = std::make_tuple(kind, n, blocks, static_cast<int>(dev.type), dev.index);
    auto it = ids_.find(key);
    if (it != ids_.end()) return it->second;
    Tensor host = Tensor::empty({sp_ * n}, DType::i32);
    fill(host.data_as<int32_t>());
    return ids_.emplace(key, dev == Device::cpu() ? host : host.to(dev)).first->second;
  }

  // Bytes this rank hands to all_to_all per layer; (sp-1)/sp of them leave the rank.
  void log_traffic(int64_t T, DType dt) const {
    const int64_t b = static_cast<int64_t>(dtype_size(dt));
    const int64_t qb = T * info_.num_heads * info_.head_dim * b;
    const int64_t kb = T * std::max<int64_t>(info_.num_kv_heads, sp_) * info_.head_dim * b;
    const int64_t lb = T * info_.num_heads * 4;
    log::info(str(table_, ": all-to-all per layer and rank (", T, " tokens of ", T * sp_, ", sp ", sp_, "): forward ",
                  format_bytes(2 * qb + 2 * kb + lb), " (q, out ", format_bytes(qb), " each; k, v ", format_bytes(kb),
                  " each; LSE ", format_bytes(lb), "), backward ", format_bytes(2 * qb + 2 * kb),
                  " (dout, dq, dk, dv); ", sp_ - 1, "/", sp_, " of it crosses the interconnect"));
  }

  int64_t sp_;
  std::string table_;
  Mesh* mesh_ = nullptr;
  std::shared_ptr<Parallelism> inner_;  // the cp provider this one stacks over; null alone
  ParallelModelInfo info_;
  int64_t kv_local_ = 1;   // kv heads per rank
  int64_t kv_blocks_ = 1;  // kv head blocks per token: sp, or Hkv when replicated
  bool configured_ = false;
  bool logged_ = false;
  Cache cache_;
  std::map<std::tuple<int, int64_t, int64_t, int, int>, Tensor> ids_;  // row ids per shape and device
};

// The ranks of a sequence are [distributed] sp. `size` is the key it replaced: still accepted
// when it equals sp, and deprecated.
std::unique_ptr<Plugin> create(const PluginArgs& args) {
  const std::string table = args.config.name().empty() ? std::string("sp_ulysses") : args.config.name();
  args.config.describe("size", "deprecated: the ranks of a sequence are [distributed] sp; accepted only when equal to it", {},
                       "[distributed] sp");
  const int64_t sp = args.config.get_int("size", args.mesh.sp);
  if (sp < 1) args.config.fail("size", "must be >= 1", "set [distributed] sp to the number of ranks that share a sequence");
  if (sp > (int64_t{1} << 16)) args.config.fail("size", "is implausibly large");
  if (args.config.has("size")) {
    if (sp != args.mesh.sp)
      args.config.fail("size", str("is ", sp, " but [distributed] sp = ", args.mesh.sp, "; the ranks of a sequence are distributed.sp"),
                       str("drop ", table, ".size (deprecated) and set distributed.sp"));
    log::warn(str(table, ".size is deprecated: the ranks of a sequence come from [distributed] sp; drop the key"));
  }
  return std::make_unique<Ulysses>(sp, table);
}

}  // namespace
}  // namespace lcx

LCX_PLUGIN(LCX_SLOT_PARALLELISM, "sp_ulysses", "0.2.0", "Ulysses all-to-all sequence parallelism", "ready",
           lcx::create)
