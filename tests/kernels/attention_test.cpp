// Attention on the CPU against an explicit softmax over the full (small) score matrix, and its
// backward against central finite differences. Covers GQA ratios 1, 2 and 4, causal and full,
// offsets as ring attention uses them (a later query chunk against an earlier key chunk), rows
// that see no key, T not a multiple of the kernel's key block, and document masks (packed
// documents: a query sees only its own document's keys), with offsets too; and a rehearsal's cut.
#include "kernels/attention_table.h"
#include "kernels/kernel_test_util.h"
#include "support/test_util.h"

namespace lcx {
namespace {

using test::rand_tensor;

struct Case {
  int64_t T, S, Hq, Hkv, d;
  bool causal;
  int64_t q_offset = 0, k_offset = 0;
  std::vector<int64_t> documents = {};  // cumulative bounds over positions; empty: one document
  int64_t window = 0;                   // > 0: a query sees the keys at positions > its own - window
};

// The document holding `pos`: the count of bounds at or before it.
int64_t document_of(const std::vector<int64_t>& bounds, int64_t pos) {
  return std::upper_bound(bounds.begin(), bounds.end(), pos) - bounds.begin();
}

std::string name(const Case& c) {
  return str("T=", c.T, " S=", c.S, " Hq=", c.Hq, " Hkv=", c.Hkv, " d=", c.d, c.causal ? " causal" : " full",
             " q_offset=", c.q_offset, " k_offset=", c.k_offset, " documents=", c.documents.size(), " window=", c.window);
}

ops::AttentionParams params(const Case& c, float scale = 0) {
  ops::AttentionParams p;
  p.scale = scale;
  p.causal = c.causal;
  p.q_offset = c.q_offset;
  p.k_offset = c.k_offset;
  p.documents = c.documents;
  p.window = c.window;
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
        if (c.window > 0 && c.k_offset + j <= c.q_offset + i - c.window) continue;
        if (!c.documents.empty() &&
            document_of(c.documents, c.k_offset + j) != document_of(c.documents, c.q_offset + i))
          continue;
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
      {150, 150, 4, 2, 8, true, 0, 0, {0, 1, 70, 71, 150}},  // one-token documents, blocks crossed
      {150, 150, 2, 1, 8, false, 0, 0, {0, 80, 150}},        // full attention within each document
      {30, 60, 4, 2, 8, true, 30, 0, {0, 20, 45, 60}},       // ring half block: later queries
      {20, 30, 2, 2, 8, true, 0, 10, {0, 5, 40}},            // rows 0..4: no key of their document
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

// A sliding window (transformers' sliding_attention mask: the W keys ending at the query), alone,
// with offsets as a ring's halo gives them (keys starting before the queries), with a window wider
// than every row reaches, narrower than the key block, and with packed documents: both masks.
const Case kWindowCases[] = {
    {150, 150, 4, 2, 8, true, 0, 0, {}, 20},                  // windows inside and across key blocks
    {150, 150, 2, 1, 8, true, 0, 0, {}, 1},                   // a query sees only itself
    {70, 70, 2, 2, 8, true, 0, 0, {}, 100},                   // wider than the sequence: no mask
    {40, 59, 4, 2, 8, true, 100, 81, {}, 20},                 // queries 100.. against keys 81..: a halo of 19
    {30, 60, 4, 2, 8, true, 30, 0, {}, 35},                   // later queries against all earlier keys
    {150, 150, 4, 2, 8, true, 0, 0, {0, 10, 70, 71, 150}, 25}, // documents and window at once
    {40, 59, 2, 1, 8, true, 100, 81, {0, 90, 120, 140}, 12},  // both, with offsets
};

TEST(AttentionCpu, WindowMatchesExplicitSoftmax) {
  for (const Case& c : kWindowCases) {
    SCOPED_TRACE(name(c));
    Inputs in = inputs(c);
    Tensor out = Tensor::empty({c.T, c.Hq, c.d}, DType::f32), lse = Tensor::empty({c.Hq, c.T}, DType::f32);
    ops::attention_forward(in.q, in.k, in.v, out, lse, params(c));
    std::vector<float> want_out, want_lse;
    naive_attention(in.q, in.k, in.v, c, want_out, want_lse);
    EXPECT_LT(test::max_diff(out.to_floats(), want_out), 2e-5f);
    EXPECT_LT(test::max_diff(lse.to_floats(), want_lse), 2e-5f);
  }
}

// The window masks something the causal mask alone would not: without it the result differs.
TEST(AttentionCpu, WindowChangesTheResult) {
  Case c{100, 100, 2, 1, 8, true, 0, 0, {}, 10};
  Inputs in = inputs(c);
  Tensor windowed = Tensor::empty({c.T, c.Hq, c.d}, DType::f32), lse = Tensor::empty({c.Hq, c.T}, DType::f32);
  ops::attention_forward(in.q, in.k, in.v, windowed, lse, params(c));
  c.window = 0;
  Tensor plain = Tensor::empty({c.T, c.Hq, c.d}, DType::f32);
  ops::attention_forward(in.q, in.k, in.v, plain, lse, params(c));
  EXPECT_GT(test::max_diff(windowed.to_floats(), plain.to_floats()), 1e-3f);
  EXPECT_EQ(test::max_diff(windowed.rows(0, 10).to_floats(), plain.rows(0, 10).to_floats()), 0.f);
}

TEST(AttentionCpu, RefusesAWindowWithoutCausal) {
  const Case c{8, 8, 2, 1, 4, false, 0, 0, {}, 4};
  Inputs in = inputs(c);
  Tensor out = Tensor::empty({c.T, c.Hq, c.d}, DType::f32), lse = Tensor::empty({c.Hq, c.T}, DType::f32);
  EXPECT_NE(test::error_of([&] { ops::attention_forward(in.q, in.k, in.v, out, lse, params(c)); })
                .find("window is 4 with causal false"),
            std::string::npos);
  Case negative{8, 8, 2, 1, 4, true, 0, 0, {}, -1};
  EXPECT_NE(test::error_of([&] { ops::attention_forward(in.q, in.k, in.v, out, lse, params(negative)); })
                .find("window is -1"),
            std::string::npos);
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

// A rehearsal's attention table (kernels/attention_table.h): the ops check their arguments as
// always (document bounds too), write zeros and compute nothing, with or without a document mask;
// with the computing table back, the same call computes.
TEST(AttentionCpu, CutWritesZerosAndStillChecks) {
  for (const Case& c : {Case{16, 16, 4, 2, 8, true}, Case{16, 16, 4, 2, 8, true, 0, 0, {0, 5, 6, 16}}}) {
    SCOPED_TRACE(name(c));
    Inputs in = inputs(c);
    Tensor out = rand_tensor({c.T, c.Hq, c.d}, 3), lse = rand_tensor({c.Hq, c.T}, 4);
    Tensor dout = rand_tensor({c.T, c.Hq, c.d}, 5), dq = rand_tensor({c.T, c.Hq, c.d}, 6);
    Tensor dk = rand_tensor({c.S, c.Hkv, c.d}, 7), dv = rand_tensor({c.S, c.Hkv, c.d}, 8);
    ops::install_attention(ops::rehearsal_attention());
    ops::attention_forward(in.q, in.k, in.v, out, lse, params(c));
    ops::attention_backward(in.q, in.k, in.v, out, lse, dout, dq, dk, dv, params(c));
    Tensor wrong = rand_tensor({c.T, c.Hq + 1, c.d}, 9);
    EXPECT_THROW(ops::attention_forward(in.q, in.k, in.v, wrong, lse, params(c)), Error);
    Case short_bounds = c;
    short_bounds.documents = {0, 5};
    EXPECT_THROW(ops::attention_forward(in.q, in.k, in.v, out, lse, params(short_bounds)), Error);
    ops::install_attention(ops::computing_attention());
    for (const Tensor* t : {&out, &lse, &dq, &dk, &dv})
      for (float x : t->to_floats()) ASSERT_EQ(x, 0.f);
    ops::attention_forward(in.q, in.k, in.v, out, lse, params(c));
    std::vector<float> want_out, want_lse;
    naive_attention(in.q, in.k, in.v, c, want_out, want_lse);
    EXPECT_LT(test::max_diff(out.to_floats(), want_out), 2e-5f);
  }
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
  check_backward({12, 12, 4, 2, 4, true, 0, 0, {0, 1, 5, 12}}, 1);   // packed documents
  check_backward({12, 12, 2, 1, 4, false, 0, 0, {0, 7, 12}}, 1);     // full within documents
  check_backward({6, 12, 2, 1, 4, true, 6, 0, {0, 4, 9, 12}}, 1);     // with offsets
}

TEST(AttentionCpu, WindowBackwardMatchesFiniteDifferences) {
  check_backward({12, 12, 4, 2, 4, true, 0, 0, {}, 3}, 1);
  check_backward({8, 12, 2, 1, 4, true, 10, 6, {}, 4}, 1);                // a halo's offsets
  check_backward({12, 12, 2, 1, 4, true, 0, 0, {0, 5, 12}, 3}, 1);        // documents and window
  check_backward({70, 70, 2, 1, 4, true, 0, 0, {}, 66}, 7);               // across the key block
}

// The mask's work is the sum of the squared document lengths, and its result is each document's
// attention alone: rows of one document against that document's slice with no mask at all.
TEST(AttentionCpu, DocumentsEqualEachDocumentAlone) {
  const std::vector<int64_t> bounds{0, 64, 65, 130, 200};
  const Case c{200, 200, 4, 2, 16, true, 0, 0, bounds};
  Inputs in = inputs(c, DType::f32, 21);
  const auto w = test::randn(c.T * c.Hq * c.d, 22);
  const Tensor dout = Tensor::from_floats(w, {c.T, c.Hq, c.d}, DType::f32);
  Tensor out = Tensor::empty({c.T, c.Hq, c.d}, DType::f32), lse = Tensor::empty({c.Hq, c.T}, DType::f32);
  ops::attention_forward(in.q, in.k, in.v, out, lse, params(c));
  Tensor dq = Tensor::empty(in.q.shape(), DType::f32), dk = Tensor::empty(in.k.shape(), DType::f32),
         dv = Tensor::empty(in.v.shape(), DType::f32);
  ops::attention_backward(in.q, in.k, in.v, out, lse, dout, dq, dk, dv, params(c));
  const auto lse_all = lse.to_floats();
  for (size_t i = 0; i + 1 < bounds.size(); ++i) {
    const int64_t b = bounds[i], e = bounds[i + 1], n = e - b;
    SCOPED_TRACE(str("document [", b, ",", e, ")"));
    const Case one{n, n, c.Hq, c.Hkv, c.d, true};
    const Tensor q = in.q.rows(b, e).clone(), k = in.k.rows(b, e).clone(), v = in.v.rows(b, e).clone();
    Tensor o = Tensor::empty({n, c.Hq, c.d}, DType::f32), l = Tensor::empty({c.Hq, n}, DType::f32);
    ops::attention_forward(q, k, v, o, l, params(one));
    Tensor gq = Tensor::empty(q.shape(), DType::f32), gk = Tensor::empty(k.shape(), DType::f32),
           gv = Tensor::empty(v.shape(), DType::f32);
    ops::attention_backward(q, k, v, o, l, dout.rows(b, e).clone(), gq, gk, gv, params(one));
    EXPECT_LT(test::max_diff(out.rows(b, e).to_floats(), o.to_floats()), 1e-6f);
    EXPECT_LT(test::max_diff(dq.rows(b, e).to_floats(), gq.to_floats()), 1e-6f);
    EXPECT_LT(test::max_diff(dk.rows(b, e).to_floats(), gk.to_floats()), 1e-6f);
    EXPECT_LT(test::max_diff(dv.rows(b, e).to_floats(), gv.to_floats()), 1e-6f);
    const auto lo = l.to_floats();
    for (int64_t h = 0; h < c.Hq; ++h)
      for (int64_t t = 0; t < n; ++t) EXPECT_EQ(lse_all[static_cast<size_t>(h * c.T + b + t)], lo[static_cast<size_t>(h * n + t)]);
  }
}

// Blocks of one call (ops::attention_forward_blocks, a ring step's rounds): each block's rows equal
// the block run alone on its slices, forward and backward, and rows outside every block keep what
// they held. Full blocks at unrelated rows of q and k, and causal ones (square, equal positions).
TEST(AttentionCpu, BlocksEqualEachBlockAlone) {
  const int64_t T = 40, S = 36, Hq = 4, Hkv = 2, d = 16;
  const std::vector<ops::AttentionBlock> full = {{0, 10, 20, 8}, {12, 5, 0, 12}, {30, 7, 12, 6}};
  const std::vector<ops::AttentionBlock> causal = {{0, 8, 0, 8}, {10, 6, 20, 6}, {17, 1, 30, 1}};
  for (bool is_causal : {false, true}) {
    const std::vector<ops::AttentionBlock>& blocks = is_causal ? causal : full;
    SCOPED_TRACE(is_causal ? "causal" : "full");
    Tensor q = rand_tensor({T, Hq, d}, 31), k = rand_tensor({S, Hkv, d}, 32), v = rand_tensor({S, Hkv, d}, 33);
    const Tensor dout = rand_tensor({T, Hq, d}, 34);
    auto filled = [](Shape shape, float x) {
      Tensor t = Tensor::empty(std::move(shape), DType::f32);
      for (int64_t i = 0; i < t.numel(); ++i) t.data_as<float>()[i] = x;
      return t;
    };
    Tensor out = filled({T, Hq, d}, 7.f), lse = filled({Hq, T}, 7.f);
    ops::attention_forward_blocks(q, k, v, out, lse, 0.f, is_causal, blocks);
    Tensor dq = filled({T, Hq, d}, 7.f), dk = filled({S, Hkv, d}, 7.f), dv = filled({S, Hkv, d}, 7.f);
    ops::attention_backward_blocks(q, k, v, out, lse, dout, dq, dk, dv, 0.f, is_causal, blocks);
    std::vector<char> q_in(T, 0), k_in(S, 0);
    const auto lse_all = lse.to_floats();
    for (const ops::AttentionBlock& b : blocks) {
      const int64_t q0 = b.q_begin, q1 = q0 + b.q_rows, k0 = b.k_begin, k1 = k0 + b.k_rows;
      SCOPED_TRACE(str("block at query row ", q0, ", key row ", k0));
      std::fill(q_in.begin() + q0, q_in.begin() + q1, 1);
      std::fill(k_in.begin() + k0, k_in.begin() + k1, 1);
      const Case one{b.q_rows, b.k_rows, Hq, Hkv, d, is_causal};
      const Tensor bq = q.rows(q0, q1).clone(), bk = k.rows(k0, k1).clone(), bv = v.rows(k0, k1).clone();
      Tensor o = Tensor::empty({b.q_rows, Hq, d}, DType::f32), l = Tensor::empty({Hq, b.q_rows}, DType::f32);
      ops::attention_forward(bq, bk, bv, o, l, params(one));
      Tensor gq = Tensor::empty(bq.shape(), DType::f32), gk = Tensor::empty(bk.shape(), DType::f32),
             gv = Tensor::empty(bv.shape(), DType::f32);
      ops::attention_backward(bq, bk, bv, o, l, dout.rows(q0, q1).clone(), gq, gk, gv, params(one));
      EXPECT_LT(test::max_diff(out.rows(q0, q1).to_floats(), o.to_floats()), 1e-6f);
      EXPECT_LT(test::max_diff(dq.rows(q0, q1).to_floats(), gq.to_floats()), 1e-6f);
      EXPECT_LT(test::max_diff(dk.rows(k0, k1).to_floats(), gk.to_floats()), 1e-6f);
      EXPECT_LT(test::max_diff(dv.rows(k0, k1).to_floats(), gv.to_floats()), 1e-6f);
      const auto lo = l.to_floats();
      for (int64_t h = 0; h < Hq; ++h)
        for (int64_t t = 0; t < b.q_rows; ++t)
          EXPECT_EQ(lse_all[static_cast<size_t>(h * T + q0 + t)], lo[static_cast<size_t>(h * b.q_rows + t)]);
    }
    // Rows in no block are untouched.
    auto untouched = [](const Tensor& t, const std::vector<char>& in) {
      const auto x = t.to_floats();
      const int64_t row = t.numel() / t.size(0);
      for (int64_t i = 0; i < t.size(0); ++i)
        if (!in[static_cast<size_t>(i)])
          for (int64_t e = 0; e < row; ++e)
            if (x[static_cast<size_t>(i * row + e)] != 7.f) return false;
      return true;
    };
    EXPECT_TRUE(untouched(out, q_in));
    EXPECT_TRUE(untouched(dq, q_in));
    EXPECT_TRUE(untouched(dk, k_in));
    EXPECT_TRUE(untouched(dv, k_in));
    for (int64_t h = 0; h < Hq; ++h)
      for (int64_t t = 0; t < T; ++t)
        if (!q_in[static_cast<size_t>(t)]) {
          EXPECT_EQ(lse_all[static_cast<size_t>(h * T + t)], 7.f);
        }
  }
}

TEST(AttentionCpu, BlocksRefuseSharedRowsAndNonSquareCausalBlocks) {
  Tensor q = rand_tensor({16, 2, 4}, 1), k = rand_tensor({16, 1, 4}, 2), v = rand_tensor({16, 1, 4}, 3);
  Tensor out = Tensor::empty({16, 2, 4}, DType::f32), lse = Tensor::empty({2, 16}, DType::f32);
  auto error = [&](std::vector<ops::AttentionBlock> blocks, bool causal) {
    return test::error_of([&] { ops::attention_forward_blocks(q, k, v, out, lse, 0.f, causal, blocks); });
  };
  EXPECT_NE(error({{0, 8, 0, 4}, {4, 4, 8, 4}}, false).find("query rows 4 to 8"), std::string::npos);
  EXPECT_NE(error({{0, 4, 0, 8}, {8, 4, 6, 4}}, false).find("key rows 6 to 8"), std::string::npos);
  EXPECT_NE(error({{0, 4, 0, 8}}, true).find("causal"), std::string::npos);
  EXPECT_NE(error({{10, 8, 0, 4}}, false).find("outside"), std::string::npos);
  EXPECT_EQ(error({{0, 4, 0, 8}, {8, 8, 8, 8}}, false), "(no error)");
}

TEST(AttentionCpu, RefusesDocumentBoundsThatDoNotCoverThePositions) {
  Tensor q = rand_tensor({8, 2, 4}, 1), k = rand_tensor({8, 1, 4}, 2), v = rand_tensor({8, 1, 4}, 3);
  Tensor out = Tensor::empty({8, 2, 4}, DType::f32), lse = Tensor::empty({2, 8}, DType::f32);
  for (const std::vector<int64_t>& bad : {std::vector<int64_t>{0, 5}, {1, 8}, {0, 5, 5, 8}, {0}}) {
    ops::AttentionParams p;
    p.documents = bad;
    const std::string e = test::error_of([&] { ops::attention_forward(q, k, v, out, lse, p); });
    EXPECT_NE(e.find("bound"), std::string::npos) << e;
  }
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
