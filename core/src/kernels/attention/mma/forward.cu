// Attention forward on tensor cores (WMMA, bf16/fp16 operands, fp32 accumulation), built for every
// target from sm_80: lcx's own forward for 16-bit inputs with head_dim 64, 128 or 256 wherever the
// Hopper kernel (hopper/) does not run; the fp32 CUDA-core kernel (reference/) serves everything
// else up to 128 and stays the exact second opinion. At head_dim 128 a block needs 110 KB of shared
// memory (smem.h), which sm_86, sm_89 and sm_120 do not give, and at 256 190 KB, which only sm_90
// and sm_100 give: the dispatch refuses the others.
// Same loop order and masks as that kernel: a block of 4 warps owns 64 query rows; per 64-key tile
// each warp computes its 16-row strip of S = Q K^T into shared memory, runs the online softmax on
// those rows itself (two lanes per row, m and l in registers), rescales its rows of the fp32 output
// accumulator in shared memory and adds P V to them. Only K/V tile loads need block barriers.
#include "kernels/attention/mma/mma.cuh"

namespace lcx::ops::cuda::attn {
namespace {

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
  const int64_t n_end = key_end(p, q0, kBr);

  for (int64_t k0 = first_key(p, q0, kBc); k0 < n_end; k0 += kBc) {
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

template <int D, typename T>
void launch_fwd_tc(const Params& p) {
  auto kernel = attn_fwd_tc_kernel<D, T>;
  static const bool once = (allow_smem(kernel, Tc<D>::fwd_smem), true);
  (void)once;
  const dim3 grid(static_cast<unsigned>((p.T + kBr - 1) / kBr), static_cast<unsigned>(p.Hq));
  kernel<<<grid, kTcThreads, Tc<D>::fwd_smem, lcx::cuda::current_stream()>>>(p);
  LCX_CUDA_LAUNCH_CHECK();
}

static_assert(int64_t(Tc<64>::fwd_smem) == attention::smem::mma_forward(64) &&
                  int64_t(Tc<128>::fwd_smem) == attention::smem::mma_forward(128) &&
                  int64_t(Tc<256>::fwd_smem) == attention::smem::mma_forward(256),
              "smem.h states the kernels' shared memory");

}  // namespace

void mma_forward(const Params& p) {
  LCX_CHECK((p.tq == DType::bf16 || p.tq == DType::f16) && (p.d == 64 || p.d == 128 || p.d == 256),
            "the tensor-core forward takes bf16 or fp16 at head_dim 64, 128 or 256");
  if (p.tq == DType::bf16) {
    if (p.d == 64) return launch_fwd_tc<64, __nv_bfloat16>(p);
    if (p.d == 128) return launch_fwd_tc<128, __nv_bfloat16>(p);
    return launch_fwd_tc<256, __nv_bfloat16>(p);
  }
  if (p.d == 64) return launch_fwd_tc<64, __half>(p);
  if (p.d == 128) return launch_fwd_tc<128, __half>(p);
  launch_fwd_tc<256, __half>(p);
}

}  // namespace lcx::ops::cuda::attn
