// The grouped GEMMs on Hopper (sm_90a): rows sorted by group, each group of rows through
// its own weight, in bf16 with fp32 accumulation, one persistent launch for every group:
// - M-grouped (the forward and the input gradient): y[rows of g] = alpha x[rows of g] op(w[g]) +
//   beta y, op(w[g]) = w[g]^T (w[g] is [N, K], K contiguous) or w[g] ([K, N], N contiguous).
// - K-grouped (the weights' gradient): dw[g] = alpha dy[rows of g]^T x[rows of g] + beta dw[g], the
//   rows of g the reduction.
// The design is the dense Hopper GEMM's (the attention kernels' hopper.cuh supplies the
// instructions): tiles of 128 x 256 results, 64-deep slices of both operands brought by TMA into
// 128-byte swizzled shared memory through 4 stages, one producer thread, two consumer warpgroups
// of 64 result rows each issuing wgmma. The launch is persistent: one block per SM walks the tiles
// of every group in turn (group by group, the tiles of a group's rows side by side), so a step's
// skewed groups (one with 4x the mean rows, another with none) costs no launch and no idle
// block, and the weights of a group are read from L2 by the blocks sharing them.
// A group's rows start anywhere: TMA reads from any row, and a tile's rows past its group's end
// are another group's (M-grouped: computed, not stored) or, as the reduction of a K-grouped tile,
// zeroed in shared memory before the product reads them. Each tile's results go from the
// accumulators to global memory directly, scaled by alpha and added to beta times what is there.
// Served: bf16 operands, a bf16 or fp32 result, the output's columns a multiple of 256 (M-grouped)
// or its rows of 128 and columns of 256 (K-grouped), an M-grouped reduction of 64s, at most 256
// groups, on a compute capability 9.0 device; grouped_matmul.cu takes cuBLAS's grouped GEMM for the
// rest.
#include <algorithm>
#include <atomic>
#include <optional>

#include "kernels/attention/hopper/hopper.cuh"
#include "kernels/cuda/grouped_gemm_hopper.h"

namespace lcx::ops::cuda::grouped_hopper {
namespace {

using namespace attn::hopper;

constexpr int kBM = 128, kBK = 64, kThreads = 384;
constexpr int kMaxGroups = 256;

enum class Mode { m_kmajor = 0, m_nmajor = 1, k_grouped = 2 };

struct Params {
  int groups, tiles;
  int n;     // the result's columns
  int m;     // K-grouped: the result's rows per group
  int kred;  // M-grouped: the reduction's length
  int n_tiles, m_tiles;  // per group (m_tiles: K-grouped only)
  void* out;
  int out_f32;
  float alpha, beta;
  int offsets[kMaxGroups + 1];     // the groups' rows
  int tile_start[kMaxGroups + 1];  // the groups' first tiles
};


// A 2-D bf16 tensor map: boxes of 64 contiguous elements (128 bytes, the swizzle's span) by
// box_outer rows, 128-byte swizzled, reads past the ends as zeros.
CUtensorMap map_2d(const void* base, int64_t inner, int64_t outer, uint32_t box_outer) {
  CUtensorMap map;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(inner), static_cast<cuuint64_t>(outer)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(inner) * 2};
  const cuuint32_t box[2] = {64, box_outer};
  const cuuint32_t unit[2] = {1, 1};
  const CUresult r = encoder()(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(base), dims, strides, box,
                               unit, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                               CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) throw Error(str("cuTensorMapEncodeTiled failed (CUresult ", int(r), ")"));
  return map;
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// One tile: its group, where its rows (M-grouped) or its result block (K-grouped) start, and the
// 64-deep slices its reduction takes.
struct Tile {
  int g, m0, n0, rows, k_iters;
};

__device__ __forceinline__ Tile decode(const Params& p, int t, int& g, Mode mode, int bn) {
  while (g + 1 < p.groups && p.tile_start[g + 1] <= t) ++g;
  const int local = t - p.tile_start[g];
  Tile tl;
  tl.g = g;
  tl.n0 = (local % p.n_tiles) * bn;
  const int begin = p.offsets[g], end = p.offsets[g + 1];
  if (mode == Mode::k_grouped) {
    tl.m0 = (local / p.n_tiles) * kBM;
    tl.rows = end - begin;
    tl.k_iters = (tl.rows + kBK - 1) / kBK;
  } else {
    tl.m0 = begin + (local / p.n_tiles) * kBM;
    tl.rows = min(kBM, end - tl.m0);
    tl.k_iters = p.kred / kBK;
  }
  return tl;
}

__device__ __forceinline__ void tma_2d(void* dst, const CUtensorMap* map, uint64_t* bar, int inner, int outer) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];" ::"r"(
          smem_addr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_addr(bar)), "r"(inner), "r"(outer)
      : "memory");
}

__device__ __forceinline__ void named_sync(uint32_t id, uint32_t threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

__device__ __forceinline__ void store_pair(void* out, int out_f32, int64_t i, float v0, float v1, float beta) {
  if (out_f32) {
    float2* dst = reinterpret_cast<float2*>(static_cast<float*>(out) + i);
    if (beta != 0.f) {
      const float2 old = *dst;
      v0 += beta * old.x;
      v1 += beta * old.y;
    }
    *dst = make_float2(v0, v1);
  } else {
    uint32_t* dst = reinterpret_cast<uint32_t*>(static_cast<__nv_bfloat16*>(out) + i);
    if (beta != 0.f) {
      const __nv_bfloat162 old = *reinterpret_cast<const __nv_bfloat162*>(dst);
      v0 += beta * __bfloat162float(old.x);
      v1 += beta * __bfloat162float(old.y);
    }
    *dst = pack_bf16(v0, v1);
  }
}
#endif  // __CUDA_ARCH_FEAT_SM90_ALL

// Two designs share the code (kPing):
// - cooperative: tiles of 128 x 256, both consumer warpgroups on one tile (64 rows each), 4 stages;
// - ping-pong: tiles of 128 x 128, the consumer warpgroups taking the block's tiles in turn (each a
//   whole tile, 6 stages between them), so one's results go out while the other multiplies.
// a_map: M-grouped x [rows, kred] (boxes of 128 rows); K-grouped dy [rows, m] (boxes of 64 rows).
// b_map: M-grouped, K-major: w as [groups * n, kred] (boxes of a tile's columns); N-major: w as
// [groups * kred, n] (boxes of 64 rows); K-grouped: x [rows, n] (boxes of 64 rows).
template <bool kPing>
struct Design {
  static constexpr int bn = kPing ? 128 : 256, stages = kPing ? 6 : 4;
  static constexpr uint32_t a_bytes = kBM * kBK * 2, stage_bytes = a_bytes + bn * kBK * 2;
  static constexpr size_t smem = stages * stage_bytes + 2 * stages * sizeof(uint64_t) + 1024;
};

template <Mode kMode, bool kPing>
__global__ void __launch_bounds__(kThreads, 1)
    grouped_kernel(const __grid_constant__ CUtensorMap a_map, const __grid_constant__ CUtensorMap b_map,
                   const __grid_constant__ Params p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using D = Design<kPing>;
  constexpr int kBN_ = D::bn, kStages_ = D::stages;
  extern __shared__ unsigned char smem_raw[];
  unsigned char* base = reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  uint64_t* full = reinterpret_cast<uint64_t*>(base + kStages_ * D::stage_bytes);
  uint64_t* empty = full + kStages_;
  auto a_tile = [&](int s) { return base + s * D::stage_bytes; };
  auto b_tile = [&](int s) { return base + s * D::stage_bytes + D::a_bytes; };
  const int wg = threadIdx.x / 128;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages_; ++s) {
      bar_init(&full[s], 1);
      bar_init(&empty[s], kPing ? 4 : 8);  // one arrival per warp of the warpgroups reading the stage
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  }
  __syncthreads();

  if (wg == 0) {  // producer
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
    if (threadIdx.x == 0) {
      asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(&a_map)) : "memory");
      asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(&b_map)) : "memory");
      int stage = 0, g = 0;
      uint32_t phase = 0;
      for (int t = blockIdx.x; t < p.tiles; t += gridDim.x) {
        const Tile tl = decode(p, t, g, kMode, kBN_);
        for (int kt = 0; kt < tl.k_iters; ++kt) {
          bar_wait(&empty[stage], phase ^ 1);
          bar_expect(&full[stage], D::stage_bytes);
          uint64_t* bar = &full[stage];
          unsigned char *sa = a_tile(stage), *sb = b_tile(stage);
          const int k0 = kt * kBK;
          if constexpr (kMode == Mode::k_grouped) {
            const int row = p.offsets[tl.g] + k0;
            for (int j = 0; j < kBM / 64; ++j) tma_2d(sa + j * 8192, &a_map, bar, tl.m0 + 64 * j, row);
            for (int j = 0; j < kBN_ / 64; ++j) tma_2d(sb + j * 8192, &b_map, bar, tl.n0 + 64 * j, row);
          } else {
            tma_2d(sa, &a_map, bar, k0, tl.m0);
            if constexpr (kMode == Mode::m_kmajor) {
              tma_2d(sb, &b_map, bar, k0, tl.g * p.n + tl.n0);
            } else {
              for (int j = 0; j < kBN_ / 64; ++j) tma_2d(sb + j * 8192, &b_map, bar, tl.n0 + 64 * j, tl.g * p.kred + k0);
            }
          }
          if (++stage == kStages_) stage = 0, phase ^= 1;
        }
      }
    }
    return;
  }

  // consumers. Cooperative: warpgroup c holds the tile's rows 64 c .. 64 c + 63, columns 0-127 in
  // acc0 and 128-255 in acc1. Ping-pong: warpgroup c takes the block's tiles c, c + 2, ..., rows
  // 0-63 in acc0 and 64-127 in acc1.
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
  const int c = wg - 1, tid = threadIdx.x - 128 * wg, warp = tid / 32, lane = tid % 32;
  constexpr int kTransA = kMode == Mode::k_grouped ? 1 : 0;
  constexpr int kTransB = kMode == Mode::m_kmajor ? 0 : 1;
  float acc0[64], acc1[64];
  int stage = 0, g = 0, prev = 0;
  uint32_t phase = 0;
  int j = 0;
  for (int t = blockIdx.x; t < p.tiles; t += gridDim.x, ++j) {
    const Tile tl = decode(p, t, g, kMode, kBN_);
    if (kPing && (j & 1) != c) {  // the other warpgroup's tile: its stages pass by
      for (int kt = 0; kt < tl.k_iters; ++kt)
        if (++stage == kStages_) stage = 0, phase ^= 1;
      continue;
    }
#pragma unroll
    for (int i = 0; i < 64; ++i) acc0[i] = acc1[i] = 0.f;
    for (int kt = 0; kt < tl.k_iters; ++kt) {
      bar_wait(&full[stage], phase);
      unsigned char* sa = a_tile(stage);
      if constexpr (kMode == Mode::k_grouped) {
        // The last slice of a group: the rows past its end belong to the next group (or are TMA's
        // zeros); zero them in the A rows this warpgroup reads, so the product adds nothing of them.
        const int valid = tl.rows - kt * kBK;
        if (valid < kBK) {
          for (int h = kPing ? 0 : c; h <= (kPing ? 1 : c); ++h) {
            uint4* half = reinterpret_cast<uint4*>(sa + h * 8192);
            for (int i = valid * 8 + tid; i < kBK * 8; i += 128) half[i] = make_uint4(0, 0, 0, 0);
          }
          asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
          named_sync(1 + c, 128);
        }
      }
      const uint32_t a_base = smem_addr(sa), b_base = smem_addr(b_tile(stage));
      pin(acc0);
      pin(acc1);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kBK / 16; ++kk) {
        // Operand halves: 64 rows of A (8 KB apart) or 128 columns of B.
        auto a_desc = [&](int half) {
          return kTransA ? sw128_desc(a_base + half * 8192 + kk * 16 * 128, 0, 1024)
                         : sw128_desc(a_base + half * 8192 + kk * 32, 16, 1024);
        };
        auto b_desc = [&](int half) {
          return kTransB ? sw128_desc(b_base + half * 2 * 8192 + kk * 16 * 128, 8192, 1024)
                         : sw128_desc(b_base + half * 128 * 128 + kk * 32, 16, 1024);
        };
        if constexpr (kPing) {
          wgmma_ss<kTransA, kTransB>(acc0, a_desc(0), b_desc(0), 1);
          wgmma_ss<kTransA, kTransB>(acc1, a_desc(1), b_desc(0), 1);
        } else {
          wgmma_ss<kTransA, kTransB>(acc0, a_desc(c), b_desc(0), 1);
          wgmma_ss<kTransA, kTransB>(acc1, a_desc(c), b_desc(1), 1);
        }
      }
      wgmma_commit();
      if (kt > 0) {
        wgmma_wait<1>();  // the slice before this one is read: its stage goes back to the producer
        if (lane == 0) bar_arrive(&empty[prev]);
      }
      prev = stage;
      if (++stage == kStages_) stage = 0, phase ^= 1;
    }
    wgmma_wait<0>();
    pin(acc0);
    pin(acc1);
    if (tl.k_iters > 0 && lane == 0) bar_arrive(&empty[prev]);

    // Thread t of a warpgroup holds rows 16 (t / 32) + (t % 32) / 4 and 8 below it of a 64-row
    // product; element i of a row pair sits in column 8 (i / 4) + 2 (t % 4) + i % 2 of row (i / 2) % 2.
    auto store = [&](const float(&acc)[64], int row0, int col0) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = row0 + warp * 16 + lane / 4 + 8 * h;
        int64_t at;
        if constexpr (kMode == Mode::k_grouped) {
          at = (static_cast<int64_t>(tl.g) * p.m + tl.m0 + r) * p.n + tl.n0;
        } else {
          if (r >= tl.rows) continue;
          at = static_cast<int64_t>(tl.m0 + r) * p.n + tl.n0;
        }
        at += col0 + 2 * (lane % 4);
#pragma unroll
        for (int q = 0; q < 16; ++q)
          store_pair(p.out, p.out_f32, at + 8 * q, p.alpha * acc[4 * q + 2 * h], p.alpha * acc[4 * q + 2 * h + 1], p.beta);
      }
    };
    if constexpr (kPing) {
      store(acc0, 0, 0);
      store(acc1, 64, 0);
    } else {
      store(acc0, 64 * c, 0);
      store(acc1, 64 * c, 128);
    }
  }
#endif  // __CUDA_ARCH_FEAT_SM90_ALL
}

bool aligned16(const Tensor& t) { return reinterpret_cast<uintptr_t>(t.data()) % 16 == 0; }

int sm_count() {
  int dev = 0, n = 0;
  LCX_CUDA_CHECK(cudaGetDevice(&dev));
  LCX_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
  return n;
}

std::atomic<bool> g_ping{false};

template <Mode kMode, bool kPing>
void launch_design(const CUtensorMap& a_map, const CUtensorMap& b_map, const Params& p) {
  static const bool once = (attn::allow_smem(grouped_kernel<kMode, kPing>, Design<kPing>::smem), true);
  (void)once;
  static const int sms = sm_count();
  const int blocks = std::min(p.tiles, sms);
  grouped_kernel<kMode, kPing><<<blocks, kThreads, Design<kPing>::smem, lcx::cuda::current_stream()>>>(a_map, b_map, p);
  LCX_CUDA_LAUNCH_CHECK();
}

template <Mode kMode>
void launch(bool ping, const CUtensorMap& a_map, const CUtensorMap& b_map, const Params& p) {
  if (ping) {
    launch_design<kMode, true>(a_map, b_map, p);
  } else {
    launch_design<kMode, false>(a_map, b_map, p);
  }
}
// The parameters every mode shares: the groups' row offsets and the result, or nothing where the
// offsets do not fit the kernel's table and int.
std::optional<Params> base_params(std::span<const int64_t> offsets, Tensor& out, int64_t n, int bn, float alpha,
                                  float beta) {
  const size_t groups = offsets.size() - 1;
  if (groups == 0 || groups > static_cast<size_t>(kMaxGroups) || offsets.back() == 0 ||
      offsets.back() >= (int64_t(1) << 30))
    return std::nullopt;
  Params p{};
  p.groups = static_cast<int>(groups);
  for (size_t g = 0; g <= groups; ++g) p.offsets[g] = static_cast<int>(offsets[g]);
  p.n = static_cast<int>(n);
  p.n_tiles = static_cast<int>(n / bn);
  p.out = out.data();
  p.out_f32 = out.dtype() == DType::f32;
  p.alpha = alpha;
  p.beta = beta;
  return p;
}

// Numbers the tiles group by group: tiles_of(g) of group g.
template <class F>
void number_tiles(Params& p, F&& tiles_of) {
  int tiles = 0;
  for (int g = 0; g < p.groups; ++g) {
    p.tile_start[g] = tiles;
    tiles += tiles_of(g);
  }
  p.tile_start[p.groups] = tiles;
  p.tiles = tiles;
}

bool served_operands(std::initializer_list<const Tensor*> bf16, const Tensor& out) {
  if (!hopper_device() || (out.dtype() != DType::bf16 && out.dtype() != DType::f32) || !aligned16(out)) return false;
  for (const Tensor* t : bf16)
    if (t->dtype() != DType::bf16 || !aligned16(*t)) return false;
  return true;
}

}  // namespace

bool grouped_matmul(const Tensor& x, const Tensor& w, bool trans_w, std::span<const int64_t> offsets, Tensor& y,
                    float alpha, float beta) {
  const int64_t K = x.size(1), N = y.size(1);
  const bool ping = g_ping.load();
  const int bn = ping ? 128 : 256;
  if (!served_operands({&x, &w}, y) || N % bn != 0 || K % kBK != 0 || N > (1 << 20) || K > (1 << 20)) return false;
  if (static_cast<int64_t>(offsets.size()) * std::max(N, K) >= (int64_t(1) << 31)) return false;
  std::optional<Params> made = base_params(offsets, y, N, bn, alpha, beta);
  if (!made) return false;
  Params& p = *made;
  p.kred = static_cast<int>(K);
  number_tiles(p, [&](int g) { return (p.offsets[g + 1] - p.offsets[g] + kBM - 1) / kBM * p.n_tiles; });
  if (p.tiles == 0) return true;
  const CUtensorMap a_map = map_2d(x.data(), K, x.size(0), kBM);
  if (trans_w) {
    launch<Mode::m_kmajor>(ping, a_map, map_2d(w.data(), K, w.size(0) * N, bn), p);
  } else {
    launch<Mode::m_nmajor>(ping, a_map, map_2d(w.data(), N, w.size(0) * K, 64), p);
  }
  return true;
}

bool grouped_matmul_wgrad(const Tensor& dy, const Tensor& x, std::span<const int64_t> offsets, Tensor& dw, float alpha,
                          float beta) {
  const int64_t M = dy.size(1), N = x.size(1);
  const bool ping = g_ping.load();
  const int bn = ping ? 128 : 256;
  if (!served_operands({&dy, &x}, dw) || M % kBM != 0 || N % bn != 0 || M > (1 << 20) || N > (1 << 20))
    return false;
  if (static_cast<int64_t>(offsets.size()) * M * N >= (int64_t(1) << 40)) return false;
  std::optional<Params> made = base_params(offsets, dw, N, bn, alpha, beta);
  if (!made) return false;
  Params& p = *made;
  p.m = static_cast<int>(M);
  p.m_tiles = static_cast<int>(M / kBM);
  // A group without rows has nothing to add: its tiles run only where beta rescales (or zeroes) it.
  number_tiles(p, [&](int g) { return p.offsets[g + 1] > p.offsets[g] || beta != 1.f ? p.m_tiles * p.n_tiles : 0; });
  if (p.tiles == 0) return true;
  launch<Mode::k_grouped>(ping, map_2d(dy.data(), M, dy.size(0), 64), map_2d(x.data(), N, x.size(0), 64), p);
  return true;
}

void set_ping_pong(bool on) { g_ping.store(on); }

}  // namespace lcx::ops::cuda::grouped_hopper
