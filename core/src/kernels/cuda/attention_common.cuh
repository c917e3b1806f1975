// What the flash-style attention kernels share: the parameter struct, the tile sizes, the tile
// loader and the causal visibility rule. Tiles are 64 query rows by 64 key rows; a head of
// dimension d is padded with zeros to D in {32, 64, 128} so one instantiation serves every d up
// to D. Tiles sit in shared memory as fp32 rows of D + 1 floats: the odd stride puts the rows a
// warp reads at one column in distinct banks.
#pragma once
#include <cmath>

#include "kernels/cuda/common.cuh"
#include "lcx/ops.h"

namespace lcx::ops::cuda::attn {

constexpr int kBr = 64;  // query rows per tile
constexpr int kBc = 64;  // key rows per tile
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

struct Params {
  const void* q;
  const void* k;
  const void* v;
  const void* out;
  const void* dout;
  void* o;  // forward output, or dq in the dq pass
  void* dk;
  void* dv;
  DType tq, tk, tv, to, tdo, tdq, tdk, tdv;
  const float* lse_in;
  float* lse_out;
  float* delta;  // rowsum(dout * out), fp32 [Hq, T]
  int64_t T, S, Hq, Hkv, d;
  int64_t q_offset, k_offset;
  float scale;       // softmax scale
  float scale_log2;  // scale * log2(e): scores live in the exp2 domain
  bool causal;
};

// Query row i (global position q_offset + i) sees key j (k_offset + j).
__device__ __forceinline__ bool visible(const Params& p, int64_t i, int64_t j) {
  return i < p.T && j < p.S && (!p.causal || p.k_offset + j <= p.q_offset + i);
}

// Rows [row0, row0 + 64) of one head of x [rows, heads, d] into dst [64][D + 1], zero-padded past
// the last row and past d.
template <int D>
__device__ __forceinline__ void load_tile(float* dst, const void* x, DType t, int64_t row0, int64_t rows,
                                          int64_t heads, int64_t head, int64_t d) {
  for (int idx = threadIdx.x; idx < 64 * D; idx += blockDim.x) {
    const int r = idx / D, c = idx % D;
    const int64_t row = row0 + r;
    dst[r * (D + 1) + c] = row < rows && c < d ? lcx::cuda::ld(x, t, (row * heads + head) * d + c) : 0.f;
  }
}

template <int D>
__device__ __forceinline__ float dot_rows(const float* a, const float* b) {
  float acc = 0.f;
#pragma unroll 16
  for (int k = 0; k < D; ++k) acc += a[k] * b[k];
  return acc;
}

// Raises a kernel's dynamic shared memory limit past 48 KB, once per instantiation.
template <typename Kernel>
void allow_smem(Kernel kernel, size_t bytes) {
  LCX_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
}

Params make_params(const Tensor& q, const Tensor& k, const AttentionParams& ap);

// The tensor-core kernels (attention_fwd_sm90.cu, attention_bwd_sm90.cu): false, launching
// nothing, where they do not apply (fp32 inputs, mixed dtypes, head_dim other than 64 or 128,
// rows not 16-byte aligned).
bool attention_forward_sm90(const Params& p);
// The Hopper forward (attention_fwd_sm90a.cu: TMA and wgmma): bf16 q, k, v and out, head_dim 128,
// 16-byte aligned, on a compute capability 9.0 device. `applies` says whether it would run.
bool attention_forward_hopper_applies(const Params& p);
bool attention_forward_hopper(const Params& p);
// The Hopper backward (attention_bwd_sm90a.cu), for bf16 everywhere, head_dim 128, on a compute
// capability 9.0 device: its fp32 dQ accumulator and per-step counters take
// attention_backward_hopper_scratch bytes, allocated by the caller; p.delta must be filled.
bool attention_backward_hopper_applies(const Params& p);
int64_t attention_backward_hopper_scratch(int64_t T, int64_t Hq);
void attention_backward_hopper(const Params& p, void* scratch);
bool attention_backward_sm90(const Params& p);

}  // namespace lcx::ops::cuda::attn
