// Gathers and scatters of documents' rows for the padded cuDNN batches (document_pack.h): one block
// per padded row (grid-stride over the rows), its threads over the row's 16-byte words.
#include "kernels/attention/cudnn/document_pack.h"
#include "kernels/cuda/common.cuh"

namespace lcx::ops::cuda {
namespace {

constexpr int kThreads = 256;

// pack: dst row (b, s) = src row starts[b] + s, or zero past lens[b]. unpack: the reverse for the
// real rows only.
template <bool kPack>
__global__ void move_rows(const uint4* src, uint4* dst, const int32_t* starts, const int32_t* lens, int64_t rows,
                          int64_t S, int64_t words) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const int64_t b = r / S, s = r % S;
    const bool real = s < lens[b];
    if (!kPack && !real) continue;
    const int64_t packed = static_cast<int64_t>(starts[b]) + s;
    for (int64_t w = threadIdx.x; w < words; w += blockDim.x) {
      if (kPack)
        dst[r * words + w] = real ? src[packed * words + w] : make_uint4(0, 0, 0, 0);
      else
        dst[packed * words + w] = src[r * words + w];
    }
  }
}

// stats[b, h, s] <-> lse[h, starts[b] + s] for s < lens[b]; pack writes zero past lens[b].
template <bool kPack>
__global__ void move_lse(const float* src, float* dst, const int32_t* starts, const int32_t* lens, int64_t B,
                         int64_t H, int64_t S, int64_t T) {
  const int64_t n = B * H * S;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t s = i % S, h = (i / S) % H, b = i / (S * H);
    const bool real = s < lens[b];
    const int64_t packed = h * T + starts[b] + s;
    if (kPack)
      dst[i] = real ? src[packed] : 0.f;
    else if (real)
      dst[packed] = src[i];
  }
}

template <bool kPack>
void rows(const Tensor& src, Tensor& dst, const int32_t* starts, const int32_t* lens, int64_t B, int64_t S) {
  const Tensor& padded = kPack ? dst : src;
  const int64_t words = static_cast<int64_t>(padded.nbytes()) / 16 / (B * S);
  if (B * S == 0 || words == 0) return;
  const unsigned grid = static_cast<unsigned>(lcx::cuda::lmin(B * S, 65535LL * 16));
  move_rows<kPack><<<grid, kThreads, 0, lcx::cuda::current_stream()>>>(
      static_cast<const uint4*>(src.data()), static_cast<uint4*>(dst.data()), starts, lens, B * S, S, words);
  LCX_CUDA_LAUNCH_CHECK();
}

template <bool kPack>
void lse_rows(const Tensor& src, Tensor& dst, const int32_t* starts, const int32_t* lens, int64_t B, int64_t S) {
  const Tensor& lse = kPack ? src : dst;
  const int64_t H = lse.size(0), T = lse.size(1);
  if (B * H * S == 0) return;
  move_lse<kPack><<<lcx::cuda::grid_for(B * H * S, kThreads), kThreads, 0, lcx::cuda::current_stream()>>>(
      src.data_as<const float>(), dst.data_as<float>(), starts, lens, B, H, S, T);
  LCX_CUDA_LAUNCH_CHECK();
}

}  // namespace

void pack_documents(const Tensor& src, Tensor& dst, const int32_t* starts, const int32_t* lens, int64_t B, int64_t S) {
  rows<true>(src, dst, starts, lens, B, S);
}
void unpack_documents(const Tensor& src, Tensor& dst, const int32_t* starts, const int32_t* lens, int64_t B,
                      int64_t S) {
  rows<false>(src, dst, starts, lens, B, S);
}
void pack_lse(const Tensor& lse, Tensor& stats, const int32_t* starts, const int32_t* lens, int64_t B, int64_t S) {
  lse_rows<true>(lse, stats, starts, lens, B, S);
}
void unpack_lse(const Tensor& stats, Tensor& lse, const int32_t* starts, const int32_t* lens, int64_t B, int64_t S) {
  lse_rows<false>(stats, lse, starts, lens, B, S);
}

}  // namespace lcx::ops::cuda
