// Attention sinks (GPT-OSS) on the CPU: attention then ops::attention_sinks_forward equals an
// explicit softmax with one more column per head (logit s_h, value zero); the plain attention
// backward given the sinks' output and LSE, with attention_sinks_backward's sink gradient, equals
// central finite differences of that whole forward; for a head group (head0) with GQA, packed
// documents and a window at once.
#include "kernels/kernel_test_util.h"
#include "support/test_util.h"

namespace lcx {
namespace {

using test::rand_tensor;

constexpr int64_t T = 14, Hq = 4, Hkv = 2, d = 4, kSinks = 7, kHead0 = 2;
const std::vector<int64_t> kDocuments = {0, 9, T};
constexpr int64_t kWindow = 5;

ops::AttentionParams params() {
  ops::AttentionParams p;
  p.scale = 0.5f;
  p.documents = kDocuments;
  p.window = kWindow;
  return p;
}

struct Inputs {
  Tensor q = rand_tensor({T, Hq, d}, 1), k = rand_tensor({T, Hkv, d}, 2), v = rand_tensor({T, Hkv, d}, 3);
  Tensor sinks = rand_tensor({kSinks}, 4, DType::f32, 2.f);
};

void forward(const Inputs& in, Tensor& out, Tensor& lse) {
  ops::attention_forward(in.q, in.k, in.v, out, lse, params());
  ops::attention_sinks_forward(out, lse, in.sinks, kHead0);
}

TEST(AttentionSinksCpu, ForwardIsASoftmaxWithOneMoreColumn) {
  Inputs in;
  Tensor out = Tensor::empty({T, Hq, d}, DType::f32), lse = Tensor::empty({Hq, T}, DType::f32);
  forward(in, out, lse);
  const auto q = in.q.to_floats(), k = in.k.to_floats(), v = in.v.to_floats(), s = in.sinks.to_floats();
  const auto o = out.to_floats(), l = lse.to_floats();
  auto doc = [](int64_t p) { return std::upper_bound(kDocuments.begin(), kDocuments.end(), p) - kDocuments.begin(); };
  for (int64_t h = 0; h < Hq; ++h)
    for (int64_t i = 0; i < T; ++i) {
      const int64_t g = h / (Hq / Hkv);
      std::vector<double> logit;
      std::vector<int64_t> key;
      for (int64_t j = 0; j <= i; ++j) {
        if (j <= i - kWindow || doc(j) != doc(i)) continue;
        double dot = 0;
        for (int64_t e = 0; e < d; ++e) dot += double(q[(i * Hq + h) * d + e]) * k[(j * Hkv + g) * d + e];
        logit.push_back(0.5 * dot);
        key.push_back(j);
      }
      const double sink = s[static_cast<size_t>(kHead0 + h)];
      double sum = std::exp(sink);
      for (double x : logit) sum += std::exp(x);
      EXPECT_NEAR(l[h * T + i], std::log(sum), 1e-5) << "head " << h << " row " << i;
      for (int64_t e = 0; e < d; ++e) {
        double want = 0;
        for (size_t n = 0; n < key.size(); ++n) want += std::exp(logit[n]) / sum * v[(key[n] * Hkv + g) * d + e];
        EXPECT_NEAR(o[(i * Hq + h) * d + e], want, 1e-5) << "head " << h << " row " << i;
      }
    }
}

TEST(AttentionSinksCpu, BackwardMatchesFiniteDifferences) {
  Inputs in;
  const auto w = test::randn(T * Hq * d, 5);
  Tensor out = Tensor::empty({T, Hq, d}, DType::f32), lse = Tensor::empty({Hq, T}, DType::f32);
  forward(in, out, lse);
  const Tensor dout = Tensor::from_floats(w, out.shape(), DType::f32);
  Tensor dq = Tensor::empty(in.q.shape(), DType::f32), dk = Tensor::empty(in.k.shape(), DType::f32),
         dv = Tensor::empty(in.v.shape(), DType::f32);
  Tensor dsinks = Tensor::from_floats(std::vector<float>(kSinks, 0.25f), {kSinks}, DType::f32);
  ops::attention_sinks_backward(out, lse, dout, in.sinks, kHead0, dsinks);
  ops::attention_backward(in.q, in.k, in.v, out, lse, dout, dq, dk, dv, params());
  auto loss = [&] {
    Tensor o = Tensor::empty({T, Hq, d}, DType::f32), l = Tensor::empty({Hq, T}, DType::f32);
    forward(in, o, l);
    return test::probe(o, w);
  };
  test::expect_grad(in.q, dq.to_floats(), loss, "dq");
  test::expect_grad(in.k, dk.to_floats(), loss, "dk");
  test::expect_grad(in.v, dv.to_floats(), loss, "dv");
  // The sinks' gradient accumulates onto what dsinks held (0.25); heads outside the group keep it.
  std::vector<float> ds = dsinks.to_floats();
  for (int64_t h = 0; h < kSinks; ++h) {
    if (h < kHead0 || h >= kHead0 + Hq) {
      EXPECT_EQ(ds[static_cast<size_t>(h)], 0.25f) << "sink " << h;
    }
    ds[static_cast<size_t>(h)] -= 0.25f;
  }
  EXPECT_GT(test::max_abs(ds), 1e-3f);
  test::expect_grad(in.sinks, ds, loss, "dsinks");
}

TEST(AttentionSinksCpu, RowThatSeesNothingTakesTheSinkAlone) {
  Tensor out = Tensor::from_floats(std::vector<float>(2 * 1 * 3, 0.f), {2, 1, 3}, DType::f32);
  Tensor lse = Tensor::from_floats({-INFINITY, 0.f}, {1, 2}, DType::f32);
  const Tensor sinks = Tensor::from_floats({1.5f}, {1}, DType::f32);
  ops::attention_sinks_forward(out, lse, sinks, 0);
  const auto l = lse.to_floats();
  EXPECT_FLOAT_EQ(l[0], 1.5f);
  EXPECT_NEAR(l[1], std::log(1.f + std::exp(1.5f)), 1e-6f);
}

TEST(AttentionSinksCpu, RefusesHeadsPastTheSinks) {
  Tensor out = Tensor::empty({3, 4, 2}, DType::f32), lse = Tensor::empty({4, 3}, DType::f32);
  const Tensor sinks = Tensor::empty({5}, DType::f32);
  EXPECT_NE(test::error_of([&] { ops::attention_sinks_forward(out, lse, sinks, 2); }).find("have no logit"),
            std::string::npos);
}

}  // namespace
}  // namespace lcx
