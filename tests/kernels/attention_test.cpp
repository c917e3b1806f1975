// Attention on the CPU against an explicit softmax over the full (small) score matrix, and its
// backward against central finite differences. Covers GQA ratios 1, 2 and 4, causal and full,
// offsets as ring attention uses them (a later query chunk against an earlier key chunk), rows
// that see no key, and T not a multiple of the kernel's key block.
#include "kernels/attention_cut.h"
#include "kernels/kernel_test_util.h"

namespace lcx {
namespace {

using test::rand_tensor;

struct Case {
  int64_t T, S, Hq, Hkv, d;
  bool causal;
  int64_t q_offset = 0, k_offset = 0;
};

std::string name(const Case& c) {
  return str("T=", c.T, " S=", c.S, " Hq=", c.Hq, " Hkv=", c.Hkv, " d=", c.d, c.causal ? " causal" : " full",
             " q_offset=", c.q_offset, " k_offset=", c.k_offset);
}

ops::AttentionParams params(const Case& c, float scale = 0) {
  ops::AttentionParams p;
  p.scale = scale;
  p.causal = c.causal;
  p.q_offset = c.q_offset;
  p.k_offset = c.k_offset;
  return p;
}

// softmax(q k^T * scale + mask) v in double over the whole score row.
void naive_attention(const Tensor& q, const Tensor& k, const Tensor& v, const Case& c, std::vector<float>& out,
                     std::vector<float>& lse) {
  const auto qv = q.to_floats(), kv = k.to_floats(), vv = v.to_floats();
  const double scale = 1 / std::sqrt(double(c.d));
  out.assign(c.T * c.Hq * c.d, 0.f);
  lse.assign(c.Hq * c.T, 0.f);
  for (int64_t h = 0; h < c.Hq; ++h) {
    const int64_t g = h / (c.Hq / c.Hkv);
    for (int64_t i = 0; i < c.T; ++i) {
      std::vector<double> s(c.S, -INFINITY);
      double mx = -INFINITY;
      for (int64_t j = 0; j < c.S; ++j) {
        if (c.causal && c.k_offset + j > c.q_offset + i) continue;
        double dot = 0;
        for (int64_t e = 0; e < c.d; ++e) dot += double(qv[(i * c.Hq + h) * c.d + e]) * kv[(j * c.Hkv + g) * c.d + e];
        s[j] = dot * scale;
        mx = std::max(mx, s[j]);
      }
      if (mx == -INFINITY) {
        lse[h * c.T + i] = -INFINITY;
        continue;
      }
      double sum = 0;
      for (int64_t j = 0; j < c.S; ++j) sum += std::exp(s[j] - mx);
      lse[h * c.T + i] = static_cast<float>(mx + std::log(sum));
      for (int64_t e = 0; e < c.d; ++e) {
        double o = 0;
        for (int64_t j = 0; j < c.S; ++j) o += std::exp(s[j] - mx) / sum * vv[(j * c.Hkv + g) * c.d + e];
        out[(i * c.Hq + h) * c.d + e] = static_cast<float>(o);
      }
    }
  }
}

struct Inputs {
  Tensor q, k, v;
};
Inputs inputs(const Case& c, DType dtype = DType::f32, uint32_t seed = 1) {
  return {rand_tensor({c.T, c.Hq, c.d}, seed, dtype), rand_tensor({c.S, c.Hkv, c.d}, seed + 1, dtype),
          rand_tensor({c.S, c.Hkv, c.d}, seed + 2, dtype)};
}

TEST(AttentionCpu, ForwardMatchesExplicitSoftmax) {
  const Case cases[] = {
      {70, 70, 2, 2, 16, true},                // GQA 1, two key blocks, T not a multiple of 64
      {70, 70, 4, 2, 8, true},                 // GQA 2
      {70, 70, 4, 1, 8, false},                // GQA 4, full attention
      {33, 70, 4, 2, 8, true, 37, 0},          // the last 33 queries of a 70-token sequence
      {40, 40, 2, 1, 8, true, 40, 0},          // ring half block: later queries, earlier keys
      {40, 40, 2, 1, 8, true, 0, 40},          // earlier queries, later keys: nothing visible
      {20, 30, 4, 2, 8, true, 0, 10},          // rows 0..9 see no key
      {20, 30, 4, 4, 8, false, 0, 10},         // offsets do not matter without causal
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(name(c));
    Inputs in = inputs(c);
    Tensor out = Tensor::empty({c.T, c.Hq, c.d}, DType::f32), lse = Tensor::empty({c.Hq, c.T}, DType::f32);
    ops::attention_forward(in.q, in.k, in.v, out, lse, params(c));
    std::vector<float> want_out, want_lse;
    naive_attention(in.q, in.k, in.v, c, want_out, want_lse);
    EXPECT_LT(test::max_diff(out.to_floats(), want_out), 2e-5f);
    const auto got_lse = lse.to_floats();
    for (size_t i = 0; i < want_lse.size(); ++i) {
      if (std::isinf(want_lse[i])) {
        EXPECT_TRUE(std::isinf(got_lse[i]) && got_lse[i] < 0) << "lse row " << i << " = " << got_lse[i];
      } else {
        EXPECT_NEAR(got_lse[i], want_lse[i], 1e-5f) << "lse row " << i;
      }
    }
  }
}

TEST(AttentionCpu, RowThatSeesNothingIsZeroWithMinusInfLse) {
  const Case c{8, 8, 2, 1, 4, true, 0, 5};  // queries 0..4 precede every key
  Inputs in = inputs(c);
  Tensor out = rand_tensor({c.T, c.Hq, c.d}, 9), lse = Tensor::empty({c.Hq, c.T}, DType::f32);
  ops::attention_forward(in.q, in.k, in.v, out, lse, params(c));
  const auto o = out.to_floats(), l = lse.to_floats();
  for (int64_t h = 0; h < c.Hq; ++h)
    for (int64_t i = 0; i < c.T; ++i) {
      EXPECT_EQ(std::isinf(l[h * c.T + i]), i < 5) << "head " << h << " row " << i;
      if (i < 5) {
        for (int64_t e = 0; e < c.d; ++e) EXPECT_EQ(o[(i * c.Hq + h) * c.d + e], 0.f);
      }
    }
}

// A rehearsal's cut (kernels/attention_cut.h): the ops check their arguments as always, write
// zeros and compute nothing; off again, the same call computes.
TEST(AttentionCpu, CutWritesZerosAndStillChecks) {
  const Case c{16, 16, 4, 2, 8, true};
  Inputs in = inputs(c);
  Tensor out = rand_tensor({c.T, c.Hq, c.d}, 3), lse = rand_tensor({c.Hq, c.T}, 4);
  Tensor dout = rand_tensor({c.T, c.Hq, c.d}, 5), dq = rand_tensor({c.T, c.Hq, c.d}, 6);
  Tensor dk = rand_tensor({c.S, c.Hkv, c.d}, 7), dv = rand_tensor({c.S, c.Hkv, c.d}, 8);
  ops::set_attention_cut(true);
  ops::attention_forward(in.q, in.k, in.v, out, lse, params(c));
  ops::attention_backward(in.q, in.k, in.v, out, lse, dout, dq, dk, dv, params(c));
  Tensor wrong = rand_tensor({c.T, c.Hq + 1, c.d}, 9);
  EXPECT_THROW(ops::attention_forward(in.q, in.k, in.v, wrong, lse, params(c)), Error);
  ops::set_attention_cut(false);
  for (const Tensor* t : {&out, &lse, &dq, &dk, &dv})
    for (float x : t->to_floats()) ASSERT_EQ(x, 0.f);
  ops::attention_forward(in.q, in.k, in.v, out, lse, params(c));
  std::vector<float> want_out, want_lse;
  naive_attention(in.q, in.k, in.v, c, want_out, want_lse);
  EXPECT_LT(test::max_diff(out.to_floats(), want_out), 2e-5f);
}

TEST(AttentionCpu, Bf16StorageStaysCloseToFp32) {
  const Case c{50, 50, 4, 2, 16, true};
  Inputs in = inputs(c, DType::bf16);
  Tensor out = Tensor::empty({c.T, c.Hq, c.d}, DType::bf16), lse = Tensor::empty({c.Hq, c.T}, DType::f32);
  ops::attention_forward(in.q, in.k, in.v, out, lse, params(c));
  std::vector<float> want_out, want_lse;
  naive_attention(in.q, in.k, in.v, c, want_out, want_lse);  // from the same bf16 values
  EXPECT_LT(test::max_diff(out.to_floats(), want_out), 1e-2f);  // one bf16 rounding of |out| < 2
  EXPECT_LT(test::max_diff(lse.to_floats(), want_lse), 1e-4f);
}

TEST(AttentionCpu, KeyChunksMergeThroughLse) {
  // What ring attention does: attend to two key chunks separately, then merge with the lses.
  const Case full{30, 60, 4, 2, 8, true, 30, 0};
  Inputs in = inputs(full);
  Tensor out = Tensor::empty({30, 4, 8}, DType::f32), lse = Tensor::empty({4, 30}, DType::f32);
  ops::attention_forward(in.q, in.k, in.v, out, lse, params(full));
  std::vector<std::vector<float>> outs, lses;
  for (int64_t c0 : {0, 30}) {
    Case part = full;
    part.S = 30;
    part.k_offset = c0;
    Tensor k = in.k.rows(c0, c0 + 30), v = in.v.rows(c0, c0 + 30);
    Tensor o = Tensor::empty({30, 4, 8}, DType::f32), l = Tensor::empty({4, 30}, DType::f32);
    ops::attention_forward(in.q, k, v, o, l, params(part));
    outs.push_back(o.to_floats());
    lses.push_back(l.to_floats());
  }
  const auto o = out.to_floats(), l = lse.to_floats();
  for (int64_t h = 0; h < 4; ++h)
    for (int64_t i = 0; i < 30; ++i) {
      const float l0 = lses[0][h * 30 + i], l1 = lses[1][h * 30 + i];
      const float m = std::max(l0, l1), merged = m + std::log(std::exp(l0 - m) + std::exp(l1 - m));
      EXPECT_NEAR(l[h * 30 + i], merged, 1e-5f);
      for (int64_t e = 0; e < 8; ++e) {
        const int64_t at = (i * 4 + h) * 8 + e;
        const float want = std::exp(l0 - merged) * outs[0][at] + std::exp(l1 - merged) * outs[1][at];
        EXPECT_NEAR(o[at], want, 1e-5f);
      }
    }
}

void check_backward(const Case& c, int64_t stride) {
  SCOPED_TRACE(name(c));
  Inputs in = inputs(c, DType::f32, 11);
  const ops::AttentionParams p = params(c, 0.4f);
  const auto w = test::randn(c.T * c.Hq * c.d, 12);
  Tensor out = Tensor::empty({c.T, c.Hq, c.d}, DType::f32), lse = Tensor::empty({c.Hq, c.T}, DType::f32);
  ops::attention_forward(in.q, in.k, in.v, out, lse, p);
  Tensor dout = Tensor::from_floats(w, out.shape(), DType::f32);
  Tensor dq = Tensor::empty(in.q.shape(), DType::f32);
  Tensor dk = Tensor::empty(in.k.shape(), DType::f32), dv = Tensor::empty(in.k.shape(), DType::f32);
  ops::attention_backward(in.q, in.k, in.v, out, lse, dout, dq, dk, dv, p);
  auto loss = [&] {
    Tensor o = Tensor::empty({c.T, c.Hq, c.d}, DType::f32), l = Tensor::empty({c.Hq, c.T}, DType::f32);
    ops::attention_forward(in.q, in.k, in.v, o, l, p);
    return test::probe(o, w);
  };
  test::expect_grad(in.q, dq.to_floats(), loss, "dq", stride);
  test::expect_grad(in.k, dk.to_floats(), loss, "dk", stride);
  test::expect_grad(in.v, dv.to_floats(), loss, "dv", stride);
}

TEST(AttentionCpu, BackwardMatchesFiniteDifferences) {
  check_backward({9, 9, 2, 2, 4, true}, 1);
  check_backward({9, 9, 4, 2, 4, true}, 1);
  check_backward({9, 11, 4, 1, 4, false}, 1);
  check_backward({6, 8, 2, 1, 4, true, 8, 0}, 1);   // ring half block
  check_backward({8, 8, 2, 1, 4, true, 0, 3}, 1);   // rows 0..2 see nothing: their dq is 0
  check_backward({70, 70, 2, 1, 4, true}, 7);       // across the key block boundary
}

TEST(AttentionCpu, RefusesMismatchedHeads) {
  Tensor q = rand_tensor({4, 3, 8}, 1), k = rand_tensor({4, 2, 8}, 2), v = rand_tensor({4, 2, 8}, 3);
  Tensor out = Tensor::empty({4, 3, 8}, DType::f32), lse = Tensor::empty({3, 4}, DType::f32);
  EXPECT_THROW(ops::attention_forward(q, k, v, out, lse, {}), Error);
  Tensor q2 = rand_tensor({4, 4, 8}, 1), out2 = Tensor::empty({4, 4, 8}, DType::f32);
  Tensor bad_lse = Tensor::empty({4, 5}, DType::f32);
  EXPECT_THROW(ops::attention_forward(q2, k, v, out2, bad_lse, {}), Error);
}

}  // namespace
}  // namespace lcx
