// Attention backward on tensor cores (WMMA, bf16/fp16 operands, fp32 accumulation), built for every
// target from sm_80: lcx's own backward for 16-bit inputs with head_dim 64, 128 or 256 wherever the
// Hopper kernel (hopper/) does not run; the fp32 CUDA-core kernels (reference/) serve everything
// else up to 128 and stay the exact second opinion. At head_dim 128 a block needs 120 KB of shared
// memory (smem.h), which sm_86, sm_89 and sm_120 do not give, and at 256 184 KB, which only sm_90
// and sm_100 give: the dispatch refuses the others. At 256 the dk/dv kernel's two accumulators
// (256 floats a thread) spill to local memory: a fallback where cuDNN does not serve, not a fast path.
// Same loop orders and masks as those kernels, after the same preprocess (delta = rowsum(dO * O)):
//  - dq: per query block, S and dP = dO V^T per strip, dS = P (dP - delta) rounded to the input
//    dtype, dq += dS K in register fragments.
//  - dk/dv: per 64-key block, over the query heads of its GQA group and the query tiles that can
//    see it: P and dS for the tile, then dv += P^T dO and dk += dS^T q, each warp owning 16 key
//    rows of both accumulators in registers. No atomics anywhere: deterministic.
#include "kernels/attention/mma/mma.cuh"

namespace lcx::ops::cuda::attn {
namespace {

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
  const int64_t n_end = key_end(p, q0, kBr);

  FragAcc dq[D / 16];
#pragma unroll
  for (int n = 0; n < D / 16; ++n) wmma::fill_fragment(dq[n], 0.f);

  for (int64_t k0 = first_key(p, q0, kBc); k0 < n_end; k0 += kBc) {
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
  const int64_t q_begin = first_query(p, k0, kBr), q_stop = query_end(p, k0, kBc);

  FragAcc dk[D / 16], dv[D / 16];
#pragma unroll
  for (int n = 0; n < D / 16; ++n) {
    wmma::fill_fragment(dk[n], 0.f);
    wmma::fill_fragment(dv[n], 0.f);
  }

  for (int64_t hq = hk * group; hq < (hk + 1) * group; ++hq) {
    for (int64_t q0 = q_begin; q0 < q_stop; q0 += kBr) {
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

static_assert(int64_t(Tc<64>::dq_smem) == attention::smem::mma_backward_dq(64) &&
                  int64_t(Tc<128>::dq_smem) == attention::smem::mma_backward_dq(128) &&
                  int64_t(Tc<256>::dq_smem) == attention::smem::mma_backward_dq(256) &&
                  int64_t(Tc<64>::dkv_smem) == attention::smem::mma_backward_dkv(64) &&
                  int64_t(Tc<128>::dkv_smem) == attention::smem::mma_backward_dkv(128) &&
                  int64_t(Tc<256>::dkv_smem) == attention::smem::mma_backward_dkv(256),
              "smem.h states the kernels' shared memory");

}  // namespace

void mma_backward(const Params& p) {
  LCX_CHECK((p.tq == DType::bf16 || p.tq == DType::f16) && (p.d == 64 || p.d == 128 || p.d == 256),
            "the tensor-core backward takes bf16 or fp16 at head_dim 64, 128 or 256");
  if (p.tq == DType::bf16) {
    if (p.d == 64) return launch_bwd_tc<64, __nv_bfloat16>(p);
    if (p.d == 128) return launch_bwd_tc<128, __nv_bfloat16>(p);
    return launch_bwd_tc<256, __nv_bfloat16>(p);
  }
  if (p.d == 64) return launch_bwd_tc<64, __half>(p);
  if (p.d == 128) return launch_bwd_tc<128, __half>(p);
  launch_bwd_tc<256, __half>(p);
}

}  // namespace lcx::ops::cuda::attn
