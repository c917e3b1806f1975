// The CPU reference of the loader's convert-and-check (kernels/convert_check.h). The check reads
// the stored bits (an all-ones exponent is Inf or NaN), so a tensor already in its dtype is checked
// without widening it.
#include <cstring>

#include "kernels/convert_check.h"
#include "lcx/error.h"

namespace lcx::ops::cpu {
namespace {

template <typename T>
T get(const void* p, int64_t i) {
  T v;
  std::memcpy(&v, static_cast<const char*>(p) + static_cast<size_t>(i) * sizeof(T), sizeof(T));
  return v;
}

float widen(const void* p, StoredFloat from, int64_t i) {
  switch (from) {
    case StoredFloat::f64: return static_cast<float>(get<double>(p, i));
    case StoredFloat::f32: return get<float>(p, i);
    case StoredFloat::f16: return f16_to_float(get<f16>(p, i));
    case StoredFloat::bf16: return bf16_to_float(get<bf16>(p, i));
  }
  return 0.f;
}

int64_t first_not_finite(const void* p, DType t, int64_t n) {
  switch (t) {
    case DType::f32: {
      const auto* u = static_cast<const uint32_t*>(p);
      for (int64_t i = 0; i < n; ++i)
        if ((u[i] & 0x7f800000u) == 0x7f800000u) return i;
      return -1;
    }
    case DType::bf16:
    case DType::f16: {
      const uint16_t mask = t == DType::bf16 ? 0x7f80u : 0x7c00u;
      const auto* u = static_cast<const uint16_t*>(p);
      for (int64_t i = 0; i < n; ++i)
        if ((u[i] & mask) == mask) return i;
      return -1;
    }
    default: LCX_CHECK(false, "convert_check into ", dtype_name(t));
  }
  return -1;
}

bool same_encoding(StoredFloat from, DType to) {
  return (from == StoredFloat::f32 && to == DType::f32) || (from == StoredFloat::bf16 && to == DType::bf16) ||
         (from == StoredFloat::f16 && to == DType::f16);
}

}  // namespace

int64_t convert_check(const void* src, StoredFloat from, void* dst, DType to, int64_t n, bool check) {
  if (same_encoding(from, to)) {
    if (src != dst) std::memcpy(dst, src, static_cast<size_t>(n) * dtype_size(to));
  } else {
    LCX_CHECK(src != dst, "convert_check converts in place only within one encoding");
    switch (to) {
      case DType::f32: {
        auto* d = static_cast<float*>(dst);
        for (int64_t i = 0; i < n; ++i) d[i] = widen(src, from, i);
        break;
      }
      case DType::bf16: {
        auto* d = static_cast<bf16*>(dst);
        for (int64_t i = 0; i < n; ++i) d[i] = float_to_bf16(widen(src, from, i));
        break;
      }
      case DType::f16: {
        auto* d = static_cast<f16*>(dst);
        for (int64_t i = 0; i < n; ++i) d[i] = float_to_f16(widen(src, from, i));
        break;
      }
      default: LCX_CHECK(false, "convert_check into ", dtype_name(to));
    }
  }
  return check ? first_not_finite(dst, to, n) : -1;
}

}  // namespace lcx::ops::cpu
