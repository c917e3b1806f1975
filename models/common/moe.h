// The sparse MLP of Qwen3-MoE, as transformers 5.17 computes it (Qwen3MoeSparseMoeBlock), with an
// explicit backward.
//
//   logits = h @ Wr^T [T,E] ; p = softmax(logits) in fp32 ; (w, e) = its k largest per token,
//   renormalized to sum 1 when norm_topk_prob
//   the T*k (token, choice) slots sorted by expert ; expert e runs SwiGLU on its rows x_e:
//     y_e = (silu(x_e @ Wg[e]^T) * (x_e @ Wu[e]^T)) @ Wd[e]^T   (grouped GEMMs: one call for all experts)
//   out[t] = sum_j w[t,j] * y[slot (t,j)]
//
// Expert parallelism (a communicator of ep ranks, each holding E/ep of the experts, stacked
// [E/ep, ...]): every rank routes its own tokens over all E experts with the whole router, so the
// sorted rows are already grouped by the rank that holds their expert. The ranks first learn each
// other's per-expert row counts (one all-reduce of host counts), then each rank's rows go to
// their experts' ranks by point-to-point sends of exactly their size (send_recv_async: an
// all_to_all would pad every block to the largest, up to ep times the rows when one expert takes
// every token). A rank receives its experts' rows grouped by expert (then by source rank, then in
// the source's sorted order), so its experts run as the same grouped GEMMs over them; the outputs
// travel back along the same blocks. The backward sends the outputs' gradients to the experts'
// ranks, computes the experts' weight gradients and their inputs' gradients there, and sends those
// back. Every rank of the group runs every exchange, even with no tokens of its own.
//
// No token is dropped: an expert takes every row routed to it. The experts' weights are stacked per
// layer ([E,I,H] gate and up, [E,H,I] down), so every expert of a layer runs in one GEMM call; the
// host learns the per-expert row counts once per routing (the grouped GEMMs' shapes). Nothing is
// kept between forward and backward: the backward routes again from the recomputed input (the
// same bits, so the same experts) and rebuilds the experts' activations.
#pragma once
#include <cstdint>
#include <vector>

#include "lcx/slots/adapter.h"
#include "lcx/tensor.h"

namespace lcx {
class Communicator;
}

namespace lcx::decoder {

// One sparse layer's weights (values), or their gradients (fp32, or undefined where frozen), in
// one of two layouts:
//  - Qwen3-MoE's: gate, up [E,I,H] and down [E,H,I], every expert's gate_proj, up_proj, down_proj,
//    and out = silu(gate) * up;
//  - GPT-OSS's (fused: gate_up defined): gate_up [E,H,2I] with gate and up interleaved along its
//    last axis, down [E,I,H] (both [in,out]), each with a bias per expert (gate_up_bias [E,2I],
//    down_bias [E,H]), the router with a bias [E], and the clamped SwiGLU of swiglu_clamped_forward
//    (alpha, limit):
//      y_e = swiglu_clamped(x_e @ gate_up[e] + gate_up_bias[e]) @ down[e] + down_bias[e]
// Under expert parallelism the experts' tensors are this rank's E/ep experts ([E/ep, ...]).
struct MoeWeights {
  Tensor router;           // [E,H]: HF's mlp.gate.weight (mlp.router.weight)
  Tensor router_bias;      // [E] or undefined
  Tensor gate, up, down;
  Tensor gate_up, gate_up_bias, down_bias;
  float alpha = 0, limit = 0;  // the clamped SwiGLU's (fused layout)
  bool fused() const { return gate_up.defined(); }
  int64_t local_experts() const { return fused() ? gate_up.size(0) : gate.size(0); }
};

// Low-rank adapters on the experts (Adapter::find_experts), each null where not adapted: the
// factors of this rank's experts, A [E_local, r, in], B [E_local, out, r]. Expert e's rows x_e get
//   gate_e = x_e Wg[e]^T + scale * (x_e Ag[e]^T) Bg[e]^T   (up and down alike)
// In the fused layout `gate` adapts gate_up (out = 2I, interleaved as the weight) and up is null.
// as two more grouped GEMMs over the same sorted rows (the rank r inner), and the backward
// accumulates the factors' gradients (grouped wgrad), never the frozen experts'.
struct MoeLora {
  const LowRank* gate = nullptr;
  const LowRank* up = nullptr;
  const LowRank* down = nullptr;
  bool any() const { return gate || up || down; }
};

// One routing of T tokens: what the forward and the backward share.
struct MoeRouting {
  Tensor probs;               // fp32 [T,E], the whole softmax
  Tensor weights, experts;    // fp32 [T,k], int32 [T,k]
  Tensor order, position;     // int32 [T*k]: the slot at each sorted row, and each slot's sorted row
  std::vector<int64_t> offsets;  // on the host, [E+1]: where each expert's rows begin
};

// h may have no rows (a rank of an expert-parallel group whose tokens ran out before the
// group's last tile): the routing is then empty, its offsets all 0.
// router_bias, when defined ([E]), is added to the logits (GPT-OSS). Its softmax over the k largest
// logits is moe_route's top-k of the whole softmax renormalized (norm_topk): the same numbers.
MoeRouting moe_route(const Tensor& h, const Tensor& router, int64_t top_k, bool norm_topk,
                     const Tensor& router_bias = {});
// out [T,H] = the block's output for h [T,H] under routing r. experts: the expert-parallel group
// (w holds this rank's experts), or null where w holds every expert.
void moe_forward(const Tensor& h, const MoeWeights& w, const MoeRouting& r, Tensor& out, Communicator* experts = nullptr,
                 const MoeLora& lora = {});
// Writes dh [T,H] and accumulates the weights' gradients (those defined). aux_grad (fp32 [E], or
// null): the load-balancing loss's gradient with respect to every token's probability of expert e.
void moe_backward(const Tensor& h, const MoeWeights& w, const MoeRouting& r, bool norm_topk, const Tensor& dout,
                  const Tensor* aux_grad, Tensor& dh, MoeWeights& grads, Communicator* experts = nullptr,
                  const MoeLora& lora = {});

}  // namespace lcx::decoder
