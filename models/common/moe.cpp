#include "moe.h"

#include <optional>
#include <span>

#include "lcx/comm.h"
#include "lcx/error.h"
#include "lcx/ops.h"

namespace lcx::decoder {
namespace {

Tensor like(Shape s, const Tensor& t) { return Tensor::empty(std::move(s), t.dtype(), t.device()); }

// One routing's rows between the ranks of an expert-parallel group. This rank's sorted rows are
// grouped by expert, so the rows for rank j's experts are one contiguous run, expert by expert.
// The rows this rank's experts take are laid out by local expert, then source rank (block (e, s)),
// so each expert's rows are contiguous for the grouped GEMMs and the order is fixed (the same bits
// every run, whatever arrives first).
class Dispatch {
 public:
  Dispatch(const MoeRouting& r, int64_t num_experts, int64_t local_experts, Communicator& comm)
      : comm_(comm), E_(num_experts), El_(local_experts), ep_(comm.size()), me_(comm.rank()), send_(r.offsets) {
    // Every rank's per-expert counts, summed into place: host integers, exact in fp64.
    std::vector<double> c(static_cast<size_t>(ep_ * E_), 0.0);
    for (int64_t g = 0; g < E_; ++g) c[static_cast<size_t>(me_ * E_ + g)] = static_cast<double>(send_[g + 1] - send_[g]);
    comm_.all_reduce(std::span<double>(c));
    counts_.assign(c.begin(), c.end());
    recv_.assign(static_cast<size_t>(El_ * ep_ + 1), 0);
    offsets_.assign(static_cast<size_t>(El_ + 1), 0);
    int64_t at = 0;
    for (int64_t e = 0; e < El_; ++e) {
      offsets_[static_cast<size_t>(e)] = at;
      for (int s = 0; s < ep_; ++s) {
        recv_[static_cast<size_t>(e * ep_ + s)] = at;
        at += count(s, me_ * El_ + e);
      }
    }
    offsets_.back() = recv_.back() = at;
  }

  // Where this rank's experts' rows begin, by local expert ([E/ep + 1], on the host).
  std::span<const int64_t> offsets() const { return offsets_; }
  // This rank's sorted rows [T*k, X] to their experts' ranks: the rows its own experts take [R, X].
  Tensor to_experts(const Tensor& sorted) const {
    Tensor out = Tensor::empty({offsets_.back(), sorted.size(1)}, sorted.dtype(), sorted.device());
    exchange(sorted, out, true);
    return out;
  }
  // Rows its experts computed [R, X] back to the ranks whose tokens they are: [T*k, X] in sorted order.
  Tensor from_experts(const Tensor& rows) const {
    Tensor out = Tensor::empty({send_.back(), rows.size(1)}, rows.dtype(), rows.device());
    exchange(rows, out, false);
    return out;
  }

 private:
  int64_t count(int rank, int64_t expert) const { return counts_[static_cast<size_t>(rank * E_ + expert)]; }

  // Block by block: this rank's sorted rows for expert e of each peer (a), and that peer's rows
  // for this rank's expert e (b). Sends and receives of a pair of ranks go in expert order on
  // both sides, which is how point-to-point ops match; empty blocks are skipped by both.
  void exchange(const Tensor& src, Tensor& dst, bool to_experts) const {
    std::vector<P2POp> ops;
    for (int peer = 0; peer < ep_; ++peer)
      for (int64_t e = 0; e < El_; ++e) {
        const int64_t g = peer * El_ + e, a0 = send_[static_cast<size_t>(g)], a1 = send_[static_cast<size_t>(g + 1)];
        const int64_t b0 = recv_[static_cast<size_t>(e * ep_ + peer)], b1 = b0 + count(peer, me_ * El_ + e);
        if (peer == me_) {  // rows that stay: a copy, never a message to itself
          if (to_experts)
            dst.rows(b0, b1).copy_from(src.rows(a0, a1));
          else
            dst.rows(a0, a1).copy_from(src.rows(b0, b1));
          continue;
        }
        if (to_experts) {
          if (a1 > a0) ops.push_back(P2POp::send(src.rows(a0, a1), peer));
          if (b1 > b0) ops.push_back(P2POp::recv(dst.rows(b0, b1), peer));
        } else {
          if (b1 > b0) ops.push_back(P2POp::send(src.rows(b0, b1), peer));
          if (a1 > a0) ops.push_back(P2POp::recv(dst.rows(a0, a1), peer));
        }
      }
    if (!ops.empty()) comm_.send_recv(std::move(ops));
  }

  Communicator& comm_;
  int64_t E_, El_;
  int ep_, me_;
  std::vector<int64_t> send_;     // [E+1]: this rank's sorted rows of each expert (the routing's offsets)
  std::vector<int64_t> counts_;   // [ep*E]: rows rank s sends expert g
  std::vector<int64_t> recv_;     // [El*ep+1]: where block (e, s) of the received rows begins
  std::vector<int64_t> offsets_;  // [El+1]: where each local expert's received rows begin
};

// Where a routing's rows are computed: here, by every expert (no dispatch), or by the experts'
// ranks of the group.
struct Experts {
  const MoeRouting& r;
  std::optional<Dispatch> d;
  Experts(const MoeRouting& routing, const MoeWeights& w, Communicator* comm) : r(routing) {
    if (!comm) return;
    const int64_t E = w.router.size(0), El = w.local_experts();
    if (El * comm->size() != E)
      throw Error(str("qwen3: this rank holds ", El, " of ", E, " experts, but its expert-parallel group has ", comm->size(),
                      " ranks"),
                  "distributed.ep", "create the model for the run's mesh (PluginArgs::mesh and rank)");
    d.emplace(routing, E, El, *comm);
  }
  std::span<const int64_t> offsets() const { return d ? d->offsets() : std::span<const int64_t>(r.offsets); }
  Tensor to(const Tensor& sorted) const { return d ? d->to_experts(sorted) : sorted; }
  Tensor back(const Tensor& rows) const { return d ? d->from_experts(rows) : rows; }
};

// The experts' inputs (their rows, grouped by expert) and their SwiGLU: x_e, gate, up and
// silu(gate) * up. Rows may be none (an expert-parallel rank whose experts took no token).
struct ExpertActs {
  Tensor xs, gate, up, act;
};

// y_rows (+)= scale * (x_rows A_e^T) B_e^T: u [n, r] then the update onto y (beta 1: y holds the
// base GEMM's product).
void lora_rows(const Tensor& x, const LowRank& lr, std::span<const int64_t> off, Tensor& y) {
  Tensor u = like({x.size(0), lr.rank()}, x);
  ops::grouped_matmul(x, lr.a->value, true, off, u);
  ops::grouped_matmul(u, lr.b->value, true, off, y, lr.scale, 1.f);
}

// The backward of lora_rows over rows x [n, in] with dy [n, out]: u again, dB_e += scale dy_e^T u_e,
// g = scale dy B_e, dA_e += g_e^T x_e, dx += g A_e (dx holding the base GEMM's part).
void lora_rows_backward(const Tensor& x, const Tensor& dy, const LowRank& lr, std::span<const int64_t> off, Tensor& dx) {
  const int64_t n = x.size(0), r = lr.rank();
  Tensor u = like({n, r}, x);
  ops::grouped_matmul(x, lr.a->value, true, off, u);
  if (lr.b->grad.defined()) ops::grouped_matmul_wgrad(dy, u, off, lr.b->grad, lr.scale, 1.f);
  u = Tensor();
  Tensor g = like({n, r}, x);
  ops::grouped_matmul(dy, lr.b->value, false, off, g, lr.scale, 0.f);
  if (lr.a->grad.defined()) ops::grouped_matmul_wgrad(g, x, off, lr.a->grad, 1.f, 1.f);
  ops::grouped_matmul(g, lr.a->value, false, off, dx, 1.f, 1.f);
}

// [n, 1] ones in x's dtype and device: the K = 1 GEMMs that add a bias row and sum its gradient.
Tensor ones_like_rows(int64_t n, const Tensor& x) {
  Tensor host = Tensor::empty({n, 1}, DType::f32, Device::cpu());
  for (int64_t i = 0; i < n; ++i) host.data_as<float>()[i] = 1.f;
  Tensor typed = Tensor::empty({n, 1}, x.dtype(), Device::cpu());
  ops::cast(host, typed);
  return x.device().is_cuda() ? typed.to(x.device()) : typed;
}

// y[rows of e] += bias[e] for each expert's rows: a K = 1 GEMM per expert (ones @ bias row), as the
// decoder adds its biases, so every backend adds them with the GEMM it has.
void add_expert_bias(Tensor& y, const Tensor& bias, std::span<const int64_t> off) {
  if (y.size(0) == 0) return;
  const Tensor one = ones_like_rows(y.size(0), y);
  for (size_t e = 0; e + 1 < off.size(); ++e) {
    if (off[e + 1] == off[e]) continue;
    Tensor ye = y.rows(off[e], off[e + 1]);
    const Tensor b = bias.rows(static_cast<int64_t>(e), static_cast<int64_t>(e) + 1);
    ops::matmul(one.rows(off[e], off[e + 1]), false, b, false, ye, 1.f, 1.f);
  }
}

// dbias[e] += sum over expert e's rows of dy (dy^T @ ones per expert).
void expert_bias_grad(const Tensor& dy, std::span<const int64_t> off, Tensor& dbias) {
  if (!dbias.defined() || dy.size(0) == 0) return;
  const Tensor one = ones_like_rows(dy.size(0), dy);
  for (size_t e = 0; e + 1 < off.size(); ++e) {
    if (off[e + 1] == off[e]) continue;
    Tensor g = dbias.rows(static_cast<int64_t>(e), static_cast<int64_t>(e) + 1);
    ops::matmul(one.rows(off[e], off[e + 1]), true, dy.rows(off[e], off[e + 1]), false, g, 1.f, 1.f);
  }
}

// The fused layout's first half: gate_up [n,2I] (with its bias and adapter) and the activation.
ExpertActs fused_acts(const Tensor& xs, const MoeWeights& w, std::span<const int64_t> off, const MoeLora& lora) {
  const int64_t n = xs.size(0), I2 = w.gate_up.size(2);
  ExpertActs a;
  a.xs = xs;
  a.gate = like({n, I2}, xs);  // gate and up interleaved
  a.act = like({n, I2 / 2}, xs);
  if (n == 0) return a;
  ops::grouped_matmul(a.xs, w.gate_up, false, off, a.gate);
  add_expert_bias(a.gate, w.gate_up_bias, off);
  if (lora.gate) lora_rows(a.xs, *lora.gate, off, a.gate);
  ops::swiglu_clamped_forward(a.gate, w.alpha, w.limit, a.act);
  return a;
}

// ys [n,H] = the experts' down projection of their activations (with the fused layout's bias,
// and the adapter).
void expert_down(const Tensor& act, const MoeWeights& w, std::span<const int64_t> off, const MoeLora& lora, Tensor& ys) {
  if (ys.size(0) == 0) return;
  ops::grouped_matmul(act, w.down, !w.fused(), off, ys);
  if (w.fused()) add_expert_bias(ys, w.down_bias, off);
  if (lora.down) lora_rows(act, *lora.down, off, ys);
}

ExpertActs expert_acts(const Tensor& xs, const MoeWeights& w, std::span<const int64_t> off, const MoeLora& lora) {
  if (w.fused()) return fused_acts(xs, w, off, lora);
  const int64_t n = xs.size(0), I = w.gate.size(1);
  ExpertActs a;
  a.xs = xs;
  a.gate = like({n, I}, xs);
  a.up = like({n, I}, xs);
  a.act = like({n, I}, xs);
  if (n == 0) return a;
  ops::grouped_matmul(a.xs, w.gate, true, off, a.gate);
  ops::grouped_matmul(a.xs, w.up, true, off, a.up);
  if (lora.gate) lora_rows(a.xs, *lora.gate, off, a.gate);
  if (lora.up) lora_rows(a.xs, *lora.up, off, a.up);
  ops::swiglu_forward(a.gate, a.up, a.act);
  return a;
}

// This rank's (token, choice) slots' inputs in sorted order.
Tensor sorted_inputs(const Tensor& h, const MoeRouting& r) {
  const int64_t n = r.order.numel();
  Tensor xs = like({n, h.size(1)}, h);
  if (n > 0) ops::gather_rows(h, r.order, n / h.size(0), xs);
  return xs;
}

}  // namespace

namespace {
// From the slots' input gradients (sorted order, this rank's tokens) and the routing weights'
// gradients: dh, and the router's gradients.
void finish_backward(const Tensor& h, const MoeWeights& w, const MoeRouting& r, bool norm_topk, const Tensor* aux_grad,
                     Tensor dxs, const Tensor& dweights, Tensor& dh, MoeWeights& grads) {
  const int64_t T = h.size(0), k = r.weights.size(1);
  if (T == 0) return;
  // Back to the tokens: each token's k slots summed (the gather's backward), in slot order.
  Tensor ones = Tensor::zeros({T, k}, DType::f32, Device::cpu());
  for (int64_t i = 0; i < T * k; ++i) ones.data_as<float>()[i] = 1.f;
  ops::moe_combine(dxs, r.position, h.device().is_cuda() ? ones.to(h.device()) : ones, dh);
  dxs = Tensor();
  // The router: through the top-k weights (and the load-balancing loss's probabilities).
  Tensor dlogits = like({T, w.router.size(0)}, h);
  ops::moe_route_backward(r.probs, r.experts, r.weights, dweights, norm_topk, aux_grad, dlogits);
  ops::matmul(dlogits, false, w.router, false, dh, 1.f, 1.f);
  if (grads.router.defined()) ops::matmul(dlogits, true, h, false, grads.router, 1.f, 1.f);
  if (grads.router_bias.defined()) {
    Tensor gb = grads.router_bias.view({w.router.size(0), 1});
    ops::matmul(dlogits, true, ones_like_rows(T, h), false, gb, 1.f, 1.f);
  }
}
}  // namespace

MoeRouting moe_route(const Tensor& h, const Tensor& router, int64_t top_k, bool norm_topk, const Tensor& router_bias) {
  const int64_t T = h.size(0), E = router.size(0);
  MoeRouting r;
  if (T == 0) {
    r.probs = Tensor::empty({0, E}, DType::f32, h.device());
    r.weights = Tensor::empty({0, top_k}, DType::f32, h.device());
    r.experts = Tensor::empty({0, top_k}, DType::i32, h.device());
    r.order = r.position = Tensor::empty({0}, DType::i32, h.device());
    r.offsets.assign(static_cast<size_t>(E + 1), 0);
    return r;
  }
  Tensor logits = like({T, E}, h);
  ops::matmul(h, false, router, true, logits);
  if (router_bias.defined())
    ops::matmul(ones_like_rows(T, h), false, router_bias.view({1, E}), false, logits, 1.f, 1.f);
  r.probs = Tensor::empty({T, E}, DType::f32, h.device());
  r.weights = Tensor::empty({T, top_k}, DType::f32, h.device());
  r.experts = Tensor::empty({T, top_k}, DType::i32, h.device());
  ops::moe_route(logits, top_k, norm_topk, r.weights, r.experts, &r.probs);
  r.order = Tensor::empty({T * top_k}, DType::i32, h.device());
  r.position = Tensor::empty({T * top_k}, DType::i32, h.device());
  Tensor offsets = Tensor::empty({E + 1}, DType::i64, h.device());
  ops::moe_permute(r.experts, E, r.order, r.position, offsets);
  // The grouped GEMMs' shapes live on the host: one small copy (a wait for the router) per routing.
  const Tensor host = offsets.to(Device::cpu());
  r.offsets.assign(host.data_as<int64_t>(), host.data_as<int64_t>() + E + 1);
  return r;
}

void moe_forward(const Tensor& h, const MoeWeights& w, const MoeRouting& r, Tensor& out, Communicator* experts,
                 const MoeLora& lora) {
  const Experts ex(r, w, experts);
  ExpertActs a = expert_acts(ex.to(sorted_inputs(h, r)), w, ex.offsets(), lora);
  a.xs = a.gate = a.up = Tensor();
  Tensor ys = like({a.act.size(0), h.size(1)}, h);
  expert_down(a.act, w, ex.offsets(), lora, ys);
  a.act = Tensor();
  ys = ex.back(ys);
  if (h.size(0) > 0) ops::moe_combine(ys, r.position, r.weights, out);
}

void moe_backward(const Tensor& h, const MoeWeights& w, const MoeRouting& r, bool norm_topk, const Tensor& dout,
                  const Tensor* aux_grad, Tensor& dh, MoeWeights& grads, Communicator* experts, const MoeLora& lora) {
  const int64_t T = h.size(0), H = h.size(1), n = r.order.numel(), k = r.weights.size(1);
  const Experts ex(r, w, experts);
  const std::span<const int64_t> off = ex.offsets();
  ExpertActs a = expert_acts(ex.to(sorted_inputs(h, r)), w, off, lora);
  const int64_t R = a.xs.size(0);  // the rows this rank's experts run
  Tensor ys = like({R, H}, h);
  expert_down(a.act, w, off, lora, ys);  // the forward's very GEMMs, in its order: the same bits
  ys = ex.back(ys);
  // The combine: each slot's output gradient (its weight times its token's) and each weight's.
  Tensor dys = like({n, H}, h);
  Tensor dweights = Tensor::empty({T, k}, DType::f32, h.device());
  if (T > 0) ops::moe_combine_backward(dout, ys, r.order, r.position, r.weights, dys, dweights);
  ys = Tensor();
  dys = ex.to(dys);
  // down: dact = dys @ Wd[e]^T (fused: [in,out]) or dys @ Wd[e], and its gradient.
  Tensor dact = like({R, a.act.size(1)}, h);
  if (R > 0) ops::grouped_matmul(dys, w.down, w.fused(), off, dact);
  if (grads.down.defined() && R > 0) {
    if (w.fused())
      ops::grouped_matmul_wgrad(a.act, dys, off, grads.down);  // dWd[e] += act_e^T @ dys_e  [I,H]
    else
      ops::grouped_matmul_wgrad(dys, a.act, off, grads.down);  // dWd[e] += dys_e^T @ act_e  [H,I]
  }
  if (w.fused()) expert_bias_grad(dys, off, grads.down_bias);
  if (lora.down && R > 0) lora_rows_backward(a.act, dys, *lora.down, off, dact);
  dys = a.act = Tensor();
  if (w.fused()) {
    // gate_up: through the clamped SwiGLU, then dW[e] += x_e^T @ dgu_e [H,2I], the bias, the
    // adapter and the rows' gradient dgu @ W[e]^T.
    Tensor dgu = like({R, a.gate.size(1)}, h);
    if (R > 0) ops::swiglu_clamped_backward(a.gate, dact, w.alpha, w.limit, dgu);
    dact = a.gate = Tensor();
    if (grads.gate_up.defined() && R > 0) ops::grouped_matmul_wgrad(a.xs, dgu, off, grads.gate_up);
    expert_bias_grad(dgu, off, grads.gate_up_bias);
    Tensor dxs = like({R, H}, h);
    if (R > 0) {
      ops::grouped_matmul(dgu, w.gate_up, true, off, dxs);
      if (lora.gate) lora_rows_backward(a.xs, dgu, *lora.gate, off, dxs);
    }
    dgu = a.xs = Tensor();
    finish_backward(h, w, r, norm_topk, aux_grad, ex.back(dxs), dweights, dh, grads);
    return;
  }
  const int64_t I = w.gate.size(1);
  Tensor dgate = like({R, I}, h), dup = like({R, I}, h);
  if (R > 0) ops::swiglu_backward(a.gate, a.up, dact, dgate, dup);
  dact = a.gate = a.up = Tensor();
  if (grads.gate.defined() && R > 0) ops::grouped_matmul_wgrad(dgate, a.xs, off, grads.gate);
  if (grads.up.defined() && R > 0) ops::grouped_matmul_wgrad(dup, a.xs, off, grads.up);
  Tensor dxs = like({R, H}, h);
  if (R > 0) {
    ops::grouped_matmul(dgate, w.gate, false, off, dxs);
    ops::grouped_matmul(dup, w.up, false, off, dxs, 1.f, 1.f);
    if (lora.gate) lora_rows_backward(a.xs, dgate, *lora.gate, off, dxs);
    if (lora.up) lora_rows_backward(a.xs, dup, *lora.up, off, dxs);
  }
  dgate = dup = a.xs = Tensor();
  finish_backward(h, w, r, norm_topk, aux_grad, ex.back(dxs), dweights, dh, grads);
}

}  // namespace lcx::decoder
