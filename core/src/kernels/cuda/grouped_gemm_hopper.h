// The Hopper grouped GEMMs (grouped_gemm_sm90a.cu), the same contract as ops::grouped_matmul and
// ops::grouped_matmul_wgrad. Each returns false, having done nothing, for a call it does not serve
// (another device, dtype, alignment or shape); grouped_matmul.cu then takes cuBLAS's grouped GEMM.
#pragma once
#include <cstdint>
#include <span>

#include "lcx/tensor.h"

namespace lcx::ops::cuda::grouped_hopper {

bool grouped_matmul(const Tensor& x, const Tensor& w, bool trans_w, std::span<const int64_t> offsets, Tensor& y,
                    float alpha, float beta);
bool grouped_matmul_wgrad(const Tensor& dy, const Tensor& x, std::span<const int64_t> offsets, Tensor& dw, float alpha,
                          float beta);

// Which of the two designs runs (grouped_gemm_sm90a.cu): ping-pong (true) or cooperative.
void set_ping_pong(bool on);

}  // namespace lcx::ops::cuda::grouped_hopper
