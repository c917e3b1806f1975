// copy_columns, CPU reference: one memcpy per row (the op moves bytes; no dtype conversion).
#include <cstring>

#include "kernels/cpu/cpu_ops.h"

namespace lcx::ops::cpu {

void copy_columns(const Tensor& src, int64_t src_col, Tensor& dst, int64_t dst_col, int64_t cols) {
  const size_t es = dtype_size(src.dtype());
  const int64_t rows = src.size(-1) ? src.numel() / src.size(-1) : 0;
  const auto* s = static_cast<const char*>(src.data()) + static_cast<size_t>(src_col) * es;
  auto* d = static_cast<char*>(dst.data()) + static_cast<size_t>(dst_col) * es;
  const size_t sp = static_cast<size_t>(src.size(-1)) * es, dp = static_cast<size_t>(dst.size(-1)) * es;
  for (int64_t r = 0; r < rows; ++r) std::memcpy(d + r * dp, s + r * sp, static_cast<size_t>(cols) * es);
}

}  // namespace lcx::ops::cpu
