// matmul on the CPU: every transpose combination, alpha/beta, mixed dtypes, and bf16 rounding.
#include "kernels/kernel_test_util.h"

namespace lcx {
namespace {

using test::rand_tensor;

// Naive c = alpha * op(a) @ op(b) + beta * c0 in double, from the tensors' stored values.
std::vector<float> naive_matmul(const Tensor& a, bool ta, const Tensor& b, bool tb, const std::vector<float>& c0,
                                int64_t M, int64_t N, int64_t K, float alpha, float beta) {
  const std::vector<float> av = a.to_floats(), bv = b.to_floats();
  std::vector<float> c(static_cast<size_t>(M * N));
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      double s = 0;
      for (int64_t k = 0; k < K; ++k) {
        const double x = ta ? av[k * M + i] : av[i * K + k];
        const double y = tb ? bv[j * K + k] : bv[k * N + j];
        s += x * y;
      }
      c[i * N + j] = static_cast<float>(alpha * s + beta * c0[i * N + j]);
    }
  return c;
}

TEST(MatmulCpu, TransposesAlphaBetaMatchNaive) {
  const int64_t M = 7, N = 5, K = 9;
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      Tensor a = rand_tensor(ta ? Shape{K, M} : Shape{M, K}, 1);
      Tensor b = rand_tensor(tb ? Shape{N, K} : Shape{K, N}, 2);
      Tensor c = rand_tensor({M, N}, 3);
      const std::vector<float> c0 = c.to_floats();
      ops::matmul(a, ta, b, tb, c, 0.5f, 2.f);
      const auto want = naive_matmul(a, ta, b, tb, c0, M, N, K, 0.5f, 2.f);
      EXPECT_LT(test::max_diff(c.to_floats(), want), 1e-4f) << "trans_a=" << ta << " trans_b=" << tb;
    }
}

TEST(MatmulCpu, BetaZeroIgnoresGarbageInC) {
  Tensor a = rand_tensor({3, 4}, 4), b = rand_tensor({4, 2}, 5);
  Tensor c = Tensor::from_floats(std::vector<float>(6, NAN), {3, 2}, DType::f32);
  ops::matmul(a, false, b, false, c);
  const auto want = naive_matmul(a, false, b, false, std::vector<float>(6, 0.f), 3, 2, 4, 1.f, 0.f);
  EXPECT_LT(test::max_diff(c.to_floats(), want), 1e-5f);
}

TEST(MatmulCpu, FoldsLeadingDimensionsIntoRows) {
  Tensor a = rand_tensor({2, 3, 4}, 6), b = rand_tensor({5, 4}, 7);  // [6,4] @ [5,4]^T
  Tensor c = Tensor::empty({2, 3, 5}, DType::f32);
  ops::matmul(a, false, b, true, c);
  const auto want = naive_matmul(a, false, b, true, std::vector<float>(30, 0.f), 6, 5, 4, 1.f, 0.f);
  EXPECT_LT(test::max_diff(c.to_floats(), want), 1e-5f);
}

TEST(MatmulCpu, Bf16OperandsAccumulateIntoFp32) {
  // The loss's grad_head pattern: bf16 inputs, fp32 output accumulated with beta = 1.
  const int64_t M = 6, N = 4, K = 33;
  Tensor a = rand_tensor({K, M}, 8, DType::bf16), b = rand_tensor({K, N}, 9, DType::bf16);
  Tensor c = rand_tensor({M, N}, 10);
  const std::vector<float> c0 = c.to_floats();
  ops::matmul(a, true, b, false, c, 1.f, 1.f);
  const auto want = naive_matmul(a, true, b, false, c0, M, N, K, 1.f, 1.f);
  EXPECT_LT(test::max_diff(c.to_floats(), want), 1e-4f);
}

TEST(MatmulCpu, Bf16OutputIsTheFp32ResultRoundedOnce) {
  const int64_t M = 9, N = 11, K = 17;
  Tensor a = rand_tensor({M, K}, 11, DType::bf16), b = rand_tensor({N, K}, 12, DType::bf16);
  Tensor c16 = rand_tensor({M, N}, 13, DType::bf16);
  Tensor c32 = c16.to(DType::f32);
  ops::matmul(a, false, b, true, c16, 1.5f, -1.f);
  ops::matmul(a, false, b, true, c32, 1.5f, -1.f);
  const std::vector<float> got = c16.to_floats(), full = c32.to_floats();
  int64_t inexact = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i], bf16_to_float(float_to_bf16(full[i]))) << "element " << i;
    inexact += got[i] != full[i];
  }
  EXPECT_GT(inexact, 0) << "the products should need rounding to bf16";
}

TEST(MatmulCpu, EmptyInnerDimensionScalesC) {
  Tensor a = Tensor::empty({3, 0}, DType::f32), b = Tensor::empty({0, 2}, DType::f32);
  Tensor c = Tensor::from_floats({1, 2, 3, 4, 5, 6}, {3, 2}, DType::f32);
  ops::matmul(a, false, b, false, c, 1.f, 2.f);
  EXPECT_EQ(c.to_floats(), (std::vector<float>{2, 4, 6, 8, 10, 12}));
}

TEST(MatmulCpu, ShapeMismatchNamesOpAndShapes) {
  Tensor a = rand_tensor({3, 4}, 14), b = rand_tensor({5, 2}, 15), c = Tensor::empty({3, 2}, DType::f32);
  try {
    ops::matmul(a, false, b, false, c);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("matmul"), std::string::npos) << m;
    EXPECT_NE(m.find("[3, 4]"), std::string::npos) << m;
    EXPECT_NE(m.find("[5, 2]"), std::string::npos) << m;
  }
  Tensor bad_c = Tensor::empty({2, 2}, DType::f32), b2 = rand_tensor({4, 2}, 16);
  EXPECT_THROW(ops::matmul(a, false, b2, false, bad_c), Error);
}

}  // namespace
}  // namespace lcx
