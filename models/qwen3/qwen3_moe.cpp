#include "qwen3_moe.h"

#include <span>

#include "lcx/ops.h"

namespace lcx::qwen3 {
namespace {

Tensor like(Shape s, const Tensor& t) { return Tensor::empty(std::move(s), t.dtype(), t.device()); }

// The experts' inputs in sorted order and their SwiGLU: x_e, gate, up and silu(gate) * up.
struct ExpertActs {
  Tensor xs, gate, up, act;
};

ExpertActs expert_inputs(const Tensor& h, const MoeWeights& w, const MoeRouting& r) {
  const int64_t n = r.order.numel(), I = w.gate.size(1);
  const std::span<const int64_t> off(r.offsets);
  const int64_t k = n / h.size(0);
  ExpertActs a;
  a.xs = like({n, h.size(1)}, h);
  ops::gather_rows(h, r.order, k, a.xs);
  a.gate = like({n, I}, h);
  a.up = like({n, I}, h);
  ops::grouped_matmul(a.xs, w.gate, true, off, a.gate);
  ops::grouped_matmul(a.xs, w.up, true, off, a.up);
  a.act = like({n, I}, h);
  ops::swiglu_forward(a.gate, a.up, a.act);
  return a;
}

}  // namespace

MoeRouting moe_route(const Tensor& h, const Tensor& router, int64_t top_k, bool norm_topk) {
  const int64_t T = h.size(0), E = router.size(0);
  MoeRouting r;
  Tensor logits = like({T, E}, h);
  ops::matmul(h, false, router, true, logits);
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

void moe_forward(const Tensor& h, const MoeWeights& w, const MoeRouting& r, Tensor& out) {
  ExpertActs a = expert_inputs(h, w, r);
  a.xs = a.gate = a.up = Tensor();
  Tensor ys = like({r.order.numel(), h.size(1)}, h);
  ops::grouped_matmul(a.act, w.down, true, std::span<const int64_t>(r.offsets), ys);
  a.act = Tensor();
  ops::moe_combine(ys, r.position, r.weights, out);
}

void moe_backward(const Tensor& h, const MoeWeights& w, const MoeRouting& r, bool norm_topk, const Tensor& dout,
                  const Tensor* aux_grad, Tensor& dh, MoeWeights& grads) {
  const int64_t T = h.size(0), H = h.size(1), n = r.order.numel(), k = n / T, I = w.gate.size(1);
  const std::span<const int64_t> off(r.offsets);
  ExpertActs a = expert_inputs(h, w, r);
  Tensor ys = like({n, H}, h);
  ops::grouped_matmul(a.act, w.down, true, off, ys);
  // The combine: each slot's output gradient (its weight times its token's) and each weight's.
  Tensor dys = like({n, H}, h);
  Tensor dweights = Tensor::empty({T, k}, DType::f32, h.device());
  ops::moe_combine_backward(dout, ys, r.order, r.position, r.weights, dys, dweights);
  ys = Tensor();
  // down: dact = dys @ Wd[e], dWd[e] += dys_e^T @ act_e.
  Tensor dact = like({n, I}, h);
  ops::grouped_matmul(dys, w.down, false, off, dact);
  if (grads.down.defined()) ops::grouped_matmul_wgrad(dys, a.act, off, grads.down);
  dys = a.act = Tensor();
  Tensor dgate = like({n, I}, h), dup = like({n, I}, h);
  ops::swiglu_backward(a.gate, a.up, dact, dgate, dup);
  dact = a.gate = a.up = Tensor();
  if (grads.gate.defined()) ops::grouped_matmul_wgrad(dgate, a.xs, off, grads.gate);
  if (grads.up.defined()) ops::grouped_matmul_wgrad(dup, a.xs, off, grads.up);
  a.xs = Tensor();
  Tensor dxs = like({n, H}, h);
  ops::grouped_matmul(dgate, w.gate, false, off, dxs);
  ops::grouped_matmul(dup, w.up, false, off, dxs, 1.f, 1.f);
  dgate = dup = Tensor();
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
}

}  // namespace lcx::qwen3
