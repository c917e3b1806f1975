// Mixture-of-experts routing on the CPU: the router's softmax, top-k and renormalization against a
// sort in double precision, the permutation's order (grouped by expert, stable, offsets, inverse),
// the gather and the weighted combine against plain loops, and the refusals. The GPU twin is the
// op table's (tests/gpu/backend_ops_test.cpp).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

#include "lcx/error.h"
#include "lcx/ops.h"
#include "support/moe_routing.h"

namespace lcx {
namespace {

Tensor random_logits(int64_t T, int64_t E, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> n(0.f, 2.f);
  std::vector<float> v(static_cast<size_t>(T * E));
  for (auto& x : v) x = n(rng);
  return Tensor::from_floats(v, {T, E}, DType::f32);
}

TEST(MoeRoute, SoftmaxTopKAndRenormalizationAsTransformers) {
  const int64_t T = 37, E = 11, k = 3;
  const Tensor logits = random_logits(T, E, 1);
  for (bool norm : {false, true}) {
    Tensor w = Tensor::empty({T, k}, DType::f32), ex = Tensor::empty({T, k}, DType::i32), p = Tensor::empty({T, E}, DType::f32);
    ops::moe_route(logits, k, norm, w, ex, &p);
    const std::vector<float> l = logits.to_floats();
    for (int64_t t = 0; t < T; ++t) {
      std::vector<double> prob(static_cast<size_t>(E));
      double m = -INFINITY, sum = 0;
      for (int64_t e = 0; e < E; ++e) m = std::max(m, static_cast<double>(l[static_cast<size_t>(t * E + e)]));
      for (int64_t e = 0; e < E; ++e) sum += prob[static_cast<size_t>(e)] = std::exp(l[static_cast<size_t>(t * E + e)] - m);
      for (auto& x : prob) x /= sum;
      std::vector<int> idx(static_cast<size_t>(E));
      std::iota(idx.begin(), idx.end(), 0);
      std::stable_sort(idx.begin(), idx.end(), [&](int a, int b) { return prob[static_cast<size_t>(a)] > prob[static_cast<size_t>(b)]; });
      double picked = 0;
      for (int64_t j = 0; j < k; ++j) picked += prob[static_cast<size_t>(idx[static_cast<size_t>(j)])];
      for (int64_t j = 0; j < k; ++j) {
        const int e = idx[static_cast<size_t>(j)];
        ASSERT_EQ(ex.data_as<int32_t>()[t * k + j], e) << "token " << t << " choice " << j;
        const double want = norm ? prob[static_cast<size_t>(e)] / picked : prob[static_cast<size_t>(e)];
        EXPECT_NEAR(w.data_as<float>()[t * k + j], want, 1e-6) << t;
      }
      for (int64_t e = 0; e < E; ++e) EXPECT_NEAR(p.data_as<float>()[t * E + e], prob[static_cast<size_t>(e)], 1e-6);
    }
  }
}

TEST(MoePermute, GroupsSlotsByExpertStablyWithOffsetsAndInverse) {
  const int64_t T = 300, k = 4, E = 9;
  Tensor ex = Tensor::empty({T, k}, DType::i32);
  std::mt19937 rng(3);
  for (int64_t s = 0; s < T * k; ++s)
    ex.data_as<int32_t>()[s] = s % 17 == 0 ? 5 : static_cast<int32_t>(rng() % 4);  // experts 6..8 get nothing
  Tensor order = Tensor::empty({T * k}, DType::i32), pos = Tensor::empty({T * k}, DType::i32),
         off = Tensor::empty({E + 1}, DType::i64);
  ops::moe_permute(ex, E, order, pos, off);
  const int32_t* o = order.data_as<int32_t>();
  const int32_t* p = pos.data_as<int32_t>();
  const int64_t* f = off.data_as<int64_t>();
  EXPECT_EQ(f[0], 0);
  EXPECT_EQ(f[E], T * k);
  for (int64_t e = 0; e < E; ++e) {
    int64_t count = 0;
    for (int64_t s = 0; s < T * k; ++s) count += ex.data_as<int32_t>()[s] == e;
    EXPECT_EQ(f[e + 1] - f[e], count) << "expert " << e;
    for (int64_t i = f[e]; i < f[e + 1]; ++i) {
      EXPECT_EQ(ex.data_as<int32_t>()[o[i]], e);
      if (i > f[e]) {
        EXPECT_LT(o[i - 1], o[i]) << "not stable";
      }
    }
  }
  for (int64_t s = 0; s < T * k; ++s) EXPECT_EQ(o[p[s]], s);
  // Every slot to one expert: no slot dropped.
  std::fill(ex.data_as<int32_t>(), ex.data_as<int32_t>() + T * k, 2);
  ops::moe_permute(ex, E, order, pos, off);
  EXPECT_EQ(f[2], 0);
  EXPECT_EQ(f[3], T * k);
}

TEST(MoeCombine, GatherThenCombineIsTheWeightedSumOfEachTokensRows) {
  const int64_t T = 50, k = 2, E = 5, H = 24;
  const test::Routed r = test::route_on_host(random_logits(T, E, 7), k);
  const Tensor &w = r.weights, &order = r.order, &pos = r.position;
  const Tensor x = random_logits(T, H, 9);
  Tensor sorted = Tensor::empty({T * k, H}, DType::f32);
  ops::gather_rows(x, order, k, sorted);
  for (int64_t i = 0; i < T * k; ++i)
    for (int64_t h = 0; h < H; ++h)
      ASSERT_EQ(sorted.data_as<float>()[i * H + h], x.data_as<float>()[(order.data_as<int32_t>()[i] / k) * H + h]);
  // An "expert" that doubles its rows: the combine gives 2 x (sum of weights) x x = 2x.
  Tensor y = Tensor::empty({T * k, H}, DType::f32);
  for (int64_t i = 0; i < T * k * H; ++i) y.data_as<float>()[i] = 2.f * sorted.data_as<float>()[i];
  Tensor out = Tensor::empty({T, H}, DType::f32);
  ops::moe_combine(y, pos, w, out);
  for (int64_t i = 0; i < T * H; ++i) EXPECT_NEAR(out.data_as<float>()[i], 2.f * x.data_as<float>()[i], 1e-5);
}

// L = sum dweights . weights(logits) + sum_t aux . probs_t(logits): moe_route_backward's dlogits
// against central differences, with and without the renormalization.
TEST(MoeRoute, BackwardMatchesFiniteDifferences) {
  const int64_t T = 6, E = 7, k = 3;
  Tensor logits = random_logits(T, E, 11);
  const Tensor dw = random_logits(T, k, 12), aux = random_logits(1, E, 13).view({E});
  for (bool norm : {false, true}) {
    auto loss = [&](const Tensor& l) {
      Tensor w = Tensor::empty({T, k}, DType::f32), ex = Tensor::empty({T, k}, DType::i32), p = Tensor::empty({T, E}, DType::f32);
      ops::moe_route(l, k, norm, w, ex, &p);
      double sum = 0;
      for (int64_t i = 0; i < T * k; ++i) sum += static_cast<double>(dw.data_as<float>()[i]) * w.data_as<float>()[i];
      for (int64_t i = 0; i < T * E; ++i) sum += static_cast<double>(aux.data_as<float>()[i % E]) * p.data_as<float>()[i];
      return sum;
    };
    Tensor w = Tensor::empty({T, k}, DType::f32), ex = Tensor::empty({T, k}, DType::i32), p = Tensor::empty({T, E}, DType::f32);
    ops::moe_route(logits, k, norm, w, ex, &p);
    Tensor dl = Tensor::empty({T, E}, DType::f32);
    ops::moe_route_backward(p, ex, w, dw, norm, &aux, dl);
    for (int64_t i = 0; i < T * E; ++i) {
      const float saved = logits.data_as<float>()[i], h = 1e-3f;
      logits.data_as<float>()[i] = saved + h;
      const double up = loss(logits);
      logits.data_as<float>()[i] = saved - h;
      const double down = loss(logits);
      logits.data_as<float>()[i] = saved;
      EXPECT_NEAR(dl.data_as<float>()[i], (up - down) / (2 * h), 2e-3) << (norm ? "norm " : "") << "logit " << i;
    }
  }
}

// L = sum g . moe_combine(y, weights): dy and dweights against the definition.
TEST(MoeCombine, BackwardIsTheTransposeOfTheCombine) {
  const int64_t T = 20, k = 2, E = 4, H = 8;
  const test::Routed r = test::route_on_host(random_logits(T, E, 21), k);
  const Tensor &w = r.weights, &order = r.order, &pos = r.position;
  const Tensor y = random_logits(T * k, H, 22), g = random_logits(T, H, 23);
  Tensor dy = Tensor::empty({T * k, H}, DType::f32), dw = Tensor::empty({T, k}, DType::f32);
  ops::moe_combine_backward(g, y, order, pos, w, dy, dw);
  const float* G = g.data_as<float>();
  const float* Y = y.data_as<float>();
  for (int64_t i = 0; i < T * k; ++i) {
    const int64_t slot = order.data_as<int32_t>()[i];
    for (int64_t h = 0; h < H; ++h)
      EXPECT_FLOAT_EQ(dy.data_as<float>()[i * H + h], w.data_as<float>()[slot] * G[(slot / k) * H + h]);
  }
  for (int64_t slot = 0; slot < T * k; ++slot) {
    double want = 0;
    for (int64_t h = 0; h < H; ++h) want += static_cast<double>(G[(slot / k) * H + h]) * Y[pos.data_as<int32_t>()[slot] * H + h];
    EXPECT_NEAR(dw.data_as<float>()[slot], want, 1e-5);
  }
}

TEST(MoeRoute, RefusesATopKLargerThanTheExperts) {
  const Tensor logits = random_logits(4, 3, 1);
  Tensor w = Tensor::empty({4, 4}, DType::f32), ex = Tensor::empty({4, 4}, DType::i32);
  try {
    ops::moe_route(logits, 4, true, w, ex, nullptr);
    FAIL() << "top-4 of 3 experts ran";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("k must be in [1, 3]"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace lcx
