// Attention backward on the GPU, flash-attention style, as preprocess, main and no postprocess:
//  1. delta = rowsum(dout * out), fp32 [Hq, T] (one warp per row);
//  2. dq: one block per 64 query rows of one head walks the key tiles it can see, recomputes
//     P = exp(S - lse) from the saved log-sum-exp, dS = P * (dP - delta), dq += dS K;
//  3. dk, dv: one block per 64 key rows of one key/value head walks every query head of its GQA
//     group and the query tiles that can see its keys (causal: from the first at or after them; a
//     window: up to the last within it): dv += P^T dout, dk += dS^T q.
// Splitting dq from dk/dv recomputes S twice but needs no atomics: every output element has one
// owner, so the result is deterministic and GQA's sum over the group is a plain loop. Rows that
// saw no key (lse = -inf) get p = 0. Math is fp32 CUDA-core FMA from fp32 shared-memory tiles,
// like the forward kernel; every target from sm_80. Step 1 serves the tensor-core backward (mma/)
// too.
#include "kernels/attention/common.cuh"
#include "kernels/attention/smem.h"

namespace lcx::ops::cuda {
namespace attn {
namespace {

constexpr int kBwdTpr = 4;  // threads per tile row

__global__ void attn_bwd_delta_kernel(const Params p) {
  const int lane = threadIdx.x % 32;
  const int64_t rows = p.T * p.Hq;
  for (int64_t row = blockIdx.x * int64_t(blockDim.x / 32) + threadIdx.x / 32; row < rows;
       row += int64_t(gridDim.x) * (blockDim.x / 32)) {
    const int64_t i = row / p.Hq, hq = row % p.Hq;
    const int64_t o = row * p.d;  // q-layout [T, Hq, d]: row i * Hq + hq
    float acc = 0.f;
    for (int64_t c = lane; c < p.d; c += 32) acc += lcx::cuda::ld(p.dout, p.tdo, o + c) * lcx::cuda::ld(p.out, p.to, o + c);
    acc = lcx::cuda::warp_sum(acc);
    if (lane == 0) p.delta[hq * p.T + i] = acc;
  }
}

template <int D>
constexpr size_t dq_smem_bytes() {
  return sizeof(float) * (static_cast<size_t>(2 * kBr + 2 * kBc) * (D + 1) + kBr * (kBc + 1));
}

template <int D, int TPR>
__global__ void __launch_bounds__(kBr* TPR) attn_bwd_dq_kernel(const Params p) {
  extern __shared__ float smem[];
  constexpr int LD = D + 1, PLD = kBc + 1;
  float* Qs = smem;
  float* dOs = Qs + kBr * LD;
  float* Ks = dOs + kBr * LD;
  float* Vs = Ks + kBc * LD;
  float* dSs = Vs + kBc * LD;
  const int r = threadIdx.x / TPR, h = threadIdx.x % TPR;
  const int64_t q0 = int64_t(blockIdx.x) * kBr, qi = q0 + r;
  const int64_t hq = blockIdx.y, hk = hq / (p.Hq / p.Hkv);

  load_tile<D>(Qs, p.q, p.tq, q0, p.T, p.Hq, hq, p.d);
  load_tile<D>(dOs, p.dout, p.tdo, q0, p.T, p.Hq, hq, p.d);
  const float lse2 = qi < p.T ? p.lse_in[hq * p.T + qi] * kLog2e : -INFINITY;
  const float delta = qi < p.T ? p.delta[hq * p.T + qi] : 0.f;
  const int64_t n_end = key_end(p, q0, kBr);

  float dq[D / TPR];
#pragma unroll
  for (int c = 0; c < D / TPR; ++c) dq[c] = 0.f;

  for (int64_t k0 = first_key(p, q0, kBc); k0 < n_end; k0 += kBc) {
    __syncthreads();
    load_tile<D>(Ks, p.k, p.tk, k0, p.S, p.Hkv, hk, p.d);
    load_tile<D>(Vs, p.v, p.tv, k0, p.S, p.Hkv, hk, p.d);
    __syncthreads();
#pragma unroll 4
    for (int jj = 0; jj < kBc / TPR; ++jj) {
      const int j = h + TPR * jj;
      float ds = 0.f;
      if (lse2 != -INFINITY && visible(p, qi, k0 + j)) {
        const float pr = exp2f(dot_rows<D>(Qs + r * LD, Ks + j * LD) * p.scale_log2 - lse2);
        ds = pr * (dot_rows<D>(dOs + r * LD, Vs + j * LD) - delta);
      }
      dSs[r * PLD + j] = ds;
    }
    __syncthreads();
    for (int j = 0; j < kBc; ++j) {
      const float ds = dSs[r * PLD + j];
#pragma unroll
      for (int c = 0; c < D / TPR; ++c) dq[c] += ds * Ks[j * LD + h + TPR * c];
    }
  }

  if (qi >= p.T) return;
#pragma unroll
  for (int c = 0; c < D / TPR; ++c) {
    const int col = h + TPR * c;
    if (col < p.d) lcx::cuda::st(p.o, p.tdq, (qi * p.Hq + hq) * p.d + col, dq[c] * p.scale);
  }
}

template <int D>
constexpr size_t dkv_smem_bytes() {
  return sizeof(float) * (static_cast<size_t>(2 * kBc + 2 * kBr) * (D + 1) + 2 * kBc * (kBr + 1) + 2 * kBr);
}

template <int D, int TPR>
__global__ void __launch_bounds__(kBc* TPR) attn_bwd_dkv_kernel(const Params p) {
  extern __shared__ float smem[];
  constexpr int LD = D + 1, PLD = kBr + 1;
  float* Ks = smem;
  float* Vs = Ks + kBc * LD;
  float* Qs = Vs + kBc * LD;
  float* dOs = Qs + kBr * LD;
  float* Ps = dOs + kBr * LD;
  float* dSs = Ps + kBc * PLD;
  float* lse2s = dSs + kBc * PLD;
  float* deltas = lse2s + kBr;
  const int r = threadIdx.x / TPR, h = threadIdx.x % TPR;
  const int64_t k0 = int64_t(blockIdx.x) * kBc, kj = k0 + r;
  const int64_t hk = blockIdx.y, group = p.Hq / p.Hkv;

  load_tile<D>(Ks, p.k, p.tk, k0, p.S, p.Hkv, hk, p.d);
  load_tile<D>(Vs, p.v, p.tv, k0, p.S, p.Hkv, hk, p.d);
  // The first query tile holding a row that can see this block's first key.
  const int64_t q_begin = first_query(p, k0, kBr), q_stop = query_end(p, k0, kBc);

  float dk[D / TPR], dv[D / TPR];
#pragma unroll
  for (int c = 0; c < D / TPR; ++c) dk[c] = dv[c] = 0.f;

  for (int64_t hq = hk * group; hq < (hk + 1) * group; ++hq) {
    for (int64_t q0 = q_begin; q0 < q_stop; q0 += kBr) {
      __syncthreads();
      load_tile<D>(Qs, p.q, p.tq, q0, p.T, p.Hq, hq, p.d);
      load_tile<D>(dOs, p.dout, p.tdo, q0, p.T, p.Hq, hq, p.d);
      for (int i = threadIdx.x; i < kBr; i += blockDim.x) {
        const bool in = q0 + i < p.T;
        lse2s[i] = in ? p.lse_in[hq * p.T + q0 + i] * kLog2e : -INFINITY;
        deltas[i] = in ? p.delta[hq * p.T + q0 + i] : 0.f;
      }
      __syncthreads();
#pragma unroll 4
      for (int ii = 0; ii < kBr / TPR; ++ii) {
        const int i = h + TPR * ii;
        float pr = 0.f, ds = 0.f;
        if (lse2s[i] != -INFINITY && visible(p, q0 + i, kj)) {
          pr = exp2f(dot_rows<D>(Ks + r * LD, Qs + i * LD) * p.scale_log2 - lse2s[i]);
          ds = pr * (dot_rows<D>(Vs + r * LD, dOs + i * LD) - deltas[i]);
        }
        Ps[r * PLD + i] = pr;
        dSs[r * PLD + i] = ds;
      }
      __syncthreads();
      for (int i = 0; i < kBr; ++i) {
        const float pr = Ps[r * PLD + i], ds = dSs[r * PLD + i];
#pragma unroll
        for (int c = 0; c < D / TPR; ++c) {
          dv[c] += pr * dOs[i * LD + h + TPR * c];
          dk[c] += ds * Qs[i * LD + h + TPR * c];
        }
      }
    }
  }

  if (kj >= p.S) return;
#pragma unroll
  for (int c = 0; c < D / TPR; ++c) {
    const int col = h + TPR * c;
    if (col < p.d) {
      lcx::cuda::st(p.dk, p.tdk, (kj * p.Hkv + hk) * p.d + col, dk[c] * p.scale);
      lcx::cuda::st(p.dv, p.tdv, (kj * p.Hkv + hk) * p.d + col, dv[c]);
    }
  }
}

template <int D>
void launch_bwd(const Params& p) {
  cudaStream_t stream = lcx::cuda::current_stream();
  auto dq_kernel = attn_bwd_dq_kernel<D, kBwdTpr>;
  auto dkv_kernel = attn_bwd_dkv_kernel<D, kBwdTpr>;
  constexpr size_t dq_smem = dq_smem_bytes<D>(), dkv_smem = dkv_smem_bytes<D>();
  static const bool once = (allow_smem(dq_kernel, dq_smem), allow_smem(dkv_kernel, dkv_smem), true);
  (void)once;
  const dim3 dq_grid(static_cast<unsigned>((p.T + kBr - 1) / kBr), static_cast<unsigned>(p.Hq));
  dq_kernel<<<dq_grid, kBr * kBwdTpr, dq_smem, stream>>>(p);
  LCX_CUDA_LAUNCH_CHECK();
  if (p.S == 0) return;
  const dim3 dkv_grid(static_cast<unsigned>((p.S + kBc - 1) / kBc), static_cast<unsigned>(p.Hkv));
  dkv_kernel<<<dkv_grid, kBc * kBwdTpr, dkv_smem, stream>>>(p);
  LCX_CUDA_LAUNCH_CHECK();
}

static_assert(int64_t(dq_smem_bytes<128>()) == attention::smem::reference_backward_dq(128) &&
                  int64_t(dkv_smem_bytes<128>()) == attention::smem::reference_backward_dkv(128) &&
                  int64_t(dq_smem_bytes<32>()) == attention::smem::reference_backward_dq(32) &&
                  int64_t(dkv_smem_bytes<32>()) == attention::smem::reference_backward_dkv(32),
              "smem.h states the kernels' shared memory");

}  // namespace

void backward_delta(const Params& p) {
  attn_bwd_delta_kernel<<<lcx::cuda::grid_for(p.T * p.Hq, 8, 65535LL * 8), 256, 0, lcx::cuda::current_stream()>>>(p);
  LCX_CUDA_LAUNCH_CHECK();
}

void reference_backward(const Params& p) {
  LCX_CHECK(p.d <= 128, "the fp32 backward takes head_dim up to 128");
  if (p.d <= 32)
    launch_bwd<32>(p);
  else if (p.d <= 64)
    launch_bwd<64>(p);
  else
    launch_bwd<128>(p);
}

}  // namespace attn
}  // namespace lcx::ops::cuda
