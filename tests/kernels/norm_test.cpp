// RMSNorm on the CPU: the transformers Qwen3RMSNorm numerics (fp32 norm, cast, then weight), bf16
// rounding, and the backward against central finite differences; the offset form (Gemma3RMSNorm:
// x * rstd * (1 + w) in fp32, rounded once) likewise.
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

TEST(RmsnormOffsetCpu, ForwardIsGemmasOneRoundingOfXRstdTimesOnePlusW) {
  // transformers' Gemma3RMSNorm: (x.float() * rstd * (1 + w.float())).type_as(x), one rounding.
  const int64_t R = 8, d = 64;
  Tensor x = rand_tensor({R, d}, 21, DType::bf16, 3.f), w = rand_tensor({d}, 22, DType::bf16, 0.3f);
  Tensor y = Tensor::empty({R, d}, DType::bf16), rstd = Tensor::empty({R}, DType::f32);
  ops::rmsnorm_offset_forward(x, w, 1.f, 1e-6f, y, rstd);
  const auto xv = x.to_floats(), wv = w.to_floats(), yv = y.to_floats(), rv = rstd.to_floats();
  auto bf = [](float v) { return bf16_to_float(float_to_bf16(v)); };
  int64_t differs_from_llama_order = 0;
  for (int64_t r = 0; r < R; ++r) {
    double ss = 0;
    for (int64_t i = 0; i < d; ++i) ss += double(xv[r * d + i]) * xv[r * d + i];
    EXPECT_NEAR(rv[r], 1 / std::sqrt(ss / d + 1e-6), 1e-6 * rv[r]);
    for (int64_t i = 0; i < d; ++i) {
      EXPECT_EQ(yv[r * d + i], bf(xv[r * d + i] * rv[r] * (1.f + wv[i]))) << "row " << r << " col " << i;
      differs_from_llama_order += bf((1.f + wv[i]) * bf(xv[r * d + i] * rv[r])) != yv[r * d + i];
    }
  }
  EXPECT_GT(differs_from_llama_order, 0) << "rounding the norm first should differ somewhere";
  // Offset 0 is the weight itself, with the single rounding.
  Tensor y0 = Tensor::empty({R, d}, DType::f32);
  Tensor xf = rand_tensor({R, d}, 23, DType::f32, 2.f), wf = rand_tensor({d}, 24);
  ops::rmsnorm_offset_forward(xf, wf, 0.f, 1e-6f, y0, rstd);
  const auto x0 = xf.to_floats(), w0 = wf.to_floats(), r0 = rstd.to_floats(), o0 = y0.to_floats();
  for (int64_t i = 0; i < d; ++i) EXPECT_EQ(o0[static_cast<size_t>(d + i)], x0[d + i] * r0[1] * w0[i]);
}

TEST(RmsnormOffsetCpu, BackwardMatchesFiniteDifferences) {
  const int64_t R = 4, d = 10;
  Tensor x = rand_tensor({R, d}, 25), w = rand_tensor({d}, 26, DType::f32, 0.5f);
  const auto probe_w = test::randn(R * d, 27);
  Tensor y = Tensor::empty({R, d}, DType::f32), rstd = Tensor::empty({R}, DType::f32);
  ops::rmsnorm_offset_forward(x, w, 1.f, 1e-5f, y, rstd);
  Tensor dy = Tensor::from_floats(probe_w, {R, d}, DType::f32);
  Tensor dx = Tensor::empty({R, d}, DType::f32);
  Tensor dw = rand_tensor({d}, 28);  // backward accumulates into whatever dw holds
  const auto dw0 = dw.to_floats();
  ops::rmsnorm_offset_backward(x, w, 1.f, rstd, dy, dx, dw);
  std::vector<float> dw_step = dw.to_floats();
  for (int64_t i = 0; i < d; ++i) dw_step[i] -= dw0[i];
  auto loss = [&] {
    Tensor yy = Tensor::empty({R, d}, DType::f32), rr = Tensor::empty({R}, DType::f32);
    ops::rmsnorm_offset_forward(x, w, 1.f, 1e-5f, yy, rr);
    return test::probe(yy, probe_w);
  };
  test::expect_grad(x, dx.to_floats(), loss, "rmsnorm_offset dx");
  test::expect_grad(w, dw_step, loss, "rmsnorm_offset dw");
}

}  // namespace
}  // namespace lcx
