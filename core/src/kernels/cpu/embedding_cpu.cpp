// Embedding lookup, CPU reference: out[t] = table[ids[t]] (a row copy, converted when the dtypes
// differ). Backward scatters grad_out rows into grad_table rows, accumulating: a token id that
// appears several times receives the sum of its rows. ids are range-checked by ops.cpp.
#include <cstring>

#include "kernels/cpu/cpu_ops.h"

namespace lcx::ops::cpu {

void embedding_forward(const Tensor& ids, const Tensor& table, Tensor& out) {
  const int64_t T = ids.numel(), H = table.size(1);
  const int32_t* id = ids.data_as<const int32_t>();
  const size_t row_bytes = static_cast<size_t>(H) * dtype_size(table.dtype());
  std::vector<float> row(H);
  for (int64_t t = 0; t < T; ++t) {
    if (out.dtype() == table.dtype()) {
      std::memcpy(static_cast<char*>(out.data()) + t * row_bytes,
                  static_cast<const char*>(table.data()) + id[t] * row_bytes, row_bytes);
    } else {
      load_f32(table, id[t] * H, H, row.data());
      store_f32(row.data(), H, out, t * H);
    }
  }
}

void embedding_backward(const Tensor& ids, const Tensor& grad_out, Tensor& grad_table) {
  const int64_t T = ids.numel(), H = grad_table.size(1);
  const int32_t* id = ids.data_as<const int32_t>();
  std::vector<float> g(H), acc(H);
  for (int64_t t = 0; t < T; ++t) {
    load_f32(grad_out, t * H, H, g.data());
    load_f32(grad_table, id[t] * H, H, acc.data());
    for (int64_t i = 0; i < H; ++i) acc[i] += g[i];
    store_f32(acc.data(), H, grad_table, id[t] * H);
  }
}

}  // namespace lcx::ops::cpu
