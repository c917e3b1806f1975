// Helpers for the GPU tests: fresh random inputs on every run (the seed is printed on failure),
// NaN-poisoned outputs (an element a kernel forgot to write fails the comparison), and the
// relative L2 error every CUDA op is held to against its CPU twin.
#pragma once
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "lcx/ops.h"
#include "lcx/tensor.h"
#include "support/test_util.h"

namespace lcx::test {

#define LCX_SKIP_WITHOUT_GPU() \
  if (!::lcx::cuda_available()) GTEST_SKIP() << "no CUDA device visible"

inline uint32_t fresh_seed() {
  static std::random_device rd;
  return rd();
}

inline std::vector<float> normal(int64_t n, std::mt19937& rng, float scale = 1.f) {
  std::normal_distribution<float> dist(0.f, scale);
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& x : v) x = dist(rng);
  return v;
}

inline Tensor host_normal(Shape shape, DType t, std::mt19937& rng, float scale = 1.f) {
  return Tensor::from_floats(normal(shape_numel(shape), rng, scale), shape, t);
}

inline Tensor on_gpu(const Tensor& host) { return host.to(Device::cuda()); }

inline Tensor poisoned_gpu(Shape shape, DType t) {
  return Tensor::from_floats(std::vector<float>(static_cast<size_t>(shape_numel(shape)), NAN), shape, t,
                             Device::cuda());
}

// The bar: fp32 <= 1e-5, bf16 (and fp16) <= 1e-2.
inline double tolerance(DType t) { return t == DType::f32 ? 1e-5 : 1e-2; }

#define EXPECT_CLOSE(got, want, dtype)                                                              \
  do {                                                                                              \
    const double lcx_err_ = ::lcx::test::rel_l2(got, want);                                         \
    EXPECT_LE(lcx_err_, ::lcx::test::tolerance(dtype)) << #got " vs " #want " (" << dtype_name(dtype) \
                                                       << "): relative L2 " << lcx_err_;            \
  } while (0)

}  // namespace lcx::test
