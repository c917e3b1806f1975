// The experts' grouped GEMMs on the CPU against a plain triple loop in double: groups of odd sizes,
// empty groups (first, inside and last) and one group holding every row, w either way round,
// alpha/beta, bf16 operands, the weight gradient's beta keeping an empty group's dw, and the
// refusals. The GPU twin is the op table's (tests/gpu/backend_ops_test.cpp).
#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "kernels/kernel_test_util.h"
#include "support/test_util.h"

namespace lcx {
namespace {

using test::rand_tensor;

std::vector<int64_t> offsets_of(const std::vector<int64_t>& sizes) {
  std::vector<int64_t> off{0};
  for (int64_t s : sizes) off.push_back(off.back() + s);
  return off;
}

// y[rows of g] = alpha * x[rows of g] @ op(w[g]) + beta * y0, from the tensors' stored values.
std::vector<float> naive_grouped(const Tensor& x, const Tensor& w, bool trans_w, const std::vector<int64_t>& off,
                                 const std::vector<float>& y0, float alpha, float beta) {
  const std::vector<float> xv = x.to_floats(), wv = w.to_floats();
  const int64_t K = x.size(1), Nout = trans_w ? w.size(1) : w.size(2);
  std::vector<float> y = y0;
  for (size_t g = 0; g + 1 < off.size(); ++g)
    for (int64_t i = off[g]; i < off[g + 1]; ++i)
      for (int64_t j = 0; j < Nout; ++j) {
        double s = 0;
        for (int64_t k = 0; k < K; ++k) {
          const int64_t at = static_cast<int64_t>(g) * Nout * K + (trans_w ? j * K + k : k * Nout + j);
          s += static_cast<double>(xv[i * K + k]) * wv[at];
        }
        y[i * Nout + j] = static_cast<float>(alpha * s + beta * static_cast<double>(y0[i * Nout + j]));
      }
  return y;
}

// dw[g] = alpha * dy[rows of g]^T @ x[rows of g] + beta * dw0[g].
std::vector<float> naive_wgrad(const Tensor& dy, const Tensor& x, const std::vector<int64_t>& off,
                               const std::vector<float>& dw0, float alpha, float beta) {
  const std::vector<float> dv = dy.to_floats(), xv = x.to_floats();
  const int64_t K = x.size(1), Nout = dy.size(1);
  std::vector<float> dw(dw0.size());
  for (size_t g = 0; g + 1 < off.size(); ++g)
    for (int64_t j = 0; j < Nout; ++j)
      for (int64_t k = 0; k < K; ++k) {
        double s = 0;
        for (int64_t i = off[g]; i < off[g + 1]; ++i) s += static_cast<double>(dv[i * Nout + j]) * xv[i * K + k];
        const size_t at = static_cast<size_t>((static_cast<int64_t>(g) * Nout + j) * K + k);
        dw[at] = static_cast<float>(alpha * s + (beta == 0.f ? 0.0 : beta * static_cast<double>(dw0[at])));
      }
  return dw;
}

// Odd sizes with empty groups first, inside and last; one group holding every row between empty ones.
const std::vector<std::vector<int64_t>> kGroupSizes = {{0, 5, 1, 0, 13, 2, 0}, {0, 0, 21, 0}};

TEST(GroupedMatmulCpu, EachGroupTimesItsOwnMatrixMatchesTheTripleLoop) {
  const int64_t K = 9, Nout = 7;
  for (const auto& sizes : kGroupSizes)
    for (bool trans_w : {true, false})
      for (auto [alpha, beta] : {std::pair{1.f, 0.f}, std::pair{0.5f, 2.f}}) {
        const std::vector<int64_t> off = offsets_of(sizes);
        const auto G = static_cast<int64_t>(sizes.size());
        const int64_t N = off.back();
        const Tensor x = rand_tensor({N, K}, 1);
        const Tensor w = rand_tensor(trans_w ? Shape{G, Nout, K} : Shape{G, K, Nout}, 2);
        Tensor y = rand_tensor({N, Nout}, 3);
        const std::vector<float> y0 = y.to_floats();
        ops::grouped_matmul(x, w, trans_w, off, y, alpha, beta);
        EXPECT_LT(test::max_diff(y.to_floats(), naive_grouped(x, w, trans_w, off, y0, alpha, beta)), 1e-4f)
            << G << " groups, trans_w=" << trans_w << " alpha=" << alpha << " beta=" << beta;
      }
}

// bf16 operands accumulate in fp32: into fp32 y the triple loop's value, into bf16 y that value
// rounded once (within half a bf16 step).
TEST(GroupedMatmulCpu, Bf16OperandsIntoFp32AndBf16) {
  const int64_t K = 16, Nout = 8;
  const std::vector<int64_t> off = offsets_of(kGroupSizes[0]);
  const auto G = static_cast<int64_t>(kGroupSizes[0].size());
  const int64_t N = off.back();
  const Tensor x = rand_tensor({N, K}, 4, DType::bf16), w = rand_tensor({G, Nout, K}, 5, DType::bf16);
  const std::vector<float> zeros(static_cast<size_t>(N * Nout));
  const std::vector<float> want = naive_grouped(x, w, true, off, zeros, 1.f, 0.f);
  Tensor y32 = Tensor::empty({N, Nout}, DType::f32), y16 = Tensor::empty({N, Nout}, DType::bf16);
  ops::grouped_matmul(x, w, true, off, y32);
  ops::grouped_matmul(x, w, true, off, y16);
  EXPECT_LT(test::max_diff(y32.to_floats(), want), 1e-4f);
  const std::vector<float> got16 = y16.to_floats();
  for (size_t i = 0; i < want.size(); ++i)
    EXPECT_NEAR(got16[i], want[i], 1e-6f + std::abs(want[i]) / 256) << "element " << i;
}

TEST(GroupedMatmulWgradCpu, SumsEachGroupsRowsAndLeavesBetaTimesDwOnEmptyGroups) {
  const int64_t K = 6, Nout = 5;
  for (const auto& sizes : kGroupSizes)
    for (auto [alpha, beta] : {std::pair{1.f, 1.f}, std::pair{0.5f, 0.f}, std::pair{2.f, 0.25f}}) {
      const std::vector<int64_t> off = offsets_of(sizes);
      const auto G = static_cast<int64_t>(sizes.size());
      const int64_t N = off.back();
      const Tensor dy = rand_tensor({N, Nout}, 6), x = rand_tensor({N, K}, 7);
      // beta = 0 must not read dw: a NaN start stays out of the result.
      Tensor dw = beta == 0.f ? Tensor::from_floats(std::vector<float>(static_cast<size_t>(G * Nout * K), NAN),
                                                    {G, Nout, K}, DType::f32)
                              : rand_tensor({G, Nout, K}, 8);
      const std::vector<float> dw0 = dw.to_floats();
      ops::grouped_matmul_wgrad(dy, x, off, dw, alpha, beta);
      const std::vector<float> got = dw.to_floats(), want = naive_wgrad(dy, x, off, dw0, alpha, beta);
      EXPECT_LT(test::max_diff(got, want), 1e-4f) << G << " groups, alpha=" << alpha << " beta=" << beta;
      for (size_t g = 0; g < sizes.size(); ++g) {
        if (sizes[g] != 0) continue;
        for (int64_t i = 0; i < Nout * K; ++i) {
          const size_t at = g * static_cast<size_t>(Nout * K) + static_cast<size_t>(i);
          ASSERT_EQ(got[at], beta == 0.f ? 0.f : beta * dw0[at]) << "empty group " << g << " element " << i;
        }
      }
    }
}

TEST(GroupedMatmulWgradCpu, Bf16OperandsIntoFp32AndBf16) {
  const int64_t K = 8, Nout = 4;
  const std::vector<int64_t> off = offsets_of(kGroupSizes[0]);
  const auto G = static_cast<int64_t>(kGroupSizes[0].size());
  const int64_t N = off.back();
  const Tensor dy = rand_tensor({N, Nout}, 9, DType::bf16), x = rand_tensor({N, K}, 10, DType::bf16);
  Tensor dw32 = rand_tensor({G, Nout, K}, 11), dw16 = dw32.to(DType::bf16);
  const std::vector<float> want32 = naive_wgrad(dy, x, off, dw32.to_floats(), 1.f, 1.f);
  const std::vector<float> want16 = naive_wgrad(dy, x, off, dw16.to_floats(), 1.f, 1.f);
  ops::grouped_matmul_wgrad(dy, x, off, dw32);
  ops::grouped_matmul_wgrad(dy, x, off, dw16);
  EXPECT_LT(test::max_diff(dw32.to_floats(), want32), 1e-4f);
  const std::vector<float> got16 = dw16.to_floats();
  for (size_t i = 0; i < want16.size(); ++i)
    EXPECT_NEAR(got16[i], want16[i], 1e-5f + std::abs(want16[i]) / 256) << "element " << i;
}

// What f throws holds every one of `parts`.
void expect_refusal(const std::function<void()>& f, const std::vector<std::string>& parts) {
  const std::string m = test::error_of(f);
  for (const std::string& p : parts) EXPECT_NE(m.find(p), std::string::npos) << "no \"" << p << "\" in: " << m;
}

TEST(GroupedMatmul, RefusesOffsetsThatDoNotCoverTheRowsOrTheGroups) {
  const Tensor x = rand_tensor({10, 4}, 12), w = rand_tensor({3, 5, 4}, 13), dy = rand_tensor({10, 5}, 14);
  Tensor y = Tensor::empty({10, 5}, DType::f32), dw = Tensor::zeros({3, 5, 4}, DType::f32);
  const std::vector<int64_t> short_of_n{0, 2, 5, 9}, two_groups{0, 4, 10}, falling{0, 6, 4, 10};
  expect_refusal([&] { ops::grouped_matmul(x, w, true, short_of_n, y); },
                 {"grouped_matmul", "offsets", "to 9", "10 rows of x"});
  expect_refusal([&] { ops::grouped_matmul(x, w, true, two_groups, y); },
                 {"grouped_matmul", "offsets holds 3 entries", "w fp32[3, 5, 4]", "G+1 = 4"});
  expect_refusal([&] { ops::grouped_matmul(x, w, true, falling, y); }, {"offsets[2] = 4", "offsets[1] = 6"});
  expect_refusal([&] { ops::grouped_matmul_wgrad(dy, x, short_of_n, dw); },
                 {"grouped_matmul_wgrad", "offsets", "10 rows of x"});
  expect_refusal([&] { ops::grouped_matmul_wgrad(dy, x, two_groups, dw); },
                 {"grouped_matmul_wgrad", "dw fp32[3, 5, 4]", "G+1 = 4"});
  // w's K against x's, either way round.
  expect_refusal([&] { ops::grouped_matmul(x, w, false, std::vector<int64_t>{0, 2, 5, 10}, y); },
                 {"inner dimensions", "w fp32[3, 5, 4] as [G,K,Nout]"});
}

}  // namespace
}  // namespace lcx
