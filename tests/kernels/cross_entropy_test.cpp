// Cross entropy on the CPU: loss against a naive log-softmax, ignored rows, the gradient against
// central finite differences, and refusal of out-of-range targets.
#include "kernels/kernel_test_util.h"
#include "support/test_util.h"

namespace lcx {
namespace {

using test::rand_tensor;

Tensor targets_of(std::vector<int64_t> t) {
  Tensor x = Tensor::empty({static_cast<int64_t>(t.size())}, DType::i64);
  std::copy(t.begin(), t.end(), x.data_as<int64_t>());
  return x;
}

TEST(CrossEntropyCpu, LossAndGradientMatchNaive) {
  const int64_t T = 4, V = 11;
  Tensor logits = rand_tensor({T, V}, 1, DType::f32, 3.f);
  Tensor targets = targets_of({3, -100, 0, 10});
  Tensor dl = rand_tensor({T, V}, 2);  // garbage that must be overwritten
  int64_t valid = -1;
  const double loss = ops::cross_entropy_forward_backward(logits, targets, 0.5, &dl, &valid);
  EXPECT_EQ(valid, 3);
  const auto x = logits.to_floats(), g = dl.to_floats();
  double want = 0;
  for (int64_t t = 0; t < T; ++t) {
    const int64_t y = targets.data_as<int64_t>()[t];
    double sum = 0;
    for (int64_t i = 0; i < V; ++i) sum += std::exp(double(x[t * V + i]));
    for (int64_t i = 0; i < V; ++i) {
      const double grad = y < 0 ? 0 : 0.5 * (std::exp(double(x[t * V + i])) / sum - (i == y));
      EXPECT_NEAR(g[t * V + i], grad, 1e-6) << "row " << t << " col " << i;
    }
    if (y >= 0) want += std::log(sum) - x[t * V + y];
  }
  EXPECT_NEAR(loss, want, 1e-5 * std::abs(want));
}

TEST(CrossEntropyCpu, GradientMatchesFiniteDifferences) {
  const int64_t T = 3, V = 7;
  Tensor logits = rand_tensor({T, V}, 3, DType::f32, 2.f);
  Tensor targets = targets_of({6, 2, -100});
  Tensor dl = Tensor::empty({T, V}, DType::f32);
  ops::cross_entropy_forward_backward(logits, targets, 1.0, &dl, nullptr);
  auto loss = [&] { return ops::cross_entropy_forward_backward(logits, targets, 1.0, nullptr, nullptr); };
  test::expect_grad(logits, dl.to_floats(), loss, "dlogits");
}

TEST(CrossEntropyCpu, Bf16LogitsAndGradient) {
  Tensor logits32 = rand_tensor({2, 300}, 4, DType::f32, 4.f);
  Tensor logits16 = logits32.to(DType::bf16);
  Tensor targets = targets_of({17, 299});
  Tensor dl = Tensor::empty({2, 300}, DType::bf16), dl32 = Tensor::empty({2, 300}, DType::f32);
  const double l16 = ops::cross_entropy_forward_backward(logits16, targets, 1.0, &dl, nullptr);
  const double l32 = ops::cross_entropy_forward_backward(logits16.to(DType::f32), targets, 1.0, &dl32, nullptr);
  EXPECT_DOUBLE_EQ(l16, l32);  // math is fp32 from the same stored values
  const auto a = dl.to_floats(), b = dl32.to_floats();
  for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a[i], bf16_to_float(float_to_bf16(b[i])));
}

TEST(CrossEntropyCpu, RefusesTargetsOutsideTheVocabulary) {
  Tensor logits = rand_tensor({2, 5}, 5);
  EXPECT_THROW(ops::cross_entropy_forward_backward(logits, targets_of({1, 5}), 1.0, nullptr, nullptr), Error);
  EXPECT_THROW(ops::cross_entropy_forward_backward(logits, targets_of({-1, 0}), 1.0, nullptr, nullptr), Error);
  int64_t valid = 0;
  EXPECT_EQ(ops::cross_entropy_forward_backward(logits, targets_of({-100, -100}), 1.0, nullptr, &valid), 0.0);
  EXPECT_EQ(valid, 0);
  // The per-chunk op of the chunked loss refuses them the same way, naming the row.
  Tensor row_loss = Tensor::empty({2}, DType::f32);
  const std::string e = test::error_of([&] { ops::cross_entropy_chunk(logits, targets_of({0, 7}), 1.f, row_loss, nullptr); });
  EXPECT_NE(e.find("target 7 at row 1"), std::string::npos) << e;
  EXPECT_THROW(ops::cross_entropy_chunk(logits, targets_of({-3, 0}), 1.f, row_loss, nullptr), Error);
}

}  // namespace
}  // namespace lcx
