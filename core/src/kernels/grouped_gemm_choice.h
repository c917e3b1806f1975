// Whether the grouped GEMMs (ops::grouped_matmul, ops::grouped_matmul_wgrad) may take lcx's Hopper
// kernels ([run] grouped_gemm = "hopper", set once per run by train/run.cpp; false until then), or
// cuBLAS's grouped GEMM alone.
#pragma once

namespace lcx::ops {

void set_own_grouped_gemm(bool allowed);
bool own_grouped_gemm();

}  // namespace lcx::ops
