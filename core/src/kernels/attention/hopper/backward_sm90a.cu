// Attention backward for Hopper (sm_90a), the forward's twin (forward_sm90a.cu): bf16 q, k,
// v, out, dout, head_dim 128, fp32 accumulation, causal or full with the ring's offsets, a sliding
// window (each key block walks only the query steps within it), GQA.
// Three kernels, as the forward's own backward has them:
// - per query row and head, the log-sum-exp in the exp2 domain beside delta = rowsum(dout * out),
//   in rows padded to whole query steps, so one bulk copy brings a step's pairs beside its Q;
// - the main loop, one block per 128 key rows of one key/value head: its K and V stay in shared
//   memory while the block walks every 64-row query step that sees those keys, each for every
//   query head of the group, Q, dout and the step's LSE/delta pairs brought by TMA in two stages
//   (one producer thread: its warpgroup gives up registers the consumers take). Each of two
//   consumer warpgroups owns 64 key rows: S^T = K Q^T and dP^T = V dout^T (wgmma), P^T and
//   dS^T = P^T (dP^T - delta) in registers, dV += P^T dout with P^T from registers, dS^T to shared memory, dK += dS^T Q from there (dK and dV are summed over
//   the group's query heads in registers: no atomics, no reduction pass), and dQ = dS K, which
//   the consumers leave in shared memory (two buffers) for the producer's second warp to add to
//   an fp32 accumulator with one bulk reduction a step, off the GEMMs' path. The additions to one
//   query step's dQ come in key-block order (a counter per query head and step that the adding
//   warp waits for and advances once its addition is complete), so the result is the same bits
//   every run;
// - dq = scale * the accumulator, rounded once, back in [T, Hq, 128].
// Built for sm_90a alone, like the forward; the dispatch (dispatch.h) runs it on sm_90 for calls of
// at most 131,072 rows, and the tensor-core kernels (mma/) serve the rest.
#include "kernels/attention/hopper/hopper.cuh"

namespace lcx::ops::cuda::attn {
namespace {

using namespace hopper;

constexpr int kWgKeys = 64;             // key rows per consumer warpgroup
constexpr int kKeys = 2 * kWgKeys;      // key rows per block
constexpr int kStep = 64;               // query rows per step
constexpr int kHd = 128;                // head_dim
constexpr int kStages = 2;
constexpr int kThreads = 384;           // producer warpgroup + two consumer warpgroups
constexpr int kKHalf = kKeys * 64;      // elements of a 64-column half of K or V (16 KB)
constexpr int kQHalf = kStep * 64;      // of a Q or dout step (8 KB)
constexpr uint32_t kKvBytes = 2 * (2 * kKHalf * 2);   // K and V: 64 KB
constexpr uint32_t kStepBytes = 2 * (2 * kQHalf * 2) + kStep * 8;  // a step's Q, dout, LSE/delta pairs
// The register split after setmaxnreg: the launch gives each of the 384 threads 168 (the most
// __launch_bounds__(384, 1) allows) and the consumers' increase is served only from what the producer
// releases, so 128 x (168 - 24) = 256 x (240 - 168) exactly. A producer left with more starves
// the consumers' increase, which then waits forever.
constexpr uint32_t kProducerRegs = 24, kConsumerRegs = 240;
static_assert(128 * kProducerRegs + 256 * kConsumerRegs <= 384 * 168, "setmaxnreg would wait forever");

// Named barrier (0 is __syncthreads): both consumer warpgroups' dS^T written.
constexpr uint32_t kDsBarrier = 3;

struct alignas(1024) Smem {
  __nv_bfloat16 k[2][kKHalf];
  __nv_bfloat16 v[2][kKHalf];
  __nv_bfloat16 q[kStages][2][kQHalf];
  __nv_bfloat16 dout[kStages][2][kQHalf];
  // dS^T [128 keys][64 query columns], rows of 128 bytes swizzled as TMA would, two buffers so a
  // step's writes never meet the other warpgroup's reads of the step before.
  __nv_bfloat16 ds[2][kKeys * kStep];
  // A step's dQ [64 queries x 128] as the two consumer warpgroups hold it, fp32 in the order of
  // their registers: [warpgroup][i / 4][thread][i % 4], 16-byte stores without bank conflicts
  // (the accumulator in global memory keeps that order; the last pass puts rows back).
  float dq[2][2][8][128][4];
  float2 stats[kStages][kStep];  // by query row of the step: the log-sum-exp in the exp2 domain, delta
  uint64_t kv_full;
  uint64_t full[kStages], empty[kStages];
  uint64_t dq_full[2], dq_empty[2];
};
static_assert(sizeof(Smem) + 1024 <= 232448, "more shared memory than a Hopper block may have");
constexpr uint32_t kDqBytes = 2 * 8 * 128 * 4 * 4;  // a step's dQ, both warpgroups: 32 KB
constexpr size_t kSmemBytes = sizeof(Smem) + 1024;

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ int load_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void bulk_reduce_add(float* dst, const void* src, uint32_t bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;" ::"l"(dst),
               "r"(smem_addr(src)), "r"(bytes)
               : "memory");
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}
// Once a step's reduction is complete, the next key block may add to the same rows.
__device__ __forceinline__ void release_counter(int* counter) {
  asm volatile("fence.proxy.async.global;" ::: "memory");
  __threadfence();
  atomicAdd(counter, 1);
}
__device__ __forceinline__ void named_sync(uint32_t id, uint32_t threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// acc[64 keys x 64 queries] = a (this warpgroup's 64 rows of K or V) b^T (Q or dout of the step),
// both K-major over head_dim: 8 steps of 16 columns, each half of 64 columns its own tile.
__device__ __forceinline__ void issue_rows_by_step(float (&acc)[32], uint32_t a_base, uint32_t b_base) {
#pragma unroll
  for (int kk = 0; kk < kHd / 16; ++kk) {
    const uint32_t a = a_base + (kk / 4) * (kKHalf * 2) + (kk % 4) * 32;
    const uint32_t b = b_base + (kk / 4) * (kQHalf * 2) + (kk % 4) * 32;
    if (kk == 0)
      wgmma_ss64_init<0, 0>(acc, sw128_desc(a, 16, 1024), sw128_desc(b, 16, 1024));
    else
      wgmma_ss64<0, 0>(acc, sw128_desc(a, 16, 1024), sw128_desc(b, 16, 1024));
  }
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

// Thread t of a consumer warpgroup holds key rows 16 (t / 32) + (t % 32) / 4 and 8 below it of
// its warpgroup's 64; element i of a 64-column accumulator sits in column 8 (i / 4) + 2 (t % 4) +
// i % 2 of row (i / 2) % 2 (the forward's layout with keys for rows).
__global__ void __launch_bounds__(kThreads, 1)
    attn_bwd_hopper_kernel(const __grid_constant__ CUtensorMap q_map, const __grid_constant__ CUtensorMap k_map,
                           const __grid_constant__ CUtensorMap v_map, const __grid_constant__ CUtensorMap do_map,
                           const Params p, const float2* stats, float* dq_acc, int* counters) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ unsigned char smem_raw[];
  Smem& sm = *reinterpret_cast<Smem*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  const int wg = threadIdx.x / 128;
  // Key blocks in order within each key/value head: a block waits only on blocks launched before it.
  const int64_t hk = blockIdx.x % p.Hkv, nb = blockIdx.x / p.Hkv;
  const int64_t k0 = nb * kKeys;
  const int64_t group = p.Hq / p.Hkv;
  const int64_t m_steps = (p.T + kStep - 1) / kStep;
  // The query steps [m_begin, m_end) that see a key of this block: causal, from the first query
  // at or after its first key; a window, up to the last query within W of its last key.
  const int64_t m_begin = lcx::cuda::lmin(m_steps, first_query(p, k0, kStep) / kStep);
  const int64_t m_end = lcx::cuda::lmax(m_begin, (query_end(p, k0, kKeys) + kStep - 1) / kStep);
  // Steps go query step by query step, the group's heads within each: a block then trails the
  // block before it (which starts two query steps earlier) by whole query steps, so its waits for
  // that block's dQ additions are short. Heads outermost would hold every block of a causal call
  // to the pace of the first, which has the most steps per head.
  const int64_t steps = (m_end - m_begin) * group;

  if (threadIdx.x == 0) {
    bar_init(&sm.kv_full, 1);
    for (int s = 0; s < kStages; ++s) {
      bar_init(&sm.full[s], 1);
      bar_init(&sm.empty[s], 8);
      bar_init(&sm.dq_full[s], 256);  // every consumer thread, after its fence
      bar_init(&sm.dq_empty[s], 1);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  }
  __syncthreads();

  if (wg == 0) {  // producer: one thread issues every load, one of the next warp the dQ additions
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kProducerRegs) : "memory");
    if (threadIdx.x == 32) {
      // The counter of step `it` advances once that step's addition is complete, which is
      // awaited a step late so two additions are in flight. The key blocks adding to a query step
      // are consecutive, from the first its window reaches (0 without a window): this block's
      // turn comes after those before it.
      int* pending = nullptr;
      for (int64_t it = 0; it < steps; ++it) {
        const int b = it % 2;
        const int64_t h = hk * group + it % group, m = m_begin + it / group;
        int* counter = counters + h * m_steps + m;
        const int64_t turn = nb - first_key(p, m * kStep, kKeys) / kKeys;
        bar_wait(&sm.dq_full[b], (it / 2) & 1);
        while (load_acquire(counter) < turn) {
        }
        bulk_reduce_add(dq_acc + (h * m_steps + m) * (kStep * kHd), sm.dq[b], kDqBytes);
        asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
        bar_arrive(&sm.dq_empty[b]);
        if (pending) {
          asm volatile("cp.async.bulk.wait_group 1;" ::: "memory");
          release_counter(pending);
        }
        pending = counter;
      }
      if (pending) {
        asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
        release_counter(pending);
      }
    }
    if (threadIdx.x == 0) {
      bar_expect(&sm.kv_full, kKvBytes);
      for (int c = 0; c < 2; ++c) {
        tma_load(sm.k[c], &k_map, &sm.kv_full, 64 * c, static_cast<int>(hk), static_cast<int>(k0));
        tma_load(sm.v[c], &v_map, &sm.kv_full, 64 * c, static_cast<int>(hk), static_cast<int>(k0));
      }
      const int64_t t_pad = m_steps * kStep;
      for (int64_t it = 0; it < steps; ++it) {
        const int s = it % kStages;
        const uint32_t phase = (it / kStages) & 1;
        const int h = static_cast<int>(hk * group + it % group);
        const int row = static_cast<int>((m_begin + it / group) * kStep);
        bar_wait(&sm.empty[s], phase ^ 1);
        bar_expect(&sm.full[s], kStepBytes);
        for (int c = 0; c < 2; ++c) {
          tma_load(sm.q[s][c], &q_map, &sm.full[s], 64 * c, h, row);
          tma_load(sm.dout[s][c], &do_map, &sm.full[s], 64 * c, h, row);
        }
        bulk_load(sm.stats[s], stats + h * t_pad + row, kStep * 8, &sm.full[s]);
      }
    }
    return;
  }

  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kConsumerRegs) : "memory");
  const int tid = threadIdx.x - 128 * wg, warp = tid / 32, lane = tid % 32;
  const int wk = wg - 1;                                    // this warpgroup's half of the keys
  const int local_row = wk * kWgKeys + warp * 16 + lane / 4;  // and 8 below, of the block's 128
  const int64_t key0 = k0 + local_row;
  const int col0 = 2 * (lane % 4);
  const uint32_t k_rows = smem_addr(sm.k[0]) + wk * kWgKeys * 128;
  const uint32_t v_rows = smem_addr(sm.v[0]) + wk * kWgKeys * 128;
  const float sl2 = p.scale_log2;

  float dk[64], dv[64];  // this thread's rows, summed over every step of every head of the group
#pragma unroll
  for (int i = 0; i < 64; ++i) dk[i] = dv[i] = 0.f;
  bar_wait(&sm.kv_full, 0);

  for (int64_t it = 0; it < steps; ++it) {
    const int s = it % kStages;
    const int64_t m = m_begin + it / group;
    const int64_t q0 = m * kStep;
    const uint32_t q_tile = smem_addr(sm.q[s][0]), do_tile = smem_addr(sm.dout[s][0]);
    // st holds S^T, then P^T, then (once P^T is in bf16) the step's dQ. Each product's first
    // step overwrites its accumulator (wgmma_ss64_init), so neither lives across steps.
    float st[32], dpt[32];
    bar_wait(&sm.full[s], (it / kStages) & 1);
    wgmma_fence();
    issue_rows_by_step(st, k_rows, q_tile);
    wgmma_commit();
    issue_rows_by_step(dpt, v_rows, do_tile);
    wgmma_commit();

    const float2* stat = sm.stats[s];  // by query column of the step
    const bool unmasked =
        k0 + wk * kWgKeys + kWgKeys <= p.S && q0 + kStep <= p.T &&
        (!p.causal || p.k_offset + k0 + wk * kWgKeys + kWgKeys - 1 <= p.q_offset + q0) &&
        (p.window <= 0 || p.q_offset + q0 + kStep - 1 - (p.k_offset + k0 + wk * kWgKeys) < p.window);
    // The masks in 32-bit terms relative to this thread's first key and the step's first query:
    // key row 0 or 8 below it is real below key_lim, query column c below query_lim, (causal)
    // seen where c - row + ahead >= 0 and (a window) where c - row < behind. Both clamp to a
    // range past any c - row, which keeps their sign.
    const int key_lim = static_cast<int>(lcx::cuda::lmin(16, p.S - key0));
    const int query_lim = static_cast<int>(lcx::cuda::lmin(kStep, p.T - q0));
    const int64_t ahead64 = p.q_offset + q0 - p.k_offset - key0;
    const int ahead = static_cast<int>(lcx::cuda::lmax(-(1 << 20), lcx::cuda::lmin(1 << 20, ahead64)));
    const int behind = p.window <= 0 ? (1 << 20)
                                     : static_cast<int>(lcx::cuda::lmax(-(1 << 20), lcx::cuda::lmin(1 << 20, p.window - ahead64)));
    wgmma_wait<1>();
    pin(st);
#pragma unroll
    for (int i = 0; i < 32; ++i) {
      const int col = 8 * (i / 4) + col0 + (i % 2);
      bool seen = true;
      if (!unmasked) {
        const int row = 8 * ((i >> 1) & 1);
        seen = row < key_lim && col < query_lim && (!p.causal || col - row + ahead >= 0) && col - row < behind;
      }
      st[i] = seen ? fast_exp2(fmaf(st[i], sl2, -stat[col].x)) : 0.f;  // P^T
    }
    wgmma_wait<0>();
    pin(dpt);
#pragma unroll
    for (int i = 0; i < 32; ++i) dpt[i] = st[i] * (dpt[i] - stat[8 * (i / 4) + col0 + (i % 2)].y);  // dS^T
    uint32_t pt[16];
#pragma unroll
    for (int j = 0; j < 16; ++j) pt[j] = pack_bf16(st[2 * j], st[2 * j + 1]);
    // dS^T into shared memory, swizzled: row r's 16-byte chunk c sits at chunk c ^ (r % 8). dK and
    // dQ read it there (dK's A operand from shared memory keeps registers for the accumulators).
    unsigned char* ds = reinterpret_cast<unsigned char*>(sm.ds[it % 2]);
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const int r = local_row + 8 * (j % 2), chunk = j / 2;
      *reinterpret_cast<uint32_t*>(ds + r * 128 + ((chunk ^ (r % 8)) * 16) + col0 * 2) =
          pack_bf16(dpt[2 * j], dpt[2 * j + 1]);
    }
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // the GEMMs below read it
    wgmma_fence();
    wgmma_rs_steps<kStep / 16>(dv, pt, do_tile, kQHalf * 2);  // dV += P^T dout
    named_sync(kDsBarrier, 256);
    const uint32_t ds_tile = smem_addr(sm.ds[it % 2]), k_half = smem_addr(sm.k[wk]);
    // dK += dS^T Q: this warpgroup's 64 rows of dS^T, K-major over the step's 64 queries (32 bytes a
    // step of 16); Q MN-major as in dV.
#pragma unroll
    for (int kk = 0; kk < kStep / 16; ++kk)
      wgmma_ss<0, 1>(dk, sw128_desc(ds_tile + wk * kWgKeys * 128 + kk * 32, 16, 1024),
                     sw128_desc(q_tile + kk * 16 * 128, kQHalf * 2, 1024), 1);
    // dQ[64 queries x this warpgroup's 64 columns] = dS K: 8 steps of 16 keys. dS^T is [keys]
    // [queries] and K [keys][head_dim]: both MN-major for this product. Its accumulator is st's.
#pragma unroll
    for (int kk = 0; kk < kKeys / 16; ++kk)
      if (kk == 0)
        wgmma_ss64_init<1, 1>(st, sw128_desc(ds_tile, 0, 1024), sw128_desc(k_half, 0, 1024));
      else
        wgmma_ss64<1, 1>(st, sw128_desc(ds_tile + kk * 16 * 128, 0, 1024), sw128_desc(k_half + kk * 16 * 128, 0, 1024));
    wgmma_commit();
    wgmma_wait<0>();
    pin(st);
    pin(dk);
    pin(dv);
    pin(pt);
    if (lane == 0) bar_arrive(&sm.empty[s]);

    // The step's dQ to its buffer for the adding warp, once that warp has read the buffer's
    // previous contents.
    const int b = it % 2;
    bar_wait(&sm.dq_empty[b], ((it / 2) & 1) ^ 1);
#pragma unroll
    for (int c = 0; c < 8; ++c)
      *reinterpret_cast<float4*>(sm.dq[b][wk][c][tid]) = make_float4(st[4 * c], st[4 * c + 1], st[4 * c + 2], st[4 * c + 3]);
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    bar_arrive(&sm.dq_full[b]);
  }

  // dK (scaled) and dV of this thread's two key rows, summed over the group, rounded once.
  auto* dk_out = static_cast<__nv_bfloat16*>(p.dk);
  auto* dv_out = static_cast<__nv_bfloat16*>(p.dv);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t kr = key0 + 8 * r;
    if (kr >= p.S) continue;
    uint32_t* dkr = reinterpret_cast<uint32_t*>(dk_out + (kr * p.Hkv + hk) * kHd + col0);
    uint32_t* dvr = reinterpret_cast<uint32_t*>(dv_out + (kr * p.Hkv + hk) * kHd + col0);
#pragma unroll
    for (int g = 0; g < 16; ++g) {
      dkr[4 * g] = pack_bf16(dk[4 * g + 2 * r] * p.scale, dk[4 * g + 2 * r + 1] * p.scale);
      dvr[4 * g] = pack_bf16(dv[4 * g + 2 * r], dv[4 * g + 2 * r + 1]);
    }
  }
#endif  // __CUDA_ARCH_FEAT_SM90_ALL
}

// stats[h][i] = (lse * log2(e), rowsum(dout * out)) of query row i and head h, a warp a row: each
// lane reads four of the 128 columns of both. Rows past T keep the zeros they were cleared to.
__global__ void attn_bwd_hopper_stats_kernel(const Params p, float2* stats, int64_t t_pad) {
  const int lane = threadIdx.x % 32;
  const int64_t rows = p.T * p.Hq;
  for (int64_t row = blockIdx.x * int64_t(blockDim.x / 32) + threadIdx.x / 32; row < rows;
       row += int64_t(gridDim.x) * (blockDim.x / 32)) {
    const int64_t i = row / p.Hq, h = row % p.Hq;
    const uint2 o = reinterpret_cast<const uint2*>(p.out)[row * (kHd / 4) + lane];
    const uint2 g = reinterpret_cast<const uint2*>(p.dout)[row * (kHd / 4) + lane];
    const float2 o0 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&o.x));
    const float2 o1 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&o.y));
    const float2 g0 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&g.x));
    const float2 g1 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&g.y));
    const float acc = lcx::cuda::warp_sum(o0.x * g0.x + o0.y * g0.y + o1.x * g1.x + o1.y * g1.y);
    if (lane == 0) stats[h * t_pad + i] = make_float2(p.lse_in[h * p.T + i] * kLog2e, acc);
  }
}

// dq = scale * the fp32 accumulator, in bf16: the accumulator's four-float group g of a step
// ([h][m][warpgroup][c][thread], the consumers' register order) holds the thread's elements 4c..4c+3:
// columns 8c + 2 (lane % 4) + {0, 1} of its query row and of the row 8 below.
__global__ void attn_bwd_hopper_dq_kernel(const float4* acc, __nv_bfloat16* dq, int64_t T, int64_t Hq,
                                          int64_t m_steps, float scale) {
  const int64_t n4 = Hq * m_steps * kStep * kHd / 4;
  for (int64_t g = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; g < n4; g += int64_t(gridDim.x) * blockDim.x) {
    const int tid = g % 128, c = (g / 128) % 8, wk = (g / 1024) % 2;
    const int64_t hm = g / 2048, h = hm / m_steps, m = hm % m_steps;
    const int warp = tid / 32, lane = tid % 32;
    const int64_t row = m * kStep + warp * 16 + lane / 4;
    const int col = wk * 64 + 8 * c + 2 * (lane % 4);
    const float4 a = acc[g];
    if (row < T)
      *reinterpret_cast<__nv_bfloat162*>(dq + (row * Hq + h) * kHd + col) = __floats2bfloat162_rn(a.x * scale, a.y * scale);
    if (row + 8 < T)
      *reinterpret_cast<__nv_bfloat162*>(dq + ((row + 8) * Hq + h) * kHd + col) =
          __floats2bfloat162_rn(a.z * scale, a.w * scale);
  }
}

}  // namespace

// The dQ accumulator [Hq, steps, 64 x 128] fp32, the LSE/delta pairs [Hq, steps x 64], the
// counters [Hq, steps].
int64_t hopper_backward_scratch(int64_t T, int64_t Hq) {
  const int64_t steps = (T + kStep - 1) / kStep;
  return Hq * steps * kStep * (kHd * 4 + 8) + Hq * steps * 4;
}

void hopper_backward(const Params& p, void* scratch) {
  LCX_CHECK(p.d == kHd && p.tq == DType::bf16 && hopper_device(), "the Hopper backward takes bf16, head_dim 128, on sm_90");
  const int64_t t_pad = (p.T + kStep - 1) / kStep * kStep;
  auto* dq_acc = static_cast<float*>(scratch);
  auto* stats = reinterpret_cast<float2*>(dq_acc + p.Hq * t_pad * kHd);
  int* counters = reinterpret_cast<int*>(stats + p.Hq * t_pad);
  cudaStream_t stream = lcx::cuda::current_stream();
  LCX_CUDA_CHECK(cudaMemsetAsync(scratch, 0, hopper_backward_scratch(p.T, p.Hq), stream));
  attn_bwd_hopper_stats_kernel<<<lcx::cuda::grid_for(p.T * p.Hq, 8, 65535LL * 8), 256, 0, stream>>>(p, stats, t_pad);
  LCX_CUDA_LAUNCH_CHECK();
  if (p.S > 0) {
    const CUtensorMap q_map = tensor_map(p.q, p.T, p.Hq, kStep), do_map = tensor_map(p.dout, p.T, p.Hq, kStep);
    const CUtensorMap k_map = tensor_map(p.k, p.S, p.Hkv, kKeys), v_map = tensor_map(p.v, p.S, p.Hkv, kKeys);
    static const bool once = (allow_smem(attn_bwd_hopper_kernel, kSmemBytes), true);
    (void)once;
    const int64_t blocks = (p.S + kKeys - 1) / kKeys * p.Hkv;
    attn_bwd_hopper_kernel<<<static_cast<unsigned>(blocks), kThreads, kSmemBytes, stream>>>(q_map, k_map, v_map, do_map,
                                                                                            p, stats, dq_acc, counters);
    LCX_CUDA_LAUNCH_CHECK();
  }
  attn_bwd_hopper_dq_kernel<<<lcx::cuda::grid_for(p.Hq * t_pad * kHd / 4, 256, 65535LL * 8), 256, 0, stream>>>(
      reinterpret_cast<const float4*>(dq_acc), static_cast<__nv_bfloat16*>(p.o), p.T, p.Hq, t_pad / kStep, p.scale);
  LCX_CUDA_LAUNCH_CHECK();
}

}  // namespace lcx::ops::cuda::attn
