#include "ring_merge.h"

#include <cmath>
#include <limits>

namespace lcx::cp_ring {

namespace {

void merge(Tensor& acc_out, Tensor& acc_lse, const Tensor& blk_out, const Tensor& blk_lse, const MergeRows& m) {
  const int64_t T = acc_out.size(0), H = acc_out.size(1), d = acc_out.size(2), n = m.n;
  LCX_CHECK(acc_out.dtype() == DType::f32 && acc_lse.dtype() == DType::f32 && blk_lse.dtype() == DType::f32);
  LCX_CHECK(blk_out.size(1) == H && blk_out.size(2) == d && m.row0 >= 0 && m.row0 + n <= T);
  LCX_CHECK(m.blk_row0 >= 0 && m.blk_row0 + n <= blk_out.size(0) && m.blk_row0 + n <= m.blk_T);
  LCX_CHECK(acc_lse.numel() == H * T && blk_lse.numel() == H * m.blk_T);
  if (acc_out.device().is_cuda()) {
#ifdef LCX_CP_RING_CUDA
    merge_cuda(acc_out, acc_lse, blk_out, blk_lse, m);
    return;
#else
    throw Error("cp_ring was built without CUDA but was handed GPU tensors", {},
                "rebuild lcx with CUDA (LCX_CUDA=ON) so the plugin gets its kernels");
#endif
  }
  const Tensor blk = blk_out.dtype() == DType::f32 ? blk_out : blk_out.to(DType::f32);
  float* ao = acc_out.data_as<float>();
  float* al = acc_lse.data_as<float>();
  const float* bo = blk.data_as<const float>();
  const float* bl = blk_lse.data_as<const float>();
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < n; ++i)
    for (int64_t h = 0; h < H; ++h) {
      float* o = ao + ((m.row0 + i) * H + h) * d;
      const float* b = bo + ((m.blk_row0 + i) * H + h) * d;
      float& la = al[h * T + m.row0 + i];
      const float lb = bl[h * m.blk_T + m.blk_row0 + i];
      if (m.first) {
        la = lb;
        for (int64_t e = 0; e < d; ++e) o[e] = b[e];
        continue;
      }
      const float mx = std::max(la, lb);
      if (mx == kNegInf) continue;  // neither part saw a key: the row stays empty
      const float lse = mx + std::log(std::exp(la - mx) + std::exp(lb - mx));
      const float wa = std::exp(la - lse), wb = std::exp(lb - lse);
      for (int64_t e = 0; e < d; ++e) o[e] = wa * o[e] + wb * b[e];
      la = lse;
    }
}

}  // namespace

void merge_partial(Tensor& acc_out, Tensor& acc_lse, int64_t row0, const Tensor& blk_out, const Tensor& blk_lse,
                   bool first) {
  const int64_t n = blk_out.size(0);
  merge(acc_out, acc_lse, blk_out, blk_lse, MergeRows{row0, 0, n, n, first});
}

void merge_rows(Tensor& acc_out, Tensor& acc_lse, const Tensor& blk_out, const Tensor& blk_lse, int64_t row0,
                int64_t n, bool first) {
  merge(acc_out, acc_lse, blk_out, blk_lse, MergeRows{row0, row0, blk_out.size(0), n, first});
}

}  // namespace lcx::cp_ring
