// RMSNorm on the CPU: the transformers Qwen3RMSNorm numerics (fp32 norm, cast, then weight), bf16
// rounding, and the backward against central finite differences.
#include "kernels/kernel_test_util.h"

namespace lcx {
namespace {

using test::rand_tensor;

TEST(RmsnormCpu, ForwardMatchesNaive) {
  const int64_t R = 5, d = 12;
  Tensor x = rand_tensor({R, d}, 1, DType::f32, 2.f), w = rand_tensor({d}, 2);
  Tensor y = Tensor::empty({R, d}, DType::f32), rstd = Tensor::empty({R}, DType::f32);
  ops::rmsnorm_forward(x, w, 1e-6f, y, rstd);
  const auto xv = x.to_floats(), wv = w.to_floats(), yv = y.to_floats(), rv = rstd.to_floats();
  for (int64_t r = 0; r < R; ++r) {
    double ss = 0;
    for (int64_t i = 0; i < d; ++i) ss += double(xv[r * d + i]) * xv[r * d + i];
    const double s = 1 / std::sqrt(ss / d + 1e-6);
    EXPECT_NEAR(rv[r], s, 1e-6 * s);
    for (int64_t i = 0; i < d; ++i) EXPECT_NEAR(yv[r * d + i], wv[i] * xv[r * d + i] * s, 1e-5);
  }
}

TEST(RmsnormCpu, Bf16RoundsTheNormBeforeTheWeight) {
  // transformers: weight * (x * rstd).to(bf16), so the product sees a bf16 h, then rounds again.
  const int64_t R = 8, d = 64;
  Tensor x = rand_tensor({R, d}, 3, DType::bf16, 3.f), w = rand_tensor({d}, 4, DType::bf16, 0.7f);
  Tensor y = Tensor::empty({R, d}, DType::bf16), rstd = Tensor::empty({R}, DType::f32);
  ops::rmsnorm_forward(x, w, 1e-6f, y, rstd);
  const auto xv = x.to_floats(), wv = w.to_floats(), yv = y.to_floats(), rv = rstd.to_floats();
  auto bf = [](float v) { return bf16_to_float(float_to_bf16(v)); };
  int64_t differs_from_single_rounding = 0;
  for (int64_t r = 0; r < R; ++r)
    for (int64_t i = 0; i < d; ++i) {
      const float h = bf(xv[r * d + i] * rv[r]);
      EXPECT_EQ(yv[r * d + i], bf(wv[i] * h)) << "row " << r << " col " << i;
      differs_from_single_rounding += bf(wv[i] * xv[r * d + i] * rv[r]) != yv[r * d + i];
    }
  EXPECT_GT(differs_from_single_rounding, 0) << "the intermediate cast should be visible somewhere";
}

TEST(RmsnormCpu, BackwardMatchesFiniteDifferences) {
  const int64_t R = 4, d = 10;
  Tensor x = rand_tensor({R, d}, 5), w = rand_tensor({d}, 6, DType::f32, 0.5f);
  const auto probe_w = test::randn(R * d, 7);
  Tensor y = Tensor::empty({R, d}, DType::f32), rstd = Tensor::empty({R}, DType::f32);
  ops::rmsnorm_forward(x, w, 1e-5f, y, rstd);
  Tensor dy = Tensor::from_floats(probe_w, {R, d}, DType::f32);
  Tensor dx = Tensor::empty({R, d}, DType::f32);
  Tensor dw = rand_tensor({d}, 8);  // backward accumulates into whatever dw holds
  const auto dw0 = dw.to_floats();
  ops::rmsnorm_backward(x, w, rstd, dy, dx, dw);
  std::vector<float> dw_step = dw.to_floats();
  for (int64_t i = 0; i < d; ++i) dw_step[i] -= dw0[i];
  auto loss = [&] {
    Tensor yy = Tensor::empty({R, d}, DType::f32), rr = Tensor::empty({R}, DType::f32);
    ops::rmsnorm_forward(x, w, 1e-5f, yy, rr);
    return test::probe(yy, probe_w);
  };
  test::expect_grad(x, dx.to_floats(), loss, "rmsnorm dx");
  test::expect_grad(w, dw_step, loss, "rmsnorm dw");
}

TEST(RmsnormCpu, PerHeadRowsAndShapeErrors) {
  // q_norm passes [T, heads, d]: one rstd per (token, head).
  Tensor x = rand_tensor({3, 2, 4}, 9), w = rand_tensor({4}, 10);
  Tensor y = Tensor::empty({3, 2, 4}, DType::f32), rstd = Tensor::empty({6}, DType::f32);
  ops::rmsnorm_forward(x, w, 1e-6f, y, rstd);
  const auto xv = x.to_floats();
  double ss = 0;
  for (int i = 20; i < 24; ++i) ss += double(xv[i]) * xv[i];
  EXPECT_NEAR(rstd.to_floats()[5], 1 / std::sqrt(ss / 4 + 1e-6), 1e-5);
  Tensor bad_w = rand_tensor({5}, 11);
  EXPECT_THROW(ops::rmsnorm_forward(x, bad_w, 1e-6f, y, rstd), Error);
  Tensor bad_rstd = Tensor::empty({3}, DType::f32);
  EXPECT_THROW(ops::rmsnorm_forward(x, w, 1e-6f, y, bad_rstd), Error);
}

}  // namespace
}  // namespace lcx
