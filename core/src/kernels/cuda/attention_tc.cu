// Attention forward and backward on tensor cores (WMMA, bf16/fp16 operands, fp32 accumulation),
// the fast path of the own kernels for 16-bit inputs with head_dim 64 or 128; the fp32 CUDA-core
// kernels (attention_fwd.cu, attention_bwd.cu) serve everything else and stay the exact second
// opinion. Same loop orders and masks as those kernels:
//  - forward: a block of 4 warps owns 64 query rows; per 64-key tile each warp computes its 16-row
//    strip of S = Q K^T into shared memory, runs the online softmax on those rows itself (two
//    lanes per row, m and l in registers), rescales its rows of the fp32 output accumulator in
//    shared memory and adds P V to them. Only K/V tile loads need block barriers.
//  - backward dq: per query block, S and dP = dO V^T per strip, dS = P (dP - delta) rounded to
//    the input dtype, dq += dS K in register fragments.
//  - backward dk/dv: per 64-key block, over the query heads of its GQA group and the query tiles
//    that can see it: P and dS for the tile, then dv += P^T dO and dk += dS^T q, each warp owning
//    16 key rows of both accumulators in registers. No atomics anywhere: deterministic.
// Tiles are 16-byte vector copies into padded shared rows (row stride D + 8 elements keeps WMMA's
// 32-byte alignment and spreads banks).
#include <mma.h>

#include <initializer_list>

#include "kernels/cuda/attention_common.cuh"

namespace lcx::ops::cuda::attn {
namespace {

using namespace nvcuda;

constexpr int kTcThreads = 128;  // 4 warps, 16 rows each

template <typename T>
__device__ __forceinline__ T to_t(float v);
template <>
__device__ __forceinline__ __nv_bfloat16 to_t<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ __half to_t<__half>(float v) {
  return __float2half_rn(v);
}

template <int D>
struct Tc {
  static constexpr int LDH = D + 8;    // 16-bit tile row stride
  static constexpr int LDS = kBc + 4;  // fp32 score row stride
  static constexpr int LDP = kBc + 8;  // 16-bit probability row stride
  static constexpr int LDO = D + 4;    // fp32 accumulator row stride
  static constexpr size_t tile = sizeof(uint16_t) * 64 * LDH;
  static constexpr size_t scores = sizeof(float) * 64 * LDS;
  static constexpr size_t probs = sizeof(uint16_t) * 64 * LDP;
  static constexpr size_t acc = sizeof(float) * 64 * LDO;
  static constexpr size_t fwd_smem = 3 * tile + scores + probs + acc;
  static constexpr size_t dq_smem = 4 * tile + 2 * scores + probs;
  static constexpr size_t dkv_smem = 4 * tile + 2 * scores + 2 * probs;
  static_assert(4 * tile >= acc, "the backward epilogue reuses the tiles as its fp32 staging");
};

// Rows [row0, row0 + 64) of one head of x [rows, heads, D] into dst (row stride ld), zero past
// the last row. x rows are 16-byte aligned (checked by the launcher).
template <int D, typename T>
__device__ __forceinline__ void load_tile_tc(T* dst, const void* x, int64_t row0, int64_t rows, int64_t heads,
                                             int64_t head, int ld) {
  constexpr int kVecs = D / 8;
  const T* src = static_cast<const T*>(x);
  for (int idx = threadIdx.x; idx < 64 * kVecs; idx += blockDim.x) {
    const int r = idx / kVecs, v = idx % kVecs;
    const int64_t row = row0 + r;
    uint4 val = make_uint4(0, 0, 0, 0);
    if (row < rows) val = *reinterpret_cast<const uint4*>(src + (row * heads + head) * D + v * 8);
    *reinterpret_cast<uint4*>(dst + r * ld + v * 8) = val;
  }
}

using FragAcc = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;
template <typename T>
using FragARow = wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major>;
template <typename T>
using FragACol = wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::col_major>;
template <typename T>
using FragBRow = wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major>;
template <typename T>
using FragBCol = wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major>;

// out[16 x 64] (fp32, row stride Tc::LDS) = a[16 x D] @ b[64 x D]^T for this warp's strip.
template <int D, typename T>
__device__ __forceinline__ void strip_abt(float* out, const T* a, const T* b) {
  FragAcc acc[kBc / 16];
#pragma unroll
  for (int n = 0; n < kBc / 16; ++n) wmma::fill_fragment(acc[n], 0.f);
#pragma unroll
  for (int kk = 0; kk < D; kk += 16) {
    FragARow<T> fa;
    wmma::load_matrix_sync(fa, a + kk, Tc<D>::LDH);
#pragma unroll
    for (int n = 0; n < kBc / 16; ++n) {
      FragBCol<T> fb;
      wmma::load_matrix_sync(fb, b + n * 16 * Tc<D>::LDH + kk, Tc<D>::LDH);
      wmma::mma_sync(acc[n], fa, fb, acc[n]);
    }
  }
#pragma unroll
  for (int n = 0; n < kBc / 16; ++n) wmma::store_matrix_sync(out + n * 16, acc[n], Tc<D>::LDS, wmma::mem_row_major);
}

template <int D, typename T>
__global__ void __launch_bounds__(kTcThreads) attn_fwd_tc_kernel(const Params p) {
  using L = Tc<D>;
  extern __shared__ __align__(128) unsigned char smem[];
  T* Qs = reinterpret_cast<T*>(smem);
  T* Ks = Qs + 64 * L::LDH;
  T* Vs = Ks + 64 * L::LDH;
  float* Ss = reinterpret_cast<float*>(Vs + 64 * L::LDH);
  T* Ps = reinterpret_cast<T*>(Ss + 64 * L::LDS);
  float* Os = reinterpret_cast<float*>(Ps + 64 * L::LDP);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int srow = warp * 16 + lane / 2, half = lane % 2;  // softmax: two lanes per row
  const int64_t q0 = int64_t(blockIdx.x) * kBr, qi = q0 + srow;
  const int64_t hq = blockIdx.y, hk = hq / (p.Hq / p.Hkv);

  load_tile_tc<D, T>(Qs, p.q, q0, p.T, p.Hq, hq, L::LDH);
  for (int i = threadIdx.x; i < 64 * L::LDO; i += blockDim.x) Os[i] = 0.f;
  float m = -INFINITY, l = 0.f;
  int64_t n_end = p.S;
  if (p.causal) {
    const int64_t last_q = q0 + lcx::cuda::lmin(kBr, p.T - q0) - 1;
    n_end = lcx::cuda::lmax(0, lcx::cuda::lmin(p.S, p.q_offset + last_q - p.k_offset + 1));
  }

  for (int64_t k0 = 0; k0 < n_end; k0 += kBc) {
    __syncthreads();
    load_tile_tc<D, T>(Ks, p.k, k0, p.S, p.Hkv, hk, L::LDH);
    load_tile_tc<D, T>(Vs, p.v, k0, p.S, p.Hkv, hk, L::LDH);
    __syncthreads();
    strip_abt<D, T>(Ss + warp * 16 * L::LDS, Qs + warp * 16 * L::LDH, Ks);
    __syncwarp();

    float s[32];
    float mx = -INFINITY;
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      const int c = half * 32 + j;
      s[j] = visible(p, qi, k0 + c) ? Ss[srow * L::LDS + c] * p.scale_log2 : -INFINITY;
      mx = fmaxf(mx, s[j]);
    }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    const float m_new = fmaxf(m, mx);
    const float alpha = m_new == -INFINITY ? 1.f : exp2f(m - m_new);
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      const float pr = m_new == -INFINITY ? 0.f : exp2f(s[j] - m_new);
      sum += pr;
      Ps[srow * L::LDP + half * 32 + j] = to_t<T>(pr);
    }
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    l = l * alpha + sum;
    m = m_new;
    for (int c = half * (D / 2); c < (half + 1) * (D / 2); ++c) Os[srow * L::LDO + c] *= alpha;
    __syncwarp();

    FragARow<T> fp[kBc / 16];
#pragma unroll
    for (int kk = 0; kk < kBc / 16; ++kk) wmma::load_matrix_sync(fp[kk], Ps + warp * 16 * L::LDP + kk * 16, L::LDP);
#pragma unroll
    for (int n = 0; n < D / 16; ++n) {
      FragAcc acc;
      float* o = Os + warp * 16 * L::LDO + n * 16;
      wmma::load_matrix_sync(acc, o, L::LDO, wmma::mem_row_major);
#pragma unroll
      for (int kk = 0; kk < kBc / 16; ++kk) {
        FragBRow<T> fv;
        wmma::load_matrix_sync(fv, Vs + kk * 16 * L::LDH + n * 16, L::LDH);
        wmma::mma_sync(acc, fp[kk], fv, acc);
      }
      wmma::store_matrix_sync(o, acc, L::LDO, wmma::mem_row_major);
    }
  }
  __syncwarp();
  if (qi >= p.T) return;
  const float inv = l > 0.f ? 1.f / l : 0.f;
  for (int c = half * (D / 2); c < (half + 1) * (D / 2); ++c)
    lcx::cuda::st(p.o, p.to, (qi * p.Hq + hq) * D + c, Os[srow * L::LDO + c] * inv);
  if (half == 0) p.lse_out[hq * p.T + qi] = l > 0.f ? (m + log2f(l)) * kLn2 : -INFINITY;
}

// P and dS for this lane's row (two lanes per row, 32 columns each) of a 64 x 64 tile, from S and
// dP in shared memory. Masked or empty rows give zeros.
template <int D, typename T>
__device__ __forceinline__ void probs_and_grads(const Params& p, const float* Ss, const float* dPs, T* Ps, T* dSs,
                                                int srow, int half, int64_t qi, int64_t k0, float lse2, float delta) {
  using L = Tc<D>;
#pragma unroll 8
  for (int j = 0; j < 32; ++j) {
    const int c = half * 32 + j;
    float pr = 0.f, ds = 0.f;
    if (lse2 != -INFINITY && visible(p, qi, k0 + c)) {
      pr = exp2f(Ss[srow * L::LDS + c] * p.scale_log2 - lse2);
      ds = pr * (dPs[srow * L::LDS + c] - delta);
    }
    if (Ps) Ps[srow * L::LDP + c] = to_t<T>(pr);
    dSs[srow * L::LDP + c] = to_t<T>(ds);
  }
}

template <int D, typename T>
__global__ void __launch_bounds__(kTcThreads) attn_bwd_dq_tc_kernel(const Params p) {
  using L = Tc<D>;
  extern __shared__ __align__(128) unsigned char smem[];
  T* Qs = reinterpret_cast<T*>(smem);
  T* dOs = Qs + 64 * L::LDH;
  T* Ks = dOs + 64 * L::LDH;
  T* Vs = Ks + 64 * L::LDH;
  float* Ss = reinterpret_cast<float*>(Vs + 64 * L::LDH);
  float* dPs = Ss + 64 * L::LDS;
  T* dSs = reinterpret_cast<T*>(dPs + 64 * L::LDS);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int srow = warp * 16 + lane / 2, half = lane % 2;
  const int64_t q0 = int64_t(blockIdx.x) * kBr, qi = q0 + srow;
  const int64_t hq = blockIdx.y, hk = hq / (p.Hq / p.Hkv);

  load_tile_tc<D, T>(Qs, p.q, q0, p.T, p.Hq, hq, L::LDH);
  load_tile_tc<D, T>(dOs, p.dout, q0, p.T, p.Hq, hq, L::LDH);
  const float lse2 = qi < p.T ? p.lse_in[hq * p.T + qi] * kLog2e : -INFINITY;
  const float delta = qi < p.T ? p.delta[hq * p.T + qi] : 0.f;
  int64_t n_end = p.S;
  if (p.causal) {
    const int64_t last_q = q0 + lcx::cuda::lmin(kBr, p.T - q0) - 1;
    n_end = lcx::cuda::lmax(0, lcx::cuda::lmin(p.S, p.q_offset + last_q - p.k_offset + 1));
  }

  FragAcc dq[D / 16];
#pragma unroll
  for (int n = 0; n < D / 16; ++n) wmma::fill_fragment(dq[n], 0.f);

  for (int64_t k0 = 0; k0 < n_end; k0 += kBc) {
    __syncthreads();
    load_tile_tc<D, T>(Ks, p.k, k0, p.S, p.Hkv, hk, L::LDH);
    load_tile_tc<D, T>(Vs, p.v, k0, p.S, p.Hkv, hk, L::LDH);
    __syncthreads();
    strip_abt<D, T>(Ss + warp * 16 * L::LDS, Qs + warp * 16 * L::LDH, Ks);
    strip_abt<D, T>(dPs + warp * 16 * L::LDS, dOs + warp * 16 * L::LDH, Vs);
    __syncwarp();
    probs_and_grads<D, T>(p, Ss, dPs, static_cast<T*>(nullptr), dSs, srow, half, qi, k0, lse2, delta);
    __syncwarp();
#pragma unroll
    for (int kk = 0; kk < kBc / 16; ++kk) {
      FragARow<T> fs;
      wmma::load_matrix_sync(fs, dSs + warp * 16 * L::LDP + kk * 16, L::LDP);
#pragma unroll
      for (int n = 0; n < D / 16; ++n) {
        FragBRow<T> fk;
        wmma::load_matrix_sync(fk, Ks + kk * 16 * L::LDH + n * 16, L::LDH);
        wmma::mma_sync(dq[n], fs, fk, dq[n]);
      }
    }
  }

  __syncthreads();  // the tiles become the fp32 staging of the result
  float* stage = reinterpret_cast<float*>(smem);
#pragma unroll
  for (int n = 0; n < D / 16; ++n)
    wmma::store_matrix_sync(stage + warp * 16 * L::LDO + n * 16, dq[n], L::LDO, wmma::mem_row_major);
  __syncwarp();
  if (qi >= p.T) return;
  for (int c = half * (D / 2); c < (half + 1) * (D / 2); ++c)
    lcx::cuda::st(p.o, p.tdq, (qi * p.Hq + hq) * D + c, stage[srow * L::LDO + c] * p.scale);
}

template <int D, typename T>
__global__ void __launch_bounds__(kTcThreads) attn_bwd_dkv_tc_kernel(const Params p) {
  using L = Tc<D>;
  extern __shared__ __align__(128) unsigned char smem[];
  T* Ks = reinterpret_cast<T*>(smem);
  T* Vs = Ks + 64 * L::LDH;
  T* Qs = Vs + 64 * L::LDH;
  T* dOs = Qs + 64 * L::LDH;
  float* Ss = reinterpret_cast<float*>(dOs + 64 * L::LDH);
  float* dPs = Ss + 64 * L::LDS;
  T* Ps = reinterpret_cast<T*>(dPs + 64 * L::LDS);
  T* dSs = Ps + 64 * L::LDP;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int srow = warp * 16 + lane / 2, half = lane % 2;  // a query row of the current tile
  const int64_t k0 = int64_t(blockIdx.x) * kBc;
  const int64_t hk = blockIdx.y, group = p.Hq / p.Hkv;

  load_tile_tc<D, T>(Ks, p.k, k0, p.S, p.Hkv, hk, L::LDH);
  load_tile_tc<D, T>(Vs, p.v, k0, p.S, p.Hkv, hk, L::LDH);
  int64_t q_begin = 0;
  if (p.causal) q_begin = lcx::cuda::lmax(0, p.k_offset + k0 - p.q_offset) / kBr * kBr;

  FragAcc dk[D / 16], dv[D / 16];
#pragma unroll
  for (int n = 0; n < D / 16; ++n) {
    wmma::fill_fragment(dk[n], 0.f);
    wmma::fill_fragment(dv[n], 0.f);
  }

  for (int64_t hq = hk * group; hq < (hk + 1) * group; ++hq) {
    for (int64_t q0 = q_begin; q0 < p.T; q0 += kBr) {
      __syncthreads();
      load_tile_tc<D, T>(Qs, p.q, q0, p.T, p.Hq, hq, L::LDH);
      load_tile_tc<D, T>(dOs, p.dout, q0, p.T, p.Hq, hq, L::LDH);
      __syncthreads();
      const int64_t qi = q0 + srow;
      const float lse2 = qi < p.T ? p.lse_in[hq * p.T + qi] * kLog2e : -INFINITY;
      const float delta = qi < p.T ? p.delta[hq * p.T + qi] : 0.f;
      strip_abt<D, T>(Ss + warp * 16 * L::LDS, Qs + warp * 16 * L::LDH, Ks);
      strip_abt<D, T>(dPs + warp * 16 * L::LDS, dOs + warp * 16 * L::LDH, Vs);
      __syncwarp();
      probs_and_grads<D, T>(p, Ss, dPs, Ps, dSs, srow, half, qi, k0, lse2, delta);
      __syncthreads();  // every query row's P and dS feed every warp's key rows
#pragma unroll
      for (int kk = 0; kk < kBr / 16; ++kk) {
        // P^T and dS^T strips for this warp's 16 keys: column-major views of the row-major tiles.
        FragACol<T> fpt, fst;
        wmma::load_matrix_sync(fpt, Ps + kk * 16 * L::LDP + warp * 16, L::LDP);
        wmma::load_matrix_sync(fst, dSs + kk * 16 * L::LDP + warp * 16, L::LDP);
#pragma unroll
        for (int n = 0; n < D / 16; ++n) {
          FragBRow<T> fdo, fq;
          wmma::load_matrix_sync(fdo, dOs + kk * 16 * L::LDH + n * 16, L::LDH);
          wmma::mma_sync(dv[n], fpt, fdo, dv[n]);
          wmma::load_matrix_sync(fq, Qs + kk * 16 * L::LDH + n * 16, L::LDH);
          wmma::mma_sync(dk[n], fst, fq, dk[n]);
        }
      }
    }
  }

  __syncthreads();  // the tiles become the fp32 staging of the result
  float* stage = reinterpret_cast<float*>(smem);
  const int krow = warp * 16 + lane / 2;
  const int64_t kj = k0 + krow;
  for (int pass = 0; pass < 2; ++pass) {
    FragAcc* src = pass == 0 ? dk : dv;
#pragma unroll
    for (int n = 0; n < D / 16; ++n)
      wmma::store_matrix_sync(stage + warp * 16 * L::LDO + n * 16, src[n], L::LDO, wmma::mem_row_major);
    __syncwarp();
    if (kj < p.S) {
      void* dst = pass == 0 ? p.dk : p.dv;
      const DType t = pass == 0 ? p.tdk : p.tdv;
      const float s = pass == 0 ? p.scale : 1.f;
      for (int c = half * (D / 2); c < (half + 1) * (D / 2); ++c)
        lcx::cuda::st(dst, t, (kj * p.Hkv + hk) * D + c, stage[krow * L::LDO + c] * s);
    }
    __syncwarp();
  }
}

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

template <int D, typename T>
void launch_fwd_tc(const Params& p) {
  auto kernel = attn_fwd_tc_kernel<D, T>;
  static const bool once = (allow_smem(kernel, Tc<D>::fwd_smem), true);
  (void)once;
  const dim3 grid(static_cast<unsigned>((p.T + kBr - 1) / kBr), static_cast<unsigned>(p.Hq));
  kernel<<<grid, kTcThreads, Tc<D>::fwd_smem, lcx::cuda::current_stream()>>>(p);
  LCX_CUDA_LAUNCH_CHECK();
}

template <int D, typename T>
void launch_bwd_tc(const Params& p) {
  cudaStream_t stream = lcx::cuda::current_stream();
  auto dq_kernel = attn_bwd_dq_tc_kernel<D, T>;
  auto dkv_kernel = attn_bwd_dkv_tc_kernel<D, T>;
  static const bool once =
      (allow_smem(dq_kernel, Tc<D>::dq_smem), allow_smem(dkv_kernel, Tc<D>::dkv_smem), true);
  (void)once;
  const dim3 dq_grid(static_cast<unsigned>((p.T + kBr - 1) / kBr), static_cast<unsigned>(p.Hq));
  dq_kernel<<<dq_grid, kTcThreads, Tc<D>::dq_smem, stream>>>(p);
  LCX_CUDA_LAUNCH_CHECK();
  if (p.S == 0) return;
  const dim3 dkv_grid(static_cast<unsigned>((p.S + kBc - 1) / kBc), static_cast<unsigned>(p.Hkv));
  dkv_kernel<<<dkv_grid, kTcThreads, Tc<D>::dkv_smem, stream>>>(p);
  LCX_CUDA_LAUNCH_CHECK();
}

template <typename T>
bool dispatch_d(const Params& p, bool backward) {
  if (p.d == 64)
    backward ? launch_bwd_tc<64, T>(p) : launch_fwd_tc<64, T>(p);
  else if (p.d == 128)
    backward ? launch_bwd_tc<128, T>(p) : launch_fwd_tc<128, T>(p);
  else
    return false;
  return true;
}

bool tc_eligible(const Params& p, std::initializer_list<const void*> ptrs) {
  if (p.tq != DType::bf16 && p.tq != DType::f16) return false;
  if (p.tk != p.tq || p.tv != p.tq) return false;
  for (const void* ptr : ptrs)
    if (!aligned16(ptr)) return false;
  return p.d == 64 || p.d == 128;
}

}  // namespace

bool attention_forward_tc(const Params& p) {
  if (!tc_eligible(p, {p.q, p.k, p.v})) return false;
  return p.tq == DType::bf16 ? dispatch_d<__nv_bfloat16>(p, false) : dispatch_d<__half>(p, false);
}

bool attention_backward_tc(const Params& p) {
  if (p.tdo != p.tq || !tc_eligible(p, {p.q, p.k, p.v, p.dout})) return false;
  return p.tq == DType::bf16 ? dispatch_d<__nv_bfloat16>(p, true) : dispatch_d<__half>(p, true);
}

}  // namespace lcx::ops::cuda::attn
