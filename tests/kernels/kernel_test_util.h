// Helpers for the kernel tests: seeded random tensors, a scalar probe loss, and a central
// finite-difference check of an op's backward against that loss.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "lcx/ops.h"
#include "lcx/tensor.h"

namespace lcx::test {

inline std::vector<float> randn(int64_t n, uint32_t seed, float scale = 1.f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.f, scale);
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& x : v) x = dist(rng);
  return v;
}

inline Tensor rand_tensor(Shape shape, uint32_t seed, DType dtype = DType::f32, float scale = 1.f) {
  return Tensor::from_floats(randn(shape_numel(shape), seed, scale), shape, dtype);
}

// sum(out * w) in double: the scalar whose gradient with respect to out is w.
inline double probe(const Tensor& out, const std::vector<float>& w) {
  const std::vector<float> o = out.to_floats();
  double s = 0;
  for (size_t i = 0; i < o.size(); ++i) s += static_cast<double>(o[i]) * w[i];
  return s;
}

inline float max_abs(const std::vector<float>& v) {
  float m = 0;
  for (float x : v) m = std::max(m, std::abs(x));
  return m;
}

// Compares `grad` (the analytic d loss / d x) with central differences of loss() at every
// `stride`-th element of the fp32 tensor x. Each difference may be off by 1% of itself plus a
// small floor relative to the largest gradient (fp32 forward passes limit its precision).
inline void expect_grad(Tensor& x, const std::vector<float>& grad, const std::function<double()>& loss,
                        const std::string& what, int64_t stride = 1, float eps = 1e-3f) {
  ASSERT_EQ(x.dtype(), DType::f32);
  ASSERT_EQ(static_cast<int64_t>(grad.size()), x.numel()) << what;
  float* p = x.data_as<float>();
  const double floor = 2e-3 * std::max(max_abs(grad), 1e-3f);
  int64_t checked = 0;
  for (int64_t i = 0; i < x.numel(); i += stride) {
    const float orig = p[i];
    const float hi = orig + eps, lo = orig - eps;
    p[i] = hi;
    const double lp = loss();
    p[i] = lo;
    const double lm = loss();
    p[i] = orig;
    const double num = (lp - lm) / (static_cast<double>(hi) - lo);
    EXPECT_NEAR(num, grad[i], 1e-2 * std::abs(num) + floor) << what << " element " << i;
    ++checked;
  }
  EXPECT_GT(checked, 0) << what;
}

// Largest |a - b| over two equally long vectors.
inline float max_diff(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  float m = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) m = std::max(m, std::abs(a[i] - b[i]));
  return m;
}

}  // namespace lcx::test
