// A router's whole result on the host, for the MoE op tests: moe_route's weights and experts, then
// moe_permute's order, position and offsets.
#pragma once
#include "lcx/ops.h"

namespace lcx::test {

struct Routed {
  Tensor weights, experts, order, position, offsets;
};

inline Routed route_on_host(const Tensor& logits, int64_t k, bool norm_topk = true) {
  const int64_t T = logits.size(0), E = logits.size(1);
  Routed r{Tensor::zeros({T, k}, DType::f32), Tensor::zeros({T, k}, DType::i32), Tensor::zeros({T * k}, DType::i32),
           Tensor::zeros({T * k}, DType::i32), Tensor::zeros({E + 1}, DType::i64)};
  ops::moe_route(logits, k, norm_topk, r.weights, r.experts, nullptr);
  ops::moe_permute(r.experts, E, r.order, r.position, r.offsets);
  return r;
}

}  // namespace lcx::test
