#include "qwen3_init.h"

#include <algorithm>
#include <cmath>
#include <numbers>
#include <thread>
#include <type_traits>
#include <vector>

#include "lcx/error.h"

namespace lcx::qwen3 {
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

// Pairs [begin, end) of a tensor of n elements.
template <typename T>
void fill_pairs(T* out, int64_t n, uint64_t key, float std, int64_t begin, int64_t end) {
  constexpr float kTwoPi = 2 * std::numbers::pi_v<float>;
  for (int64_t j = begin; j < end; ++j) {
    const uint64_t h = mix(key + static_cast<uint64_t>(j) * kGamma);
    const float u1 = (static_cast<float>(h >> 40) + 1.f) * 0x1.0p-24f;  // (0, 1]: the log stays finite
    const float u2 = static_cast<float>(h & 0xffffff) * 0x1.0p-24f;    // [0, 1)
    const float r = std * std::sqrt(-2.f * std::log(u1));
    const float a = kTwoPi * u2;
    store(out, 2 * j, r * std::cos(a));
    if (2 * j + 1 < n) store(out, 2 * j + 1, r * std::sin(a));
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
      default: throw Error(str("qwen3 init: weights of ", dtype_name(t.dtype()), " are not floating point"));
    }
  };
  if (workers == 1) return fill(0, pairs);
  std::vector<std::thread> pool;
  for (int64_t w = 0; w < workers; ++w) pool.emplace_back(fill, pairs * w / workers, pairs * (w + 1) / workers);
  for (auto& th : pool) th.join();
}

}  // namespace lcx::qwen3
