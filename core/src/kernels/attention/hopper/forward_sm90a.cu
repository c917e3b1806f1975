// Attention forward for Hopper (sm_90a): bf16 q, k, v, head_dim 128, fp32 accumulation, GQA
// without copying K/V, causal or full with the ring's position offsets, a sliding window (the key
// tiles outside it skipped, the partial ones masked), the log-sum-exp out. The
// same contract as the other forward kernels (params.h), built for the H100 and H200's
// tensor-core path that WMMA cannot reach:
// - TMA (cp.async.bulk.tensor) brings Q once and K/V tiles of 128 rows into shared memory in the
//   128-byte swizzled layout wgmma reads without bank conflicts, issued by one thread of a
//   producer warpgroup that gives its registers to the others (setmaxnreg).
// - Two consumer warpgroups own 64 query rows each (a block: 128 rows of one query head) and run
//   S = Q K^T and O += P V as asynchronous warpgroup GEMMs (wgmma), P straight from registers.
// - Inside a warpgroup, the next tile's S = Q K^T is issued before this tile's softmax, so the
//   exponentials run under a GEMM (a two-stage pipeline within the warpgroup); across the two,
//   the warpgroups take turns at issuing their GEMMs (ping-pong), so one's softmax runs while the
//   other's GEMMs hold the tensor cores.
// - K and V have their own full/empty barriers, two stages each: the producer refills a stage as
//   soon as both consumers have read it.
// Blocks are ordered longest first (causal), and the query heads sharing a key/value head run side
// by side so their K/V tiles are read once from HBM and then from L2.
// The hopper/ files alone are compiled for sm_90a (wgmma and setmaxnreg exist only there), whatever
// LCX_CUDA_ARCHS builds the rest for; the dispatch (dispatch.h) reaches them only on a compute
// capability 9.0 device, and the tensor-core kernels (mma/) serve the others.

#include "kernels/attention/hopper/hopper.cuh"

namespace lcx::ops::cuda::attn {
namespace {

using namespace hopper;

constexpr int kWgM = 64;          // query rows per consumer warpgroup
constexpr int kBlockM = 2 * kWgM;  // query rows per block
constexpr int kBlockN = 128;       // key rows per tile
constexpr int kHd = 128;           // head_dim
constexpr int kStages = 2;
constexpr int kThreads = 384;          // producer warpgroup + two consumer warpgroups
constexpr int kHalf = kBlockN * 64;    // elements of one 64-column half of a 128-row tile (16 KB)
constexpr uint32_t kTileBytes = 2 * kHalf * 2;  // a 128 x 128 bf16 tile: 32 KB

// Shared memory, 1024-byte aligned (the swizzle repeats every 8 rows of 128 bytes). Each tile is
// two 64-column halves, each [128 rows][64 columns] swizzled, as TMA writes a box of 128 bytes.
struct alignas(1024) Smem {
  __nv_bfloat16 q[2][kHalf];
  __nv_bfloat16 k[kStages][2][kHalf];
  __nv_bfloat16 v[kStages][2][kHalf];
  uint64_t q_full;
  uint64_t k_full[kStages], k_empty[kStages];
  uint64_t v_full[kStages], v_empty[kStages];
};
constexpr size_t kSmemBytes = sizeof(Smem) + 1024;  // room to align the dynamic base

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// S = Q K^T for one warpgroup's 64 rows: 8 steps of 16 columns over head_dim 128. Both operands are
// K-major (head_dim contiguous); a step inside a 128-byte swizzled row advances the start address
// by 32 bytes, the second 64 columns are the next half (16 KB on). Stride: 8 rows of 128 bytes.
__device__ __forceinline__ void issue_qk(float (&s)[64], uint32_t q_base, uint32_t k_base) {
#pragma unroll
  for (int kk = 0; kk < kHd / 16; ++kk) {
    const uint32_t off = (kk / 4) * (kHalf * 2) + (kk % 4) * 32;
    wgmma_ss(s, sw128_desc(q_base + off, 16, 1024), sw128_desc(k_base + off, 16, 1024), kk > 0);
  }
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

// One block: 128 query rows of one query head. Thread t of a consumer warpgroup holds rows
// 16 (t / 32) + (t % 32) / 4 and 8 below it; accumulator element i of a row pair sits in column
// 8 (i / 4) + 2 (t % 4) + i % 2 of row (i / 2) % 2.
__global__ void __launch_bounds__(kThreads, 1)
    attn_fwd_hopper_kernel(const __grid_constant__ CUtensorMap q_map, const __grid_constant__ CUtensorMap k_map,
                           const __grid_constant__ CUtensorMap v_map, const Params p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ unsigned char smem_raw[];
  Smem& sm = *reinterpret_cast<Smem*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  const int wg = threadIdx.x / 128;
  const int64_t blocks_m = (p.T + kBlockM - 1) / kBlockM;
  const int64_t hq = blockIdx.x % p.Hq;
  int64_t mb = blockIdx.x / p.Hq;
  if (p.causal) mb = blocks_m - 1 - mb;  // the blocks with the most tiles first
  const int64_t q0 = mb * kBlockM;
  const int64_t hk = hq / (p.Hq / p.Hkv);
  // Key tiles t0 .. t0 + n_tiles - 1: from the first a window lets the block's first row see to
  // the last causal's lets its last row see.
  const int64_t t0 = first_key(p, q0, kBlockN) / kBlockN;
  const int n_tiles = static_cast<int>(lcx::cuda::lmax(0, (key_end(p, q0, kBlockM) + kBlockN - 1) / kBlockN - t0));

  if (threadIdx.x == 0) {
    bar_init(&sm.q_full, 1);
    for (int s = 0; s < kStages; ++s) {
      bar_init(&sm.k_full[s], 1);
      bar_init(&sm.v_full[s], 1);
      bar_init(&sm.k_empty[s], 8);  // one arrival per consumer warp
      bar_init(&sm.v_empty[s], 8);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  }
  __syncthreads();

  if (wg == 0) {  // producer
    asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n" ::: "memory");
    if (threadIdx.x == 0) {
      asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(&k_map)) : "memory");
      asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(&v_map)) : "memory");
      bar_expect(&sm.q_full, kTileBytes);
      tma_load(sm.q[0], &q_map, &sm.q_full, 0, static_cast<int>(hq), static_cast<int>(q0));
      tma_load(sm.q[1], &q_map, &sm.q_full, 64, static_cast<int>(hq), static_cast<int>(q0));
      for (int j = 0; j < n_tiles; ++j) {
        const int s = j % kStages;
        const uint32_t phase = (j / kStages) & 1;
        const int row = static_cast<int>((t0 + j) * kBlockN);
        bar_wait(&sm.k_empty[s], phase ^ 1);
        bar_expect(&sm.k_full[s], kTileBytes);
        tma_load(sm.k[s][0], &k_map, &sm.k_full[s], 0, static_cast<int>(hk), row);
        tma_load(sm.k[s][1], &k_map, &sm.k_full[s], 64, static_cast<int>(hk), row);
        bar_wait(&sm.v_empty[s], phase ^ 1);
        bar_expect(&sm.v_full[s], kTileBytes);
        tma_load(sm.v[s][0], &v_map, &sm.v_full[s], 0, static_cast<int>(hk), row);
        tma_load(sm.v[s][1], &v_map, &sm.v_full[s], 64, static_cast<int>(hk), row);
      }
    }
    return;
  }

  // consumers
  asm volatile("setmaxnreg.inc.sync.aligned.u32 240;\n" ::: "memory");
  const int tid = threadIdx.x - 128 * wg, warp = tid / 32, lane = tid % 32;
  const int64_t wg_row0 = q0 + (wg - 1) * kWgM;
  const int64_t row0 = wg_row0 + warp * 16 + lane / 4;  // and row0 + 8
  const int col0 = 2 * (lane % 4);
  const uint32_t q_base = smem_addr(sm.q[0]) + (wg - 1) * kWgM * 128;
  const float sl2 = p.scale_log2;

  float o[64], s[64];
  uint32_t pr[32];
#pragma unroll
  for (int i = 0; i < 64; ++i) o[i] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f}, alpha[2];

  // One tile's scores in s become probabilities in place (masked, max-shifted, exp2), each row's
  // running max, sum and the factor alpha that rescales what was accumulated before.
  auto softmax = [&](int j) {
    const int64_t k0 = (t0 + j) * kBlockN;
    const bool unmasked = k0 + kBlockN <= p.S &&
                          (!p.causal || p.k_offset + k0 + kBlockN - 1 <= p.q_offset + wg_row0) &&
                          (p.window <= 0 || p.k_offset + k0 > p.q_offset + wg_row0 + kWgM - 1 - p.window);
    if (!unmasked) {
#pragma unroll
      for (int i = 0; i < 64; ++i) {
        const int64_t qi = row0 + ((i >> 1) & 1) * 8;
        const int64_t kj = k0 + 8 * (i / 4) + col0 + (i & 1);
        if (!(kj < p.S && (!p.causal || p.k_offset + kj <= p.q_offset + qi) &&
              (p.window <= 0 || p.k_offset + kj > p.q_offset + qi - p.window)))
          s[i] = -INFINITY;
      }
    }
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int i = 0; i < 64; ++i) mx[(i >> 1) & 1] = fmaxf(mx[(i >> 1) & 1], s[i]);
    float base[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
      const float m_new = fmaxf(m[r], mx[r] * sl2);
      base[r] = m_new == -INFINITY ? 0.f : m_new;  // a row that has seen nothing stays at 0
      alpha[r] = fast_exp2(m[r] - base[r]);
      m[r] = m_new;
    }
    float sum[2] = {0.f, 0.f};
#pragma unroll
    for (int i = 0; i < 64; ++i) {
      s[i] = fast_exp2(fmaf(s[i], sl2, -base[(i >> 1) & 1]));
      sum[(i >> 1) & 1] += s[i];
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) l[r] = l[r] * alpha[r] + sum[r];
  };
  auto pack = [&] {
#pragma unroll
    for (int i = 0; i < 32; ++i) pr[i] = pack_bf16(s[2 * i], s[2 * i + 1]);
  };
  auto release = [&](uint64_t* bar) {
    if (lane == 0) bar_arrive(bar);
  };

  // Ping-pong: the two warpgroups take turns to issue their GEMMs, named barrier 1 for the first
  // one's turn and 2 for the second's, so one's softmax runs while the other's GEMMs hold the
  // tensor cores (+1-4% over free issue, docs/PERF.md). The second warpgroup lets the first go
  // first, and skips its last pass so every turn taken has been given exactly once.
  const uint32_t my_turn = wg, their_turn = 3 - wg;
  auto take_turn = [&] {
    asm volatile("bar.sync %0, 256;" ::"r"(my_turn) : "memory");
  };
  auto pass_turn = [&] {
    asm volatile("bar.arrive %0, 256;" ::"r"(their_turn) : "memory");
  };
  if (n_tiles > 0) {
    if (wg == 2) pass_turn();
    bar_wait(&sm.q_full, 0);
    bar_wait(&sm.k_full[0], 0);
    take_turn();
    wgmma_fence();
    issue_qk(s, q_base, smem_addr(sm.k[0][0]));
    wgmma_commit();
    pass_turn();
    wgmma_wait<0>();
    pin(s);
    release(&sm.k_empty[0]);
    softmax(0);
    pack();
    for (int j = 1; j < n_tiles; ++j) {
      const int s_now = j % kStages, s_prev = (j - 1) % kStages;
      bar_wait(&sm.k_full[s_now], (j / kStages) & 1);
      bar_wait(&sm.v_full[s_prev], ((j - 1) / kStages) & 1);
      take_turn();
      wgmma_fence();
      issue_qk(s, q_base, smem_addr(sm.k[s_now][0]));
      wgmma_commit();
      wgmma_rs_steps<kBlockN / 16>(o, pr, smem_addr(sm.v[s_prev][0]), kHalf * 2);  // O += P V
      wgmma_commit();
      pass_turn();
      wgmma_wait<1>();  // this tile's scores; the previous tile's P V may still run
      pin(s);
      release(&sm.k_empty[s_now]);
      softmax(j);
      wgmma_wait<0>();
      pin(o);
      pin(pr);
      release(&sm.v_empty[s_prev]);
#pragma unroll
      for (int i = 0; i < 64; ++i) o[i] *= alpha[(i >> 1) & 1];
      pack();
    }
    const int s_last = (n_tiles - 1) % kStages;
    bar_wait(&sm.v_full[s_last], ((n_tiles - 1) / kStages) & 1);
    take_turn();
    wgmma_fence();
    wgmma_rs_steps<kBlockN / 16>(o, pr, smem_addr(sm.v[s_last][0]), kHalf * 2);
    wgmma_commit();
    if (wg == 1) pass_turn();
    wgmma_wait<0>();
    pin(o);
    release(&sm.v_empty[s_last]);
  }

  // Epilogue: the row sums over the four lanes of a row, O / l in bf16, the log-sum-exp.
  auto* out = static_cast<__nv_bfloat16*>(p.o);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    const int64_t qi = row0 + 8 * r;
    if (qi >= p.T) continue;
    const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
    uint32_t* dst = reinterpret_cast<uint32_t*>(out + (qi * p.Hq + hq) * kHd + col0);
#pragma unroll
    for (int g = 0; g < 16; ++g) dst[4 * g] = pack_bf16(o[4 * g + 2 * r] * inv, o[4 * g + 2 * r + 1] * inv);
    if (lane % 4 == 0) p.lse_out[hq * p.T + qi] = l[r] > 0.f ? (m[r] + log2f(l[r])) * kLn2 : -INFINITY;
  }
#endif  // __CUDA_ARCH_FEAT_SM90_ALL
}

}  // namespace

void hopper_forward(const Params& p) {
  LCX_CHECK(p.d == kHd && p.tq == DType::bf16 && hopper_device(), "the Hopper forward takes bf16, head_dim 128, on sm_90");
  const CUtensorMap q_map = tensor_map(p.q, p.T, p.Hq, kBlockN);
  const CUtensorMap k_map = tensor_map(p.k, p.S, p.Hkv, kBlockN);
  const CUtensorMap v_map = tensor_map(p.v, p.S, p.Hkv, kBlockN);
  static const bool once = (allow_smem(attn_fwd_hopper_kernel, kSmemBytes), true);
  (void)once;
  const int64_t blocks = (p.T + kBlockM - 1) / kBlockM * p.Hq;
  attn_fwd_hopper_kernel<<<static_cast<unsigned>(blocks), kThreads, kSmemBytes, lcx::cuda::current_stream()>>>(q_map, k_map, v_map, p);
  LCX_CUDA_LAUNCH_CHECK();
}

}  // namespace lcx::ops::cuda::attn
