// Attention forward on the GPU, flash-attention style (FA2's loop order): one block per 64 query
// rows of one head walks the key/value tiles its rows can see, keeping a running max and sum per
// row (online softmax in the exp2 domain), so no T x S matrix exists anywhere. K/V tiles come from
// the query head's key/value head (GQA: head hq reads kv head hq / (Hq / Hkv)). Causal runs stop
// at the last tile a row of the block can see, and a sliding window's start at the first (the tile
// bounds of common.cuh), with positions offset by q_offset / k_offset so a ring-attention block can
// be full, causal or half. Two threads share a query row: each scores
// half of the tile's keys and accumulates half of the output columns. Math is fp32 CUDA-core FMA
// from fp32 tiles in shared memory: exact against the CPU to fp32 rounding, any float dtype, every
// target from sm_80; the fallback and the second opinion beside the tensor-core kernels (mma/),
// the Hopper kernels (hopper/) and cuDNN's (cudnn/). At head_dim 128 a block needs 113 KB of
// shared memory (smem.h), more than sm_86, sm_89 and sm_120 give.
#include "kernels/attention/common.cuh"
#include "kernels/attention/smem.h"

namespace lcx::ops::cuda {
namespace attn {

namespace {

constexpr int kFwdTpr = 2;  // threads per query row

template <int D>
constexpr size_t fwd_smem_bytes() {
  return sizeof(float) * (static_cast<size_t>(kBr + 2 * kBc) * (D + 1) + kBr * (kBc + 1));
}
static_assert(int64_t(fwd_smem_bytes<32>()) == attention::smem::reference_forward(32) &&
                  int64_t(fwd_smem_bytes<64>()) == attention::smem::reference_forward(64) &&
                  int64_t(fwd_smem_bytes<128>()) == attention::smem::reference_forward(128),
              "smem.h states the kernel's shared memory");

template <int D, int TPR>
__global__ void __launch_bounds__(kBr* TPR) attn_fwd_kernel(const Params p) {
  extern __shared__ float smem[];
  constexpr int LD = D + 1, PLD = kBc + 1;
  float* Qs = smem;
  float* Ks = Qs + kBr * LD;
  float* Vs = Ks + kBc * LD;
  float* Ps = Vs + kBc * LD;
  const int r = threadIdx.x / TPR, h = threadIdx.x % TPR;
  const int64_t q0 = int64_t(blockIdx.x) * kBr, qi = q0 + r;
  const int64_t hq = blockIdx.y, hk = hq / (p.Hq / p.Hkv);

  load_tile<D>(Qs, p.q, p.tq, q0, p.T, p.Hq, hq, p.d);
  const int64_t n_end = key_end(p, q0, kBr);

  float m = -INFINITY, l = 0.f;
  float o[D / TPR];
#pragma unroll
  for (int c = 0; c < D / TPR; ++c) o[c] = 0.f;

  for (int64_t k0 = first_key(p, q0, kBc); k0 < n_end; k0 += kBc) {
    __syncthreads();  // the previous tile's K, V and P are no longer read
    load_tile<D>(Ks, p.k, p.tk, k0, p.S, p.Hkv, hk, p.d);
    load_tile<D>(Vs, p.v, p.tv, k0, p.S, p.Hkv, hk, p.d);
    __syncthreads();

    float s[kBc / TPR];
    float mx = -INFINITY;
#pragma unroll
    for (int jj = 0; jj < kBc / TPR; ++jj) {
      const int j = h + TPR * jj;
      const float dot = dot_rows<D>(Qs + r * LD, Ks + j * LD);
      s[jj] = visible(p, qi, k0 + j) ? dot * p.scale_log2 : -INFINITY;
      mx = fmaxf(mx, s[jj]);
    }
#pragma unroll
    for (int off = 1; off < TPR; off <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    const float m_new = fmaxf(m, mx);
    float alpha = 1.f, sum = 0.f;
    if (m_new != -INFINITY) {  // else the row has seen nothing yet: p = 0, state unchanged
      alpha = exp2f(m - m_new);
#pragma unroll
      for (int jj = 0; jj < kBc / TPR; ++jj) {
        s[jj] = exp2f(s[jj] - m_new);
        sum += s[jj];
      }
    } else {
#pragma unroll
      for (int jj = 0; jj < kBc / TPR; ++jj) s[jj] = 0.f;
    }
#pragma unroll
    for (int off = 1; off < TPR; off <<= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
    l = l * alpha + sum;
    m = m_new;
#pragma unroll
    for (int c = 0; c < D / TPR; ++c) o[c] *= alpha;
#pragma unroll
    for (int jj = 0; jj < kBc / TPR; ++jj) Ps[r * PLD + h + TPR * jj] = s[jj];
    __syncthreads();
    for (int j = 0; j < kBc; ++j) {
      const float pj = Ps[r * PLD + j];
#pragma unroll
      for (int c = 0; c < D / TPR; ++c) o[c] += pj * Vs[j * LD + h + TPR * c];
    }
  }

  if (qi >= p.T) return;
  const float inv = l > 0.f ? 1.f / l : 0.f;
#pragma unroll
  for (int c = 0; c < D / TPR; ++c) {
    const int col = h + TPR * c;
    if (col < p.d) lcx::cuda::st(p.o, p.to, (qi * p.Hq + hq) * p.d + col, o[c] * inv);
  }
  if (h == 0) p.lse_out[hq * p.T + qi] = l > 0.f ? (m + log2f(l)) * kLn2 : -INFINITY;
}

template <int D>
void launch_fwd(const Params& p) {
  auto kernel = attn_fwd_kernel<D, kFwdTpr>;
  constexpr size_t smem = fwd_smem_bytes<D>();
  static const bool once = (allow_smem(kernel, smem), true);
  (void)once;
  const dim3 grid(static_cast<unsigned>((p.T + kBr - 1) / kBr), static_cast<unsigned>(p.Hq));
  kernel<<<grid, kBr * kFwdTpr, smem, lcx::cuda::current_stream()>>>(p);
  LCX_CUDA_LAUNCH_CHECK();
}

}  // namespace

void reference_forward(const Params& p) {
  LCX_CHECK(p.d <= 128, "the fp32 forward takes head_dim up to 128");
  if (p.d <= 32)
    launch_fwd<32>(p);
  else if (p.d <= 64)
    launch_fwd<64>(p);
  else
    launch_fwd<128>(p);
}

}  // namespace attn
}  // namespace lcx::ops::cuda
