#include "ring_merge.h"

#include <cmath>
#include <limits>

namespace lcx::cp_ring {

void merge_partial(Tensor& acc_out, Tensor& acc_lse, int64_t row0, const Tensor& blk_out, const Tensor& blk_lse,
                   bool first) {
  const int64_t T = acc_out.size(0), H = acc_out.size(1), d = acc_out.size(2), n = blk_out.size(0);
  LCX_CHECK(acc_out.dtype() == DType::f32 && acc_lse.dtype() == DType::f32 && blk_lse.dtype() == DType::f32);
  LCX_CHECK(blk_out.size(1) == H && blk_out.size(2) == d && row0 >= 0 && row0 + n <= T);
  LCX_CHECK(acc_lse.numel() == H * T && blk_lse.numel() == H * n);
  if (acc_out.device().is_cuda()) {
#ifdef LCX_CP_RING_CUDA
    merge_partial_cuda(acc_out, acc_lse, row0, blk_out, blk_lse, first);
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
      float* o = ao + ((row0 + i) * H + h) * d;
      const float* b = bo + (i * H + h) * d;
      float& la = al[h * T + row0 + i];
      const float lb = bl[h * n + i];
      if (first) {
        la = lb;
        for (int64_t e = 0; e < d; ++e) o[e] = b[e];
        continue;
      }
      const float m = std::max(la, lb);
      if (m == kNegInf) continue;  // neither part saw a key: the row stays empty
      const float lse = m + std::log(std::exp(la - m) + std::exp(lb - m));
      const float wa = std::exp(la - lse), wb = std::exp(lb - lse);
      for (int64_t e = 0; e < d; ++e) o[e] = wa * o[e] + wb * b[e];
      la = lse;
    }
}

}  // namespace lcx::cp_ring
