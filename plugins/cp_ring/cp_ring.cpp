// cp_ring: context parallelism by ring attention over a zigzag-sharded sequence (README.md).
//
// Sharding: the sequence is cut into 2 x cp equal chunks and rank r holds chunks r and 2cp-1-r,
// so every rank holds one early and one late chunk and the causal work per rank is equal.
//
// Attention: at ring step s a rank holds the K/V of rank j = r - s (mod cp). Against its two
// query chunks that block is
//   j == r: its own block: causal on the two diagonal chunk pairs, full for (late q, early k);
//   j <  r: both query chunks see only j's early chunk, fully;
//   j >  r: only the late query chunk sees anything, and it sees both of j's chunks fully;
// so each step past the first is one full [2c x c] or [c x 2c] piece of work, equal on every rank.
// Each piece runs through ops::attention_forward/backward (CPU reference or CUDA kernels); full
// pieces run without a mask, diagonal ones with equal offsets (the cuDNN fused path takes both).
// Packed documents (AttentionArgs::documents): the masked work follows where the documents fall,
// so the shards are laid out for it (balance.h balanced_layout: the zigzag or 2 x cp x k chunks,
// 2k per rank, whichever makes the slowest rank's predicted time least; [cp_ring] balance), and
// each ring step runs as rounds (schedule.h step_rounds): each document's rows in a query chunk
// against its rows in a key chunk of the block in hand is one block, and the step's blocks go into
// the fewest rounds whose blocks share no row, one ops::attention_forward_blocks call a round (few
// cuDNN calls a step however many chunk pairs and documents); a chunk pair sharing no document
// adds nothing. shard() and the attention derive the same layout from the same bounds.
// While a piece computes, the next K/V block is already moving (send to r+1, receive from r-1).
// Forward partial results merge by log-sum-exp in fp32 (ring_merge.h). Backward: each block's
// backward with the final out and LSE gives that block's exact share of dQ, dK and dV (flash
// attention's identity); dQ adds up locally, dK/dV add up in fp32 accumulators that travel around
// the ring behind their K/V and reach their owner after the last step.
// Sliding-window layers (AttentionArgs::window) take no ring pass: each chunk fetches only the keys
// its window reaches, the W - 1 positions before it, from their owners (window.h), forward and
// backward, packed documents masked at once.
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
#include <array>
#include <atomic>
#include <memory>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

#include "balance.h"
#include "layout.h"
#include "ring_merge.h"
#include "schedule.h"
#include "window.h"

namespace lcx {
namespace {

using cp_ring::ChunkLayout;
using cp_ring::Piece;
using cp_ring::pieces_for;

ops::AttentionParams params_of(const AttentionArgs& a, bool causal) {
  ops::AttentionParams p;
  p.scale = a.scale;
  p.causal = causal;
  return p;  // offsets stay 0: diagonal pieces have equal positions, full ones need none
}

// One rank holds the whole sequence in order, so the document bounds apply as they are.
ops::AttentionParams whole_params(const AttentionArgs& a) {
  ops::AttentionParams p = params_of(a, a.causal);
  p.documents = a.documents;
  p.window = a.window;
  return p;
}

// Columns [col0, col0 + n) of an fp32 [H,T] LSE as a contiguous [H,n] tensor.
Tensor lse_columns(const Tensor& lse, int64_t col0, int64_t n) {
  Tensor out = Tensor::empty({lse.size(0), n}, DType::f32, lse.device());
  ops::copy_columns(lse, col0, out, 0, n);
  return out;
}

// Two receive buffers per tensor: the block in hand is sent on while the next one arrives in
// the other buffer, which no one reads until the exchange's wait().
class KvRing {
 public:
  KvRing(const Tensor& k, const Tensor& v)
      : k_(k), v_(v) {
    for (auto& b : kbuf_) b = Tensor::empty(k.shape(), k.dtype(), k.device(), MemoryCategory::communication);
    for (auto& b : vbuf_) b = Tensor::empty(v.shape(), v.dtype(), v.device(), MemoryCategory::communication);
  }
  const Tensor& k() const { return k_; }
  const Tensor& v() const { return v_; }
  std::unique_ptr<CommWork> pass(Communicator& c, int next, int prev) {
    Tensor& kn = kbuf_[static_cast<size_t>(slot_)];
    Tensor& vn = vbuf_[static_cast<size_t>(slot_)];
    return c.send_recv_async({P2POp::send(k_, next), P2POp::send(v_, next), P2POp::recv(kn, prev), P2POp::recv(vn, prev)});
  }
  void advance() {
    k_ = kbuf_[static_cast<size_t>(slot_)];
    v_ = vbuf_[static_cast<size_t>(slot_)];
    slot_ ^= 1;
  }

 private:
  Tensor k_, v_;
  std::array<Tensor, 2> kbuf_, vbuf_;
  int slot_ = 0;
};

// The travelling fp32 dK/dV accumulators: the one in hand takes this rank's share of the gradients
// of the block in hand once it has arrived (arrive()), then goes on to r+1 while the next arrives
// in the other buffer (pass()); after the last step the one in hand is the rank's own block's.
class GradRing {
 public:
  GradRing(const Tensor& k, const Tensor& v) {
    for (auto& t : dk_) t = Tensor::empty(k.shape(), DType::f32, k.device(), MemoryCategory::communication);
    for (auto& t : dv_) t = Tensor::empty(v.shape(), DType::f32, v.device(), MemoryCategory::communication);
    dk_[0].zero();
    dv_[0].zero();
  }
  void arrive() {
    if (!moving_) return;
    moving_->wait();
    moving_.reset();
  }
  // Rows [b, e) of the accumulator in hand (after arrive()).
  Tensor dk(int64_t b, int64_t e) { return dk_[cur_].rows(b, e); }
  Tensor dv(int64_t b, int64_t e) { return dv_[cur_].rows(b, e); }
  void pass(Communicator& c, int next, int prev) {
    moving_ = c.send_recv_async({P2POp::send(dk_[cur_], next), P2POp::send(dv_[cur_], next),
                                 P2POp::recv(dk_[cur_ ^ 1], prev), P2POp::recv(dv_[cur_ ^ 1], prev)});
    cur_ ^= 1;
  }
  void finish(Tensor& dk, Tensor& dv) {
    arrive();
    ops::cast(dk_[cur_], dk);
    ops::cast(dv_[cur_], dv);
  }

 private:
  std::array<Tensor, 2> dk_, dv_;
  size_t cur_ = 0;
  std::unique_ptr<CommWork> moving_;  // the accumulator for the next block, arriving
};

class CpRing final : public Parallelism {
 public:
  // costs: what balanced_layout weighs a layout's work by (kMaskedWorkOnly: the masked work
  // alone); none keeps the zigzag ([cp_ring] balance).
  CpRing(int cp, std::optional<cp_ring::RingCosts> costs) : cp_(cp), costs_(costs) {}

  void configure(const ParallelModelInfo& info, Mesh* mesh) override {
    int64_t windowed = 0;
    for (size_t l = 0; l < info.layer_types.size(); ++l) {
      if (info.layer_types[l] == "sliding_attention") {
        ++windowed;
        continue;
      }
      if (info.layer_types[l] != "full_attention")
        throw Error(str("cp_ring: layer ", l, " is ", info.layer_types[l],
                        "; ring attention computes full causal and sliding-window attention only"),
                    "layer_types", "use a model with full or sliding-window attention layers, or drop cp_ring");
    }
    if (windowed > 0 && info.sliding_window <= 0)
      throw Error(str("cp_ring: ", windowed, " layers are sliding_attention but the model's sliding_window is ",
                      info.sliding_window),
                  "sliding_window", "set the model's sliding_window (config.json) to its layers' window");
    // The balance weighs each layer by its work: a windowed layer's is its rows' windows.
    if (costs_) {
      costs_->full_layers = static_cast<int64_t>(info.layer_types.size()) - windowed;
      costs_->window_layers = windowed;
      costs_->window = info.sliding_window;
    }
    if (mesh) check_mesh(*mesh);
    mesh_ = mesh;
    layers_ = static_cast<int64_t>(info.layer_types.size());
  }

  int size() const override { return cp_; }
  bool masks_documents() const override { return true; }
  std::string mesh_axis() const override { return "cp"; }
  // More ranks on the ring divide every per-token buffer; the model then runs its attention as
  // one call over all heads (attention_takes_head_groups), since each call is a ring pass.
  std::string plan_offer() const override { return "ring attention over more GPUs"; }

  Shard shard(const Sequence& seq, int rank) const override {
    const int64_t L = seq.tokens.size(0);
    if (rank < 0 || rank >= cp_)
      throw Error(str("cp_ring: shard() for rank ", rank, " but [distributed] cp = ", cp_,
                      "; it takes the rank's cp coordinate, 0 to ", cp_ - 1),
                  "distributed.cp", "pass the rank's cp coordinate (with sp_ulysses stacked over the ring, it does)");
    if (seq.targets.size(0) != L)
      throw Error(str("cp_ring: a sequence of ", L, " tokens has ", seq.targets.size(0), " targets"));
    Shard s;
    s.global_length = L;
    if (cp_ == 1) {  // one rank holds the sequence as it is
      s.tokens = seq.tokens;
      s.targets = seq.targets;
      s.document_bounds = seq.document_bounds;
      s.positions = Tensor::empty({L}, DType::i64);
      fill_positions(s.positions, 0, s.document_bounds, 0, L);
      s.indices = Tensor::empty({L}, DType::i64);
      fill_indices(s.indices, 0, 0, L);
      return s;
    }
    const int64_t chunks = 2 * static_cast<int64_t>(cp_);
    if (L % chunks != 0)
      throw Error(str("cp_ring: a sequence of ", L, " tokens cannot be cut into 2 x cp = ", chunks,
                      " equal chunks (zigzag sharding: rank r holds chunks r and ", chunks - 1, " - r)"),
                  "data.pad_to_multiple_of", str("set data.pad_to_multiple_of = ", chunks, " (a multiple of 2 x cp)"));
    const ChunkLayout layout = layout_for(seq.document_bounds, L, cp_);
    const int64_t T = L / cp_;
    s.tokens = Tensor::empty({T}, DType::i32);
    s.targets = Tensor::empty({T}, DType::i64);
    s.positions = Tensor::empty({T}, DType::i64);
    s.indices = Tensor::empty({T}, DType::i64);
    const Tensor tokens = seq.tokens.device().is_cuda() ? seq.tokens.to(Device::cpu()) : seq.tokens;
    const Tensor targets = seq.targets.device().is_cuda() ? seq.targets.to(Device::cpu()) : seq.targets;
    int64_t at = 0;  // the rank's rows so far: its chunks in position order, of the layout's rows each
    for (int64_t chunk : layout.of(rank)) {
      const int64_t start = layout.begin(chunk), rows = layout.rows(chunk);
      s.tokens.rows(at, at + rows).copy_from(tokens.rows(start, start + rows));
      s.targets.rows(at, at + rows).copy_from(targets.rows(start, start + rows));
      fill_positions(s.positions, at, seq.document_bounds, start, rows);
      fill_indices(s.indices, at, start, rows);
      at += rows;
    }
    LCX_CHECK(at == T, "cp_ring: a layout's chunks must hold L / cp rows on every rank");
    s.document_bounds = seq.document_bounds;
    return s;
  }

  void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, Tensor& lse,
                         const AttentionArgs& args) override {
    Communicator* ring = ring_comm();
    if (!ring) return ops::attention_forward(q, k, v, out, lse, whole_params(args));
    const int r = ring->rank(), n = ring->size(), next = (r + 1) % n, prev = (r + n - 1) % n;
    const ChunkLayout& layout = layout_of(q, n, args);
    if (args.window > 0) return window_forward(q, k, v, out, lse, args, *ring);
    const int64_t c = layout.c;
    const Device dev = q.device();
    if (mesh_->world().rank() == 0 && !logged_.exchange(true)) log_traffic(q.size(0), k, n);
    // LSE accumulates in place (it is fp32); the output in fp32 unless it already is.
    Tensor acc = out.dtype() == DType::f32 ? out : Tensor::empty(out.shape(), DType::f32, dev);
    KvRing kv(k, v);
    if (!args.documents.empty()) {
      forward_rounds(q, kv, acc, lse, args, *ring);
      if (acc.data() != out.data()) ops::cast(acc, out);
      return;
    }
    std::vector<bool> seen(layout.of(r).size(), false);  // whether each query chunk has a partial result yet
    for (int s = 0; s < n; ++s) {
      const int j = (r - s + n) % n;
      std::unique_ptr<CommWork> moving = s + 1 < n ? kv.pass(*ring, next, prev) : nullptr;
      for (const Piece& p : pieces_for(r, j, c, args.causal)) {
        const int64_t nq = p.q_end - p.q_begin;
        Tensor o = Tensor::empty({nq, q.size(1), q.size(2)}, q.dtype(), dev);
        Tensor l = Tensor::empty({q.size(1), nq}, DType::f32, dev);
        ops::attention_forward(q.rows(p.q_begin, p.q_end), kv.k().rows(p.k_begin, p.k_end),
                               kv.v().rows(p.k_begin, p.k_end), o, l, params_of(args, p.causal));
        const bool first = !seen[static_cast<size_t>(p.q_begin / c)];
        cp_ring::merge_partial(acc, lse, p.q_begin, o, l, first);
        for (int64_t h = p.q_begin / c; h < p.q_end / c; ++h) seen[static_cast<size_t>(h)] = true;
      }
      if (moving) {
        moving->wait();
        kv.advance();
      }
    }
    if (acc.data() != out.data()) ops::cast(acc, out);
  }

  void attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                          const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv, const AttentionArgs& args) override {
    Communicator* ring = ring_comm();
    if (!ring) return ops::attention_backward(q, k, v, out, lse, dout, dq, dk, dv, whole_params(args));
    const int r = ring->rank(), n = ring->size(), next = (r + 1) % n, prev = (r + n - 1) % n;
    const ChunkLayout& layout = layout_of(q, n, args);
    if (args.window > 0) return window_backward(q, k, v, out, lse, dout, dq, dk, dv, args, *ring);
    const int64_t c = layout.c, T = q.size(0);
    const Device dev = q.device();
    if (!args.documents.empty()) return backward_rounds(q, k, v, out, lse, dout, dq, dk, dv, args, *ring);
    // A piece's LSE rows must be contiguous: the whole [Hq,T] serves pieces over all chunks.
    std::vector<Tensor> lse_chunk;
    for (int64_t h = 0; h * c < T; ++h) lse_chunk.push_back(lse_columns(lse, h * c, c));
    auto lse_rows = [&](int64_t b, int64_t e) { return e - b == T ? lse : lse_chunk[static_cast<size_t>(b / c)]; };

    Tensor dq_acc = Tensor::zeros(q.shape(), DType::f32, dev);
    GradRing grads(k, v);

    KvRing kv(k, v);
    for (int s = 0; s < n; ++s) {
      const int j = (r - s + n) % n;
      std::unique_ptr<CommWork> moving = s + 1 < n ? kv.pass(*ring, next, prev) : nullptr;
      struct KeyGrad {
        int64_t k_begin, k_end;
        Tensor dk, dv;
      };
      std::vector<KeyGrad> pending;  // this rank's share of block j's dK/dV, until its accumulator arrives
      for (const Piece& p : pieces_for(r, j, c, args.causal)) {
        const int64_t nq = p.q_end - p.q_begin, nk = p.k_end - p.k_begin;
        Tensor dq_p = Tensor::empty({nq, q.size(1), q.size(2)}, q.dtype(), dev);
        Tensor dk_p = Tensor::empty({nk, k.size(1), k.size(2)}, q.dtype(), dev);
        Tensor dv_p = Tensor::empty({nk, v.size(1), v.size(2)}, q.dtype(), dev);
        ops::attention_backward(q.rows(p.q_begin, p.q_end), kv.k().rows(p.k_begin, p.k_end),
                                kv.v().rows(p.k_begin, p.k_end), out.rows(p.q_begin, p.q_end),
                                lse_rows(p.q_begin, p.q_end), dout.rows(p.q_begin, p.q_end), dq_p, dk_p, dv_p,
                                params_of(args, p.causal));
        Tensor dq_rows = dq_acc.rows(p.q_begin, p.q_end);
        ops::add_inplace(dq_rows, dq_p);
        pending.push_back({p.k_begin, p.k_end, std::move(dk_p), std::move(dv_p)});
      }
      grads.arrive();
      for (const KeyGrad& g : pending) {
        Tensor dk_rows = grads.dk(g.k_begin, g.k_end), dv_rows = grads.dv(g.k_begin, g.k_end);
        ops::add_inplace(dk_rows, g.dk);
        ops::add_inplace(dv_rows, g.dv);
      }
      // Block j's accumulator goes on to r+1; after the last step it reaches j itself.
      grads.pass(*ring, next, prev);
      if (moving) {
        moving->wait();
        kv.advance();
      }
    }
    ops::cast(dq_acc, dq);
    grads.finish(dk, dv);
  }

  // Per rank, T = tokens_per_rank; what a ring step holds beside the model's own attention tensors.
  void plan(const PlanInputs& in, MemoryPlan& plan) const override {
    const int64_t T = in.tokens_per_rank, Hq = in.model.num_heads, Hkv = in.model.num_kv_heads, d = in.model.head_dim;
    const int64_t w = static_cast<int64_t>(dtype_size(in.weight_dtype));
    if (in.cp <= 1) return make_single_rank()->plan(in, plan);  // plain attention: the single-rank default's terms
    const int64_t q_elems = T * Hq * d, kv_elems = T * Hkv * d;
    for (const char* phase : {plan_phase::forward, plan_phase::backward})
      plan.add("ring_kv_buffers", "ring K/V receive buffers 2 x (K,V) [T,Hkv,d]", PlanCategory::communication,
               4 * kv_elems * w, phase);
    if (w != 4)
      plan.add("ring_output_accumulator", "ring output accumulator [T,Hq,d] fp32", PlanCategory::transient, q_elems * 4,
               plan_phase::forward);
    plan.add("ring_piece_output", "one piece's partial output [T,Hq,d] and LSE [Hq,T]", PlanCategory::transient,
             q_elems * w + Hq * T * 4, plan_phase::forward);
    plan.add("ring_dkv_accumulators", "travelling dK/dV accumulators 2 x (dK,dV) [T,Hkv,d] fp32",
             PlanCategory::communication, 4 * kv_elems * 4, plan_phase::backward);
    plan.add("ring_dq_accumulator", "ring dQ accumulator [T,Hq,d] fp32", PlanCategory::transient, q_elems * 4,
             plan_phase::backward);
    plan.add("ring_piece_grads", "one piece's dQ, dK, dV", PlanCategory::transient, (q_elems + 2 * kv_elems) * w,
             plan_phase::backward);
    plan.add("ring_lse_delta", "LSE per chunk and attention backward delta [Hq,T] fp32", PlanCategory::transient,
             2 * Hq * T * 4, plan_phase::backward);
    // Sliding-window layers (window.h) hold their chunks' halos beside rows the ring's buffers above
    // bound: K and V of up to 2k (W - 1) positions (k = 1 on the zigzag; balanced layouts cut up to
    // kMaxK chunk pairs a rank), and their dK/dV in fp32 on the way back.
    const auto& types = in.model.layer_types;
    if (in.model.sliding_window > 0 && std::ranges::count(types, std::string("sliding_attention")) > 0) {
      const int64_t pairs = in.documents_masked ? cp_ring::kMaxK : 1;
      const int64_t halo = std::min(2 * pairs * (in.model.sliding_window - 1), in.seq_len - T);
      for (const char* phase : {plan_phase::forward, plan_phase::backward})
        plan.add("ring_window_halos", "sliding-window halos: K, V [2k(W-1),Hkv,d]", PlanCategory::communication,
                 2 * halo * Hkv * d * w, phase);
      plan.add("ring_window_halo_grads", "sliding-window halos' dK, dV fp32", PlanCategory::communication,
               2 * halo * Hkv * d * 4, plan_phase::backward);
    }
    // The largest piece has T query rows (lcx/attention_cost.h: what one attention call allocates).
    const AttentionBytes piece = attention_call_bytes(Hq, T, d);
    plan.add("attention_forward_workspace", "attention forward workspace (cuDNN)", PlanCategory::transient,
             piece.forward, plan_phase::forward);
    plan.add("attention_backward_call", "one piece's backward dQ accumulator and workspace (cuDNN) [Hq,T,d] fp32 x 2",
             PlanCategory::transient, piece.backward, plan_phase::backward);
    // Masked by document, a ring step's rounds run as masked calls: a round's blocks hold at most
    // the rank's T query rows and T key rows, so the masked call of T rows bounds every round;
    // the rounds run one after another. Counted beside the above.
    if (in.documents_masked) {
      plan_document_masks(plan, Hq, T, d);
      // A ring step's rounds (schedule.h step_rounds) sum their dK/dV before the accumulator
      // arrives; the rounds' own partial buffers are the piece terms above, at full size.
      plan.add("ring_dkv_sums", "ring step's dK/dV sums 2 x [T,Hkv,d] fp32", PlanCategory::transient, 2 * kv_elems * 4,
               plan_phase::backward);
    }
  }

 private:
  void check_mesh(const Mesh& m) const {
    if (m.shape().cp != cp_)
      throw Error(str("cp_ring was created for cp = ", cp_, " but the rank mesh has cp = ", m.shape().cp),
                  "distributed.cp", "create the plugin with the [distributed] shape its mesh has (PluginArgs::mesh)");
  }

  // The last layout's window plan (window.h) for this window and these bounds.
  const cp_ring::WindowPlan& window_plan_of(const AttentionArgs& a) {
    if (window_ != a.window || window_layout_.n != layout_.n || window_layout_.chunks != layout_.chunks ||
        window_layout_.bounds != layout_.bounds || window_layout_.c != layout_.c ||
        !std::ranges::equal(window_documents_, a.documents)) {
      window_plan_ = cp_ring::window_plan(layout_, a.window, a.documents);
      window_ = a.window;
      window_layout_ = layout_;
      window_documents_.assign(a.documents.begin(), a.documents.end());
    }
    return window_plan_;
  }

  static ops::AttentionParams window_params(const AttentionArgs& a, const cp_ring::WindowChunk& w) {
    ops::AttentionParams p;
    p.scale = a.scale;
    p.causal = true;
    p.q_offset = w.begin;
    p.k_offset = w.halo_begin;
    p.documents = a.documents;
    p.window = a.window;
    return p;
  }

  // Per chunk of this rank, its keys and values over [halo; chunk]: the halo's rows from their
  // owners (this rank's own rows copied), this rank's rows sent to whoever needs them.
  void gather_halos(const Tensor& k, const Tensor& v, const cp_ring::WindowPlan& plan, Communicator& ring,
                    std::vector<Tensor>& kx, std::vector<Tensor>& vx) {
    const int r = ring.rank();
    const auto& mine = plan.chunks[static_cast<size_t>(r)];
    for (const cp_ring::WindowChunk& w : mine) {
      const int64_t halo = w.begin - w.halo_begin;
      Shape shape{halo + w.rows, k.size(1), k.size(2)};
      kx.push_back(Tensor::empty(shape, k.dtype(), k.device(), MemoryCategory::communication));
      vx.push_back(Tensor::empty(shape, v.dtype(), v.device(), MemoryCategory::communication));
      Tensor ko = kx.back().rows(halo, halo + w.rows), vo = vx.back().rows(halo, halo + w.rows);
      ops::cast(k.rows(w.row, w.row + w.rows), ko);
      ops::cast(v.rows(w.row, w.row + w.rows), vo);
    }
    std::vector<P2POp> moves;
    for (const cp_ring::HaloSegment& s : plan.segments) {
      if (s.owner != r && s.requester != r) continue;
      const Tensor ks = k.rows(s.src, s.src + s.rows), vs = v.rows(s.src, s.src + s.rows);
      if (s.requester == r) {
        Tensor kd = kx[static_cast<size_t>(s.slot)].rows(s.dst, s.dst + s.rows);
        Tensor vd = vx[static_cast<size_t>(s.slot)].rows(s.dst, s.dst + s.rows);
        if (s.owner == r) {
          ops::cast(ks, kd);
          ops::cast(vs, vd);
        } else {
          moves.push_back(P2POp::recv(kd, s.owner));
          moves.push_back(P2POp::recv(vd, s.owner));
        }
      } else {
        moves.push_back(P2POp::send(ks, s.requester));
        moves.push_back(P2POp::send(vs, s.requester));
      }
    }
    if (!moves.empty()) ring.send_recv(std::move(moves));
  }

  void window_forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, Tensor& lse,
                      const AttentionArgs& args, Communicator& ring) {
    const cp_ring::WindowPlan& plan = window_plan_of(args);
    std::vector<Tensor> kx, vx;
    gather_halos(k, v, plan, ring, kx, vx);
    const auto& mine = plan.chunks[static_cast<size_t>(ring.rank())];
    for (size_t i = 0; i < mine.size(); ++i) {
      const cp_ring::WindowChunk& w = mine[i];
      Tensor o = out.rows(w.row, w.row + w.rows);
      Tensor l = Tensor::empty({q.size(1), w.rows}, DType::f32, q.device());
      ops::attention_forward(q.rows(w.row, w.row + w.rows), kx[i], vx[i], o, l, window_params(args, w));
      ops::copy_columns(l, 0, lse, w.row, w.rows);
    }
  }

  // Each chunk's backward over [halo; chunk]: its dQ rows are whole; its chunk's dK/dV add into
  // this rank's fp32 sums, its halo's go back (fp32) to their owners and add into theirs.
  void window_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                       const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv, const AttentionArgs& args,
                       Communicator& ring) {
    const cp_ring::WindowPlan& plan = window_plan_of(args);
    const int r = ring.rank();
    const Device dev = q.device();
    std::vector<Tensor> kx, vx;
    gather_halos(k, v, plan, ring, kx, vx);
    Tensor dk_acc = Tensor::zeros(k.shape(), DType::f32, dev), dv_acc = Tensor::zeros(v.shape(), DType::f32, dev);
    const auto& mine = plan.chunks[static_cast<size_t>(r)];
    std::vector<Tensor> halo_dk, halo_dv;  // per chunk, fp32
    for (size_t i = 0; i < mine.size(); ++i) {
      const cp_ring::WindowChunk& w = mine[i];
      const int64_t halo = w.begin - w.halo_begin, q0 = w.row, q1 = w.row + w.rows;
      Tensor dqs = dq.rows(q0, q1);
      Tensor dkx = Tensor::empty(kx[i].shape(), k.dtype(), dev), dvx = Tensor::empty(vx[i].shape(), v.dtype(), dev);
      ops::attention_backward(q.rows(q0, q1), kx[i], vx[i], out.rows(q0, q1), lse_columns(lse, q0, w.rows),
                              dout.rows(q0, q1), dqs, dkx, dvx, window_params(args, w));
      Tensor dko = dk_acc.rows(q0, q1), dvo = dv_acc.rows(q0, q1);
      ops::add_inplace(dko, dkx.rows(halo, halo + w.rows));
      ops::add_inplace(dvo, dvx.rows(halo, halo + w.rows));
      halo_dk.push_back(Tensor::empty({halo, k.size(1), k.size(2)}, DType::f32, dev, MemoryCategory::communication));
      halo_dv.push_back(Tensor::empty({halo, v.size(1), v.size(2)}, DType::f32, dev, MemoryCategory::communication));
      if (halo > 0) {
        ops::cast(dkx.rows(0, halo), halo_dk.back());
        ops::cast(dvx.rows(0, halo), halo_dv.back());
      }
    }
    std::vector<P2POp> moves;
    struct Arriving {
      int64_t src;
      Tensor dk, dv;
    };
    std::vector<Arriving> arriving;
    for (const cp_ring::HaloSegment& s : plan.segments) {
      if (s.owner != r && s.requester != r) continue;
      if (s.requester == r) {
        const Tensor gk = halo_dk[static_cast<size_t>(s.slot)].rows(s.dst, s.dst + s.rows);
        const Tensor gv = halo_dv[static_cast<size_t>(s.slot)].rows(s.dst, s.dst + s.rows);
        if (s.owner == r) {
          Tensor ak = dk_acc.rows(s.src, s.src + s.rows), av = dv_acc.rows(s.src, s.src + s.rows);
          ops::add_inplace(ak, gk);
          ops::add_inplace(av, gv);
        } else {
          moves.push_back(P2POp::send(gk, s.owner));
          moves.push_back(P2POp::send(gv, s.owner));
        }
      } else {
        Arriving a{s.src, Tensor::empty({s.rows, k.size(1), k.size(2)}, DType::f32, dev, MemoryCategory::communication),
                   Tensor::empty({s.rows, v.size(1), v.size(2)}, DType::f32, dev, MemoryCategory::communication)};
        moves.push_back(P2POp::recv(a.dk, s.requester));
        moves.push_back(P2POp::recv(a.dv, s.requester));
        arriving.push_back(std::move(a));
      }
    }
    if (!moves.empty()) ring.send_recv(std::move(moves));
    for (const Arriving& a : arriving) {
      Tensor ak = dk_acc.rows(a.src, a.src + a.dk.size(0)), av = dv_acc.rows(a.src, a.src + a.dv.size(0));
      ops::add_inplace(ak, a.dk);
      ops::add_inplace(av, a.dv);
    }
    ops::cast(dk_acc, dk);
    ops::cast(dv_acc, dv);
  }

  // With packed documents each ring step runs as rounds (schedule.h step_rounds): one call of
  // ops::attention_forward_blocks per round writes the round's blocks into full-size partial
  // buffers, and the runs of query rows it wrote fold into the running result (the first result a
  // row gets is copied). Every query sees at least itself, so every row has a result at the end.
  void forward_rounds(const Tensor& q, KvRing& kv, Tensor& acc, Tensor& lse, const AttentionArgs& args,
                      Communicator& ring) {
    const int r = ring.rank(), n = ring.size(), next = (r + 1) % n, prev = (r + n - 1) % n;
    const int64_t T = q.size(0);
    Tensor o = Tensor::empty(q.shape(), q.dtype(), q.device());
    Tensor l = Tensor::empty({q.size(1), T}, DType::f32, q.device());
    std::vector<char> seen(static_cast<size_t>(T), 0);
    for (int s = 0; s < n; ++s) {
      const int j = (r - s + n) % n;
      std::unique_ptr<CommWork> moving = s + 1 < n ? kv.pass(ring, next, prev) : nullptr;
      for (const cp_ring::Round& round : rounds_of(r, j, args)) {
        ops::attention_forward_blocks(q, kv.k(), kv.v(), o, l, args.scale, round.causal, round.blocks);
        for (const auto& [b, e] : query_runs(round))
          for (int64_t a = b; a < e;) {  // split where rows already seen meet rows not yet seen
            const bool first = seen[static_cast<size_t>(a)] == 0;
            int64_t z = a;
            while (z < e && (seen[static_cast<size_t>(z)] == 0) == first) seen[static_cast<size_t>(z++)] = 1;
            cp_ring::merge_rows(acc, lse, o, l, a, z - a, first);
            a = z;
          }
      }
      if (moving) {
        moving->wait();
        kv.advance();
      }
    }
    LCX_CHECK(std::ranges::all_of(seen, [](char x) { return x != 0; }),
              "cp_ring: a query row saw no key in any ring step; the document bounds must cover every position");
  }

  // The backward by the same rounds: each round's dQ adds into the rank's fp32 dQ on the rows it
  // wrote, its dK/dV into a step's fp32 sums on the key rows it wrote, and those sums into the
  // travelling accumulator once it has arrived.
  void backward_rounds(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                       const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv, const AttentionArgs& args,
                       Communicator& ring) {
    const int r = ring.rank(), n = ring.size(), next = (r + 1) % n, prev = (r + n - 1) % n;
    const Device dev = q.device();
    Tensor dq_acc = Tensor::zeros(q.shape(), DType::f32, dev);
    GradRing grads(k, v);
    Tensor dk_step = Tensor::empty(k.shape(), DType::f32, dev), dv_step = Tensor::empty(v.shape(), DType::f32, dev);
    Tensor dq_r = Tensor::empty(q.shape(), q.dtype(), dev);
    Tensor dk_r = Tensor::empty(k.shape(), q.dtype(), dev), dv_r = Tensor::empty(v.shape(), q.dtype(), dev);
    KvRing kv(k, v);
    for (int s = 0; s < n; ++s) {
      const int j = (r - s + n) % n;
      std::unique_ptr<CommWork> moving = s + 1 < n ? kv.pass(ring, next, prev) : nullptr;
      const std::vector<cp_ring::Round>& rounds = rounds_of(r, j, args);
      std::vector<std::pair<int64_t, int64_t>> key_rows;  // the step's, for the accumulator
      if (!rounds.empty()) {
        dk_step.zero();
        dv_step.zero();
      }
      for (const cp_ring::Round& round : rounds) {
        ops::attention_backward_blocks(q, kv.k(), kv.v(), out, lse, dout, dq_r, dk_r, dv_r, args.scale, round.causal,
                                       round.blocks);
        for (const auto& [b, e] : query_runs(round)) {
          Tensor rows = dq_acc.rows(b, e);
          ops::add_inplace(rows, dq_r.rows(b, e));
        }
        for (const auto& [b, e] : key_runs(round)) {
          Tensor dks = dk_step.rows(b, e), dvs = dv_step.rows(b, e);
          ops::add_inplace(dks, dk_r.rows(b, e));
          ops::add_inplace(dvs, dv_r.rows(b, e));
          key_rows.emplace_back(b, e);
        }
      }
      grads.arrive();
      for (const auto& [b, e] : coalesced(std::move(key_rows))) {
        Tensor dka = grads.dk(b, e), dva = grads.dv(b, e);
        ops::add_inplace(dka, dk_step.rows(b, e));
        ops::add_inplace(dva, dv_step.rows(b, e));
      }
      grads.pass(ring, next, prev);
      if (moving) {
        moving->wait();
        kv.advance();
      }
    }
    ops::cast(dq_acc, dq);
    grads.finish(dk, dv);
  }

  // Row ranges sorted and joined where they touch: one merge or add per run, not per block.
  static std::vector<std::pair<int64_t, int64_t>> coalesced(std::vector<std::pair<int64_t, int64_t>> rows) {
    std::sort(rows.begin(), rows.end());
    std::vector<std::pair<int64_t, int64_t>> out;
    for (const auto& [b, e] : rows) {
      if (!out.empty() && b <= out.back().second) out.back().second = std::max(out.back().second, e);
      else out.emplace_back(b, e);
    }
    return out;
  }
  static std::vector<std::pair<int64_t, int64_t>> query_runs(const cp_ring::Round& round) {
    std::vector<std::pair<int64_t, int64_t>> rows;
    for (const ops::AttentionBlock& b : round.blocks) rows.emplace_back(b.q_begin, b.q_begin + b.q_rows);
    return coalesced(std::move(rows));
  }
  static std::vector<std::pair<int64_t, int64_t>> key_runs(const cp_ring::Round& round) {
    std::vector<std::pair<int64_t, int64_t>> rows;
    for (const ops::AttentionBlock& b : round.blocks) rows.emplace_back(b.k_begin, b.k_begin + b.k_rows);
    return coalesced(std::move(rows));
  }

  // The cp communicator of this rank's mesh; nullptr when one rank holds the sequence.
  Communicator* ring_comm() const {
    if (cp_ == 1) return nullptr;
    if (!mesh_)
      throw Error(str("cp_ring: cp = ", cp_, " but configure() was given no rank mesh"), "distributed.cp",
                  "configure the plugin with its rank's mesh (the trainer does), or run with cp = 1");
    return &mesh_->cp();
  }

  // What one rank sends per layer and per step; every rank sends the same.
  void log_traffic(int64_t T, const Tensor& k, int n) const {
    const int64_t kv = 2 * static_cast<int64_t>(k.nbytes());  // K and V of one block
    const int64_t grads = 2 * k.numel() * 4;                  // fp32 dK and dV
    const int64_t fwd = (n - 1) * kv, bwd = (n - 1) * kv + n * grads;
    const int64_t step = layers_ * (2 * fwd + bwd);  // forward, recompute, backward
    log::info(str("cp_ring: ring traffic per rank (", T, " tokens of ", T * n, ", cp ", n, "): per layer forward ",
                  format_bytes(fwd), " (", n - 1, " K/V blocks), backward ", format_bytes(bwd),
                  " (K/V again, dK/dV fp32 ", format_bytes(n * grads), "); per step (", layers_,
                  " layers, forward + recompute + backward) ", format_bytes(step)));
  }

  // The layout shard() cut this rank's rows by: the same function of the same bounds. Kept for
  // the next call, since every layer of a step (forward, recompute and backward) asks again.
  const ChunkLayout& layout_of(const Tensor& q, int n, const AttentionArgs& a) {
    if (q.size(0) % 2 != 0)
      throw Error(str("cp_ring: a rank's attention got ", q.size(0), " query rows; its shard holds equal chunks, ",
                      "an even number of them"),
                  {}, "hand attention the rows of this rank's shard (cp_ring.shard)");
    const int64_t L = q.size(0) * n;
    if (layout_.n != n || layout_.c * 2 * layout_.k * n != L ||
        !std::ranges::equal(layout_documents_, a.documents)) {
      layout_ = layout_for(a.documents, L, n);
      layout_documents_.assign(a.documents.begin(), a.documents.end());
      rounds_.clear();
    }
    return layout_;
  }

  // Rank r's rounds against each rank's block under the layout layout_of last answered: the same
  // for every layer and pass of a step, so computed once per layout.
  const std::vector<cp_ring::Round>& rounds_of(int r, int j, const AttentionArgs& a) {
    if (rounds_.empty() || rounds_rank_ != r || rounds_causal_ != a.causal) {
      rounds_.clear();
      for (int i = 0; i < layout_.n; ++i) rounds_.push_back(cp_ring::step_rounds(r, i, layout_, a.causal, a.documents));
      rounds_rank_ = r;
      rounds_causal_ = a.causal;
    }
    return rounds_[static_cast<size_t>(j)];
  }

  // shard() and the attention ask for the layout of the same bounds; with packed documents it takes
  // up to 1.0 s of host time at a million tokens (balance.h balanced_layout), so the last
  // answers are kept, keyed by their bounds. Locked, because shard() is const and its contract does
  // not tie it to the step's thread: the trainer cuts a step's later sequences and the next step's
  // on a worker while the attention runs this one (train/trainer.cpp cut_ahead), so shard() finds
  // their layouts here. Enough for two steps of grad_accum = 8.
  ChunkLayout layout_for(std::span<const int64_t> documents, int64_t L, int n) const {
    if (!costs_ || documents.size() <= 2) return cp_ring::zigzag_layout(L, n);
    auto same = [&](const Known& m) { return m.L == L && m.n == n && std::ranges::equal(m.documents, documents); };
    {
      std::lock_guard<std::mutex> hold(known_mutex_);
      for (const Known& m : known_)
        if (same(m)) return m.layout;
    }
    ChunkLayout layout = cp_ring::balanced_layout(documents, L, n, *costs_);
    std::lock_guard<std::mutex> hold(known_mutex_);
    if (known_.size() >= kKnownLayouts) known_.erase(known_.begin());
    known_.push_back({std::vector<int64_t>(documents.begin(), documents.end()), L, n, layout});
    return layout;
  }
  struct Known {
    std::vector<int64_t> documents;
    int64_t L;
    int n;
    ChunkLayout layout;
  };
  static constexpr size_t kKnownLayouts = 16;
  mutable std::mutex known_mutex_;
  mutable std::vector<Known> known_;

  int cp_;
  std::optional<cp_ring::RingCosts> costs_;
  Mesh* mesh_ = nullptr;
  int64_t layers_ = 0;
  std::atomic<bool> logged_{false};
  ChunkLayout layout_;                     // layout_of's last answer, for layout_documents_
  std::vector<int64_t> layout_documents_;
  std::vector<std::vector<cp_ring::Round>> rounds_;  // rounds_of's, per block owner j
  cp_ring::WindowPlan window_plan_;                  // window_plan_of's, for these:
  int64_t window_ = 0;
  ChunkLayout window_layout_;
  std::vector<int64_t> window_documents_;
  int rounds_rank_ = -1;
  bool rounds_causal_ = true;
};

// The ring's size is [distributed] cp.
std::unique_ptr<Plugin> create(const PluginArgs& args) {
  args.config.describe("attend_across_documents", "moved to [data] attend_across_documents; refused here");
  args.config.describe("balance", "how packed documents' shards are laid out over the ring's ranks: time (the slowest "
                       "rank's predicted time), work (the masked work alone), zigzag (as without documents)",
                       "time, work, zigzag");
  if (args.config.has("attend_across_documents"))
    args.config.fail("attend_across_documents", "moved to [data]: it decides for the data and every provider",
                     "drop cp_ring.attend_across_documents and set [data] attend_across_documents");
  // How shards are laid out for packed documents: "time" (the slowest rank's predicted time: the
  // padded work of the GPU's batches and a cost per call), "work" (the masked work alone), "zigzag"
  // (as without documents).
  const std::string balance = args.config.get_string("balance", "time");
  if (balance != "time" && balance != "work" && balance != "zigzag")
    args.config.fail("balance", str("is '", balance, "'; it is time, work or zigzag"),
                     "leave it unset (time: shards laid out for the slowest rank's predicted time)");
  std::optional<cp_ring::RingCosts> costs;
  if (balance == "time") costs = cp_ring::ring_costs();
  else if (balance == "work") costs = cp_ring::kMaskedWorkOnly;
  return std::make_unique<CpRing>(args.mesh.cp, costs);
}

}  // namespace
}  // namespace lcx

LCX_PLUGIN(LCX_SLOT_PARALLELISM, "cp_ring", "1.0.0",
           "ring attention over a zigzag-sharded sequence: exact forward and backward, in-process and NCCL rings",
           "ready", lcx::create)
