#include "decoder_init.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <thread>
#include <type_traits>
#include <vector>

#include "lcx/error.h"

namespace lcx::decoder {
namespace {

constexpr uint64_t kGamma = 0x9e3779b97f4a7c15ull;

// SplitMix64's output function.
uint64_t mix(uint64_t z) {
  z += kGamma;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

template <typename T>
void store(T* out, int64_t i, float v) {
  if constexpr (std::is_same_v<T, float>)
    out[i] = v;
  else if constexpr (std::is_same_v<T, bf16>)
    out[i] = float_to_bf16(v);
  else
    out[i] = float_to_f16(v);
}

// ln(u) for u in (0, 1]: u = 2^e m with m in [sqrt(1/2), sqrt(2)), ln m = 2 atanh(t) with
// t = (m - 1) / (m + 1), |t| < 0.172, to t^9 (relative error under 3e-7). Polynomials rather than
// libm, so the numbers are the same under any libm (and a GPU could make them bit for bit).
float ln01(float u) {
  const uint32_t b = std::bit_cast<uint32_t>(u);
  int e = static_cast<int>(b >> 23) - 127;
  float m = std::bit_cast<float>((b & 0x7fffffu) | 0x3f800000u);
  const bool big = m > 1.41421356f;
  m = big ? m * 0.5f : m;
  e += big;
  const float t = (m - 1.f) / (m + 1.f), t2 = t * t;
  const float p = 1.f + t2 * (1.f / 3 + t2 * (1.f / 5 + t2 * (1.f / 7 + t2 * (1.f / 9))));
  return static_cast<float>(e) * 0.693147180559945f + 2.f * t * p;
}

// Pairs [begin, end) of a tensor of n elements. Each pair's 64 bits: 24 for the radius's uniform,
// 2 for the angle's quadrant and 22 for the angle within it (Taylor to x^11 / x^12 on [0, pi/2):
// error under 6e-8).
template <typename T>
void fill_pairs(T* out, int64_t n, uint64_t key, float std, int64_t begin, int64_t end) {
  for (int64_t j = begin; j < end; ++j) {
    const uint64_t h = mix(key + static_cast<uint64_t>(j) * kGamma);
    const float u1 = (static_cast<float>(static_cast<uint32_t>(h >> 40)) + 1.f) * 0x1.0p-24f;  // (0, 1]
    const uint32_t a = static_cast<uint32_t>(h) & 0xffffffu;
    const uint32_t quadrant = a >> 22;
    const float x = static_cast<float>(a & 0x3fffffu) * (1.57079632679f * 0x1.0p-22f), x2 = x * x;
    const float sn =
        x * (1.f + x2 * (-1.f / 6 + x2 * (1.f / 120 + x2 * (-1.f / 5040 + x2 * (1.f / 362880 + x2 * (-1.f / 39916800))))));
    const float cs =
        1.f + x2 * (-0.5f + x2 * (1.f / 24 + x2 * (-1.f / 720 + x2 * (1.f / 40320 + x2 * (-1.f / 3628800 + x2 * (1.f / 479001600))))));
    const float cos_a = quadrant == 0 ? cs : quadrant == 1 ? -sn : quadrant == 2 ? -cs : sn;
    const float sin_a = quadrant == 0 ? sn : quadrant == 1 ? cs : quadrant == 2 ? -sn : -cs;
    const float r = std * std::sqrt(-2.f * ln01(u1));
    store(out, 2 * j, r * cos_a);
    if (2 * j + 1 < n) store(out, 2 * j + 1, r * sin_a);
  }
}

}  // namespace

uint64_t init_key(uint64_t seed, const std::string& name) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a of the name
  for (unsigned char c : name) h = (h ^ c) * 1099511628211ull;
  return mix(seed) ^ h;
}

void fill_normal(Tensor& t, uint64_t key, double std, int threads) {
  const int64_t n = t.numel(), pairs = (n + 1) / 2;
  const int64_t hw = threads > 0 ? threads : std::max(1u, std::thread::hardware_concurrency());
  // A thread for every 2^18 pairs at least: below that, starting one costs more than it saves.
  const int64_t workers = std::clamp<int64_t>(pairs >> 18, 1, hw);
  const float s = static_cast<float>(std);
  auto fill = [&](int64_t begin, int64_t end) {
    switch (t.dtype()) {
      case DType::f32: fill_pairs(t.data_as<float>(), n, key, s, begin, end); break;
      case DType::bf16: fill_pairs(t.data_as<bf16>(), n, key, s, begin, end); break;
      case DType::f16: fill_pairs(t.data_as<f16>(), n, key, s, begin, end); break;
      default: throw Error(str("model init: weights of ", dtype_name(t.dtype()), " are not floating point"));
    }
  };
  if (workers == 1) return fill(0, pairs);
  std::vector<std::thread> pool;
  for (int64_t w = 0; w < workers; ++w) pool.emplace_back(fill, pairs * w / workers, pairs * (w + 1) / workers);
  for (auto& th : pool) th.join();
}

}  // namespace lcx::decoder
