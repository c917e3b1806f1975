// What the benchmark binaries share: comma-separated lists on the command line, a device barrier
// around the host clock, and cheap random inputs (their distribution does not change a GEMM's, a
// softmax's or an attention kernel's speed, and benchmarks fill billions of values).
#pragma once
#include <cmath>
#include <cstdint>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "lcx/tensor.h"

namespace lcx::bench {

inline std::vector<int64_t> parse_list(const std::string& s) {
  std::vector<int64_t> v;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, ',');)
    if (!item.empty()) v.push_back(std::stoll(item));
  return v;
}

// The host waits for every queued kernel, so the clock around a call measures the device's work.
inline void sync(Device d) {
  if (d.is_cuda()) backend_for(d)->synchronize();
}

// Uniform values in [-half_width, half_width) from a xorshift stream picked by `seed`.
inline Tensor random_uniform(Shape shape, DType t, Device d, float half_width, uint64_t seed) {
  std::vector<float> v(static_cast<size_t>(shape_numel(shape)));
  uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
  const float k = half_width / static_cast<float>(1u << 23);
  for (auto& x : v) {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    x = static_cast<float>(static_cast<int64_t>(s >> 40) - (1 << 23)) * k;
  }
  return Tensor::from_floats(v, std::move(shape), t, d);
}

}  // namespace lcx::bench
