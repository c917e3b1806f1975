#include "lcx/dtype.h"

#include <string>

#include "lcx/error.h"

namespace lcx {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::bf16:
    case DType::f16: return 2;
    case DType::f32:
    case DType::i32: return 4;
    case DType::i64: return 8;
  }
  return 0;
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::bf16: return "bf16";
    case DType::f16: return "fp16";
    case DType::f32: return "fp32";
    case DType::i32: return "int32";
    case DType::i64: return "int64";
  }
  return "?";
}

DType dtype_from_name(std::string_view n) {
  if (n == "bf16" || n == "BF16" || n == "bfloat16") return DType::bf16;
  if (n == "fp16" || n == "F16" || n == "float16") return DType::f16;
  if (n == "fp32" || n == "F32" || n == "float32") return DType::f32;
  if (n == "int32" || n == "I32") return DType::i32;
  if (n == "int64" || n == "I64") return DType::i64;
  throw Error(str("unknown dtype '", n, "'"), {}, "use one of bf16, fp16, fp32, int32, int64");
}

float f16_to_float(f16 v) {
  uint32_t sign = (v.bits & 0x8000u) << 16;
  uint32_t exp = (v.bits >> 10) & 0x1f;
  uint32_t man = v.bits & 0x3ffu;
  uint32_t u;
  if (exp == 0) {
    if (man == 0) {
      u = sign;
    } else {  // subnormal: renormalize
      int e = -1;
      do {
        ++e;
        man <<= 1;
      } while (!(man & 0x400u));
      u = sign | static_cast<uint32_t>(127 - 15 - e) << 23 | (man & 0x3ffu) << 13;
    }
  } else if (exp == 31) {
    u = sign | 0x7f800000u | man << 13;
  } else {
    u = sign | (exp + 112) << 23 | man << 13;
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

f16 float_to_f16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  uint32_t exp = (u >> 23) & 0xff;
  uint32_t man = u & 0x7fffffu;
  if (exp == 0xff) return f16{static_cast<uint16_t>(sign | 0x7c00u | (man ? 0x200u : 0))};
  int e = static_cast<int>(exp) - 127 + 15;
  if (e >= 31) return f16{static_cast<uint16_t>(sign | 0x7c00u)};
  if (e <= 0) {  // subnormal or zero, round to nearest even
    if (e < -10) return f16{sign};
    man |= 0x800000u;
    int shift = 14 - e;
    uint32_t half = 1u << (shift - 1);
    uint32_t rest = man & ((1u << shift) - 1);
    uint32_t m = man >> shift;
    if (rest > half || (rest == half && (m & 1))) ++m;
    return f16{static_cast<uint16_t>(sign | m)};
  }
  uint32_t m = man >> 13;
  uint32_t rest = man & 0x1fffu;
  uint32_t out = static_cast<uint32_t>(e) << 10 | m;
  if (rest > 0x1000u || (rest == 0x1000u && (m & 1))) ++out;  // may carry into the exponent
  return f16{static_cast<uint16_t>(sign | out)};
}

}  // namespace lcx
