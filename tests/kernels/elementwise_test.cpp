// Embedding, rotary, SwiGLU, GeGLU (tanh GELU) and the elementwise ops on the CPU: against naive loops and, for the
// backwards, against central finite differences.
#include "kernels/kernel_test_util.h"

namespace lcx {
namespace {

using test::rand_tensor;

TEST(EmbeddingCpu, ForwardGathersRowsAndConverts) {
  Tensor table = rand_tensor({6, 4}, 1, DType::bf16);
  Tensor ids = Tensor::empty({3}, DType::i32);
  const int32_t id[3] = {5, 0, 5};
  std::copy_n(id, 3, ids.data_as<int32_t>());
  Tensor out = Tensor::empty({3, 4}, DType::f32);
  ops::embedding_forward(ids, table, out);
  const auto t = table.to_floats(), o = out.to_floats();
  for (int r = 0; r < 3; ++r)
    for (int c = 0; c < 4; ++c) EXPECT_EQ(o[r * 4 + c], t[id[r] * 4 + c]);
}

TEST(EmbeddingCpu, BackwardAccumulatesRepeatedIds) {
  Tensor ids = Tensor::empty({4}, DType::i32);
  const int32_t id[4] = {2, 1, 2, 2};
  std::copy_n(id, 4, ids.data_as<int32_t>());
  Tensor g = rand_tensor({4, 3}, 2);
  Tensor table_grad = rand_tensor({4, 3}, 3);
  const auto before = table_grad.to_floats(), gv = g.to_floats();
  ops::embedding_backward(ids, g, table_grad);
  std::vector<float> want = before;
  for (int r = 0; r < 4; ++r)
    for (int c = 0; c < 3; ++c) want[id[r] * 3 + c] += gv[r * 3 + c];
  EXPECT_LT(test::max_diff(table_grad.to_floats(), want), 1e-6f);
  EXPECT_EQ(table_grad.to_floats()[0], before[0]) << "row 0 has no token and must not change";
}

TEST(EmbeddingCpu, RefusesIdsOutsideTheTable) {
  Tensor table = rand_tensor({6, 4}, 4);
  Tensor ids = Tensor::empty({2}, DType::i32);
  ids.data_as<int32_t>()[0] = 1;
  ids.data_as<int32_t>()[1] = 6;
  Tensor out = Tensor::empty({2, 4}, DType::f32);
  EXPECT_THROW(ops::embedding_forward(ids, table, out), Error);
}

// Rotary tables for positions 0..T-1, as a plain rotary embedding with base 10000.
void rope_tables(int64_t T, int64_t d, Tensor& cos, Tensor& sin) {
  cos = Tensor::empty({T, d / 2}, DType::f32);
  sin = Tensor::empty({T, d / 2}, DType::f32);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < d / 2; ++i) {
      const double ang = t * std::pow(10000.0, -2.0 * i / d);
      cos.data_as<float>()[t * d / 2 + i] = static_cast<float>(std::cos(ang));
      sin.data_as<float>()[t * d / 2 + i] = static_cast<float>(std::sin(ang));
    }
}

TEST(RotaryCpu, ForwardIsRotateHalf) {
  const int64_t T = 5, H = 3, d = 8;
  Tensor cos, sin;
  rope_tables(T, d, cos, sin);
  Tensor x = rand_tensor({T, H, d}, 5);
  const auto xv = x.to_floats(), c = cos.to_floats(), s = sin.to_floats();
  ops::rotary_forward(x, cos, sin);
  const auto y = x.to_floats();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < d; ++i) {
        const int64_t base = (t * H + h) * d, f = t * d / 2 + i % (d / 2);
        // rotate_half(x) = cat(-x2, x1); out = x * cos + rotate_half(x) * sin
        const float rot = i < d / 2 ? -xv[base + i + d / 2] : xv[base + i - d / 2];
        EXPECT_NEAR(y[base + i], xv[base + i] * c[f] + rot * s[f], 1e-6f);
      }
}

TEST(RotaryCpu, BackwardMatchesFiniteDifferences) {
  const int64_t T = 4, H = 2, d = 6;
  Tensor cos, sin;
  rope_tables(T, d, cos, sin);
  Tensor x = rand_tensor({T, H, d}, 6);
  const auto w = test::randn(x.numel(), 7);
  Tensor dx = Tensor::from_floats(w, x.shape(), DType::f32);
  ops::rotary_backward(dx, cos, sin);
  auto loss = [&] {
    Tensor y = x.clone();
    ops::rotary_forward(y, cos, sin);
    return test::probe(y, w);
  };
  test::expect_grad(x, dx.to_floats(), loss, "rotary dx");
}

TEST(SwigluCpu, ForwardMatchesNaive) {
  Tensor g = rand_tensor({3, 7}, 8, DType::f32, 3.f), u = rand_tensor({3, 7}, 9);
  Tensor out = Tensor::empty({3, 7}, DType::f32);
  ops::swiglu_forward(g, u, out);
  const auto gv = g.to_floats(), uv = u.to_floats(), o = out.to_floats();
  for (size_t i = 0; i < o.size(); ++i)
    EXPECT_NEAR(o[i], gv[i] / (1 + std::exp(-gv[i])) * uv[i], 1e-5f * (1 + std::abs(o[i])));
}

TEST(SwigluCpu, BackwardMatchesFiniteDifferences) {
  Tensor g = rand_tensor({4, 5}, 10, DType::f32, 2.f), u = rand_tensor({4, 5}, 11);
  const auto w = test::randn(g.numel(), 12);
  Tensor dout = Tensor::from_floats(w, g.shape(), DType::f32);
  Tensor dg = Tensor::empty(g.shape(), DType::f32), du = Tensor::empty(g.shape(), DType::f32);
  ops::swiglu_backward(g, u, dout, dg, du);
  auto loss = [&] {
    Tensor out = Tensor::empty(g.shape(), DType::f32);
    ops::swiglu_forward(g, u, out);
    return test::probe(out, w);
  };
  test::expect_grad(g, dg.to_floats(), loss, "swiglu dgate");
  test::expect_grad(u, du.to_floats(), loss, "swiglu dup");
}

// torch's gelu(approximate="tanh"), written out in double.
double gelu_tanh(double g) { return 0.5 * g * (1 + std::tanh(std::sqrt(2 / M_PI) * (g + 0.044715 * g * g * g))); }

TEST(GegluTanhCpu, ForwardMatchesNaive) {
  Tensor g = rand_tensor({3, 7}, 30, DType::f32, 3.f), u = rand_tensor({3, 7}, 31);
  Tensor out = Tensor::empty({3, 7}, DType::f32);
  ops::geglu_tanh_forward(g, u, out);
  const auto gv = g.to_floats(), uv = u.to_floats(), o = out.to_floats();
  for (size_t i = 0; i < o.size(); ++i) EXPECT_NEAR(o[i], gelu_tanh(gv[i]) * uv[i], 1e-5f * (1 + std::abs(o[i])));
  // gated_forward dispatches by the activation.
  Tensor via = Tensor::empty({3, 7}, DType::f32), silu = Tensor::empty({3, 7}, DType::f32);
  ops::gated_forward(ops::GateActivation::gelu_tanh, g, u, via);
  EXPECT_EQ(via.to_floats(), o);
  ops::gated_forward(ops::GateActivation::silu, g, u, silu);
  EXPECT_NE(silu.to_floats(), o);
}

TEST(GegluTanhCpu, BackwardMatchesFiniteDifferences) {
  Tensor g = rand_tensor({4, 5}, 32, DType::f32, 2.f), u = rand_tensor({4, 5}, 33);
  const auto w = test::randn(g.numel(), 34);
  Tensor dout = Tensor::from_floats(w, g.shape(), DType::f32);
  Tensor dg = Tensor::empty(g.shape(), DType::f32), du = Tensor::empty(g.shape(), DType::f32);
  ops::geglu_tanh_backward(g, u, dout, dg, du);
  auto loss = [&] {
    Tensor out = Tensor::empty(g.shape(), DType::f32);
    ops::geglu_tanh_forward(g, u, out);
    return test::probe(out, w);
  };
  test::expect_grad(g, dg.to_floats(), loss, "geglu_tanh dgate");
  test::expect_grad(u, du.to_floats(), loss, "geglu_tanh dup");
}

TEST(ElementwiseCpu, AddMixedDtypesAndAliasing) {
  Tensor a = rand_tensor({2, 5}, 13, DType::bf16), b = rand_tensor({2, 5}, 14);
  const auto av = a.to_floats(), bv = b.to_floats();
  Tensor out = Tensor::empty({2, 5}, DType::f32);
  ops::add(a, b, out);
  for (size_t i = 0; i < av.size(); ++i) EXPECT_EQ(out.to_floats()[i], av[i] + bv[i]);
  ops::add(a, b, a);  // out aliases a: the sum rounded into bf16
  for (size_t i = 0; i < av.size(); ++i) EXPECT_EQ(a.to_floats()[i], bf16_to_float(float_to_bf16(av[i] + bv[i])));
}

TEST(ElementwiseCpu, AddInplaceAndScale) {
  Tensor acc = rand_tensor({9}, 15), x = rand_tensor({9}, 16, DType::f16);
  const auto av = acc.to_floats(), xv = x.to_floats();
  ops::add_inplace(acc, x);
  ops::scale_inplace(acc, -0.25f);
  for (size_t i = 0; i < av.size(); ++i) EXPECT_FLOAT_EQ(acc.to_floats()[i], (av[i] + xv[i]) * -0.25f);
  Tensor h = Tensor::from_floats({1.f, 3.f}, {2}, DType::bf16);
  ops::scale_inplace(h, 1.f / 3.f);
  EXPECT_EQ(h.to_floats()[1], 1.f);
  EXPECT_EQ(h.to_floats()[0], bf16_to_float(float_to_bf16(1.f / 3.f)));
}

TEST(ElementwiseCpu, CastRoundsToNearestEven) {
  // 1 + 2^-8 is halfway between two bf16 values: ties go to the even one (1.0);
  // 1 + 3 * 2^-8 is halfway too and goes up to 1 + 2^-6.
  Tensor src = Tensor::from_floats({1.f + 0x1p-8f, 1.f + 3 * 0x1p-8f, -2.5f}, {3}, DType::f32);
  Tensor dst = Tensor::empty({3}, DType::bf16);
  ops::cast(src, dst);
  EXPECT_EQ(dst.to_floats(), (std::vector<float>{1.f, 1.f + 0x1p-6f, -2.5f}));
  Tensor back = Tensor::empty({3}, DType::f16);
  ops::cast(dst, back);
  EXPECT_EQ(back.to_floats(), dst.to_floats());
  Tensor wrong = Tensor::empty({4}, DType::f32);
  EXPECT_THROW(ops::cast(src, wrong), Error);
}

TEST(ElementwiseCpu, CopyColumnsGathersAndScattersABlock) {
  // src [2,5] = 0..9; columns [1,3) of each row into columns [2,4) of dst [2,4].
  std::vector<float> v(10);
  for (int i = 0; i < 10; ++i) v[static_cast<size_t>(i)] = static_cast<float>(i);
  for (DType t : {DType::f32, DType::bf16}) {
    const Tensor src = Tensor::from_floats(v, {2, 5}, t);
    Tensor dst = Tensor::zeros({2, 4}, t);
    ops::copy_columns(src, 1, dst, 2, 2);
    EXPECT_EQ(dst.to_floats(), (std::vector<float>{0, 0, 1, 2, 0, 0, 6, 7}));
    Tensor back = Tensor::zeros({2, 5}, t);
    ops::copy_columns(dst, 2, back, 3, 2);
    EXPECT_EQ(back.to_floats(), (std::vector<float>{0, 0, 0, 1, 2, 0, 0, 0, 6, 7}));
  }
  Tensor src = Tensor::zeros({2, 5}, DType::f32), short_rows = Tensor::zeros({3, 4}, DType::f32);
  EXPECT_THROW(ops::copy_columns(src, 0, short_rows, 0, 2), Error);  // row counts differ
  Tensor dst = Tensor::zeros({2, 4}, DType::f32), other = Tensor::zeros({2, 4}, DType::bf16);
  EXPECT_THROW(ops::copy_columns(src, 4, dst, 0, 2), Error);  // past the end of a row
  EXPECT_THROW(ops::copy_columns(src, 0, other, 0, 2), Error);  // dtypes differ
}

}  // namespace
}  // namespace lcx
