// Element types and the bf16/fp16 conversions the CPU reference uses. Conversions round to
// nearest even, as torch's .to(bfloat16) does, so CPU and GPU agree on stored bits.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string_view>

namespace lcx {

enum class DType : uint8_t { bf16, f16, f32, i32, i64 };

size_t dtype_size(DType t);
const char* dtype_name(DType t);
// Accepts lcx names (bf16, fp32...) and safetensors names (BF16, F32, I64...); throws otherwise.
DType dtype_from_name(std::string_view name);
inline bool is_floating(DType t) { return t == DType::bf16 || t == DType::f16 || t == DType::f32; }

struct bf16 {
  uint16_t bits;
};
struct f16 {
  uint16_t bits;
};

inline float bf16_to_float(bf16 v) {
  uint32_t u = static_cast<uint32_t>(v.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline bf16 float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu)) return bf16{static_cast<uint16_t>((u >> 16) | 0x40)};
  u += 0x7fffu + ((u >> 16) & 1u);
  return bf16{static_cast<uint16_t>(u >> 16)};
}

float f16_to_float(f16 v);
f16 float_to_f16(float f);

}  // namespace lcx
