// Every CUDA op against its CPU twin on fresh random inputs: the same inputs go to both, the GPU
// outputs start as NaN, and the relative L2 error must stay within 1e-5 for fp32 storage and 1e-2
// for bf16. Accumulating outputs (grad tables, dw, matmul with beta) start from the same random
// values on both sides.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "gpu/gpu_test_util.h"
#include "lcx/ops.h"
#include "lcx/plan.h"

#ifdef LCX_HAVE_CUDA
#include "kernels/cuda/attention_cudnn.h"
#endif

namespace lcx::test {
namespace {

class GpuOps : public ::testing::Test {
 protected:
  void SetUp() override {
    LCX_SKIP_WITHOUT_GPU();
    seed_ = fresh_seed();
    rng_.seed(seed_);
    RecordProperty("seed", std::to_string(seed_));
  }
  std::string trace() const { return str("seed ", seed_); }
  uint32_t seed_ = 0;
  std::mt19937 rng_;
};

const DType kDtypes[] = {DType::f32, DType::bf16};

TEST_F(GpuOps, MatmulAllTransposesAndOutputDtypes) {
  SCOPED_TRACE(trace());
  struct Case {
    int64_t M, N, K;
  };
  for (Case s : {Case{67, 45, 129}, Case{256, 384, 512}, Case{1, 7, 3}}) {
    for (DType ab : kDtypes) {
      for (DType ct : {DType::f32, DType::bf16}) {
        if (ab == DType::f32 && ct == DType::bf16) continue;
        for (int ta = 0; ta < 2; ++ta) {
          for (int tb = 0; tb < 2; ++tb) {
            SCOPED_TRACE(str(s.M, "x", s.N, "x", s.K, " ", dtype_name(ab), "->", dtype_name(ct), " ta=", ta,
                             " tb=", tb));
            const Tensor a = host_normal(ta ? Shape{s.K, s.M} : Shape{s.M, s.K}, ab, rng_);
            const Tensor b = host_normal(tb ? Shape{s.N, s.K} : Shape{s.K, s.N}, ab, rng_);
            Tensor c = host_normal({s.M, s.N}, ct, rng_);
            Tensor gc = on_gpu(c);
            ops::matmul(a, ta, b, tb, c, 0.7f, 0.3f);
            ops::matmul(on_gpu(a), ta, on_gpu(b), tb, gc, 0.7f, 0.3f);
            EXPECT_CLOSE(gc, c, ct);
            // beta = 0 must not read c: a NaN c stays out of the result.
            Tensor c0 = Tensor::zeros({s.M, s.N}, ct);
            Tensor gc0 = poisoned_gpu({s.M, s.N}, ct);
            ops::matmul(a, ta, b, tb, c0, 1.f, 0.f);
            ops::matmul(on_gpu(a), ta, on_gpu(b), tb, gc0, 1.f, 0.f);
            EXPECT_CLOSE(gc0, c0, ct);
          }
        }
      }
    }
  }
}

TEST_F(GpuOps, MatmulFoldsLeadingDimensionsAndMixedDtypes) {
  SCOPED_TRACE(trace());
  const Tensor a = host_normal({6, 5, 32}, DType::bf16, rng_);  // [T, heads, d] as a [30, 32] matrix
  const Tensor b = host_normal({48, 32}, DType::f32, rng_);
  Tensor c = Tensor::zeros({30, 48}, DType::bf16);
  Tensor gc = poisoned_gpu({30, 48}, DType::bf16);
  ops::matmul(a, false, b, true, c, 1.f, 0.f);
  ops::matmul(on_gpu(a), false, on_gpu(b), true, gc, 1.f, 0.f);
  EXPECT_CLOSE(gc, c, DType::bf16);
}

TEST_F(GpuOps, EmbeddingForwardBackward) {
  SCOPED_TRACE(trace());
  const int64_t V = 1000, H = 96, T = 300;
  std::uniform_int_distribution<int> pick(0, 40);  // few distinct ids: many repeats in backward
  std::vector<float> idv(T);
  for (auto& x : idv) x = static_cast<float>(pick(rng_) * 23 % V);
  const Tensor ids = Tensor::from_floats(idv, {T}, DType::i32);
  for (DType t : kDtypes) {
    SCOPED_TRACE(dtype_name(t));
    const Tensor table = host_normal({V, H}, t, rng_);
    Tensor out = Tensor::empty({T, H}, t);
    Tensor gout = poisoned_gpu({T, H}, t);
    ops::embedding_forward(ids, table, out);
    ops::embedding_forward(on_gpu(ids), on_gpu(table), gout);
    EXPECT_CLOSE(gout, out, t);

    const Tensor grad_out = host_normal({T, H}, t, rng_);
    Tensor grad_table = host_normal({V, H}, DType::f32, rng_);
    Tensor g_grad_table = on_gpu(grad_table);
    ops::embedding_backward(ids, grad_out, grad_table);
    ops::embedding_backward(on_gpu(ids), on_gpu(grad_out), g_grad_table);
    EXPECT_CLOSE(g_grad_table, grad_table, DType::f32);
  }
}

TEST_F(GpuOps, RmsNormForwardBackwardHiddenAndPerHead) {
  SCOPED_TRACE(trace());
  // d % 8 == 0 in bf16 takes the 8-wide kernels; d = 100 the scalar ones.
  for (Shape shape : {Shape{37, 1024}, Shape{50, 8, 128}, Shape{3, 2560}, Shape{9, 100}}) {
    for (DType t : kDtypes) {
      SCOPED_TRACE(str(shape_str(shape), " ", dtype_name(t)));
      const int64_t d = shape.back(), rows = shape_numel(shape) / d;
      const Tensor x = host_normal(shape, t, rng_, 2.f);
      std::vector<float> wv = normal(d, rng_, 0.2f);
      for (auto& w : wv) w += 1.f;
      const Tensor w = Tensor::from_floats(wv, {d}, t);
      Tensor y = Tensor::empty(shape, t), rstd = Tensor::empty({rows}, DType::f32);
      Tensor gy = poisoned_gpu(shape, t), grstd = poisoned_gpu({rows}, DType::f32);
      ops::rmsnorm_forward(x, w, 1e-6f, y, rstd);
      ops::rmsnorm_forward(on_gpu(x), on_gpu(w), 1e-6f, gy, grstd);
      EXPECT_CLOSE(gy, y, t);
      EXPECT_CLOSE(grstd, rstd, DType::f32);

      const Tensor dy = host_normal(shape, t, rng_);
      Tensor dx = Tensor::empty(shape, t), dw = host_normal({d}, DType::f32, rng_);
      Tensor gdx = poisoned_gpu(shape, t), gdw = on_gpu(dw);
      ops::rmsnorm_backward(x, w, rstd, dy, dx, dw);
      ops::rmsnorm_backward(on_gpu(x), on_gpu(w), on_gpu(rstd), on_gpu(dy), gdx, gdw);
      EXPECT_CLOSE(gdx, dx, t);
      EXPECT_CLOSE(gdw, dw, DType::f32);
    }
  }
}

TEST_F(GpuOps, RotaryForwardBackward) {
  SCOPED_TRACE(trace());
  const int64_t T = 50, heads = 6, d = 128;
  std::vector<float> cv(T * d / 2), sv(T * d / 2);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < d / 2; ++i) {
      const double angle = (t + 1000) * std::pow(1e6, -2.0 * i / d);
      cv[t * d / 2 + i] = static_cast<float>(std::cos(angle));
      sv[t * d / 2 + i] = static_cast<float>(std::sin(angle));
    }
  const Tensor cos = Tensor::from_floats(cv, {T, d / 2}, DType::f32);
  const Tensor sin = Tensor::from_floats(sv, {T, d / 2}, DType::f32);
  const Tensor gcos = on_gpu(cos), gsin = on_gpu(sin);
  for (DType t : kDtypes) {
    SCOPED_TRACE(dtype_name(t));
    Tensor x = host_normal({T, heads, d}, t, rng_);
    Tensor gx = on_gpu(x);
    ops::rotary_forward(x, cos, sin);
    ops::rotary_forward(gx, gcos, gsin);
    EXPECT_CLOSE(gx, x, t);
    Tensor dx = host_normal({T, heads, d}, t, rng_);
    Tensor gdx = on_gpu(dx);
    ops::rotary_backward(dx, cos, sin);
    ops::rotary_backward(gdx, gcos, gsin);
    EXPECT_CLOSE(gdx, dx, t);
  }
}

TEST_F(GpuOps, SwigluForwardBackward) {
  SCOPED_TRACE(trace());
  // 7 x 13 = 91 elements: the 8-wide bf16 kernel takes 88, the scalar tail 3.
  for (Shape shape : {Shape{33, 3072}, Shape{7, 13}}) {
    for (DType t : kDtypes) {
      SCOPED_TRACE(str(shape_str(shape), " ", dtype_name(t)));
      const Tensor gate = host_normal(shape, t, rng_, 3.f), up = host_normal(shape, t, rng_);
      Tensor out = Tensor::empty(shape, t), gout = poisoned_gpu(shape, t);
      ops::swiglu_forward(gate, up, out);
      ops::swiglu_forward(on_gpu(gate), on_gpu(up), gout);
      EXPECT_CLOSE(gout, out, t);
      const Tensor dout = host_normal(shape, t, rng_);
      Tensor dg = Tensor::empty(shape, t), du = Tensor::empty(shape, t);
      Tensor gdg = poisoned_gpu(shape, t), gdu = poisoned_gpu(shape, t);
      ops::swiglu_backward(gate, up, dout, dg, du);
      ops::swiglu_backward(on_gpu(gate), on_gpu(up), on_gpu(dout), gdg, gdu);
      EXPECT_CLOSE(gdg, dg, t);
      EXPECT_CLOSE(gdu, du, t);
    }
  }
}

TEST_F(GpuOps, AddScaleCastAcrossDtypes) {
  SCOPED_TRACE(trace());
  const Shape shape{129, 257};
  for (DType ta : kDtypes) {
    for (DType tb : kDtypes) {
      SCOPED_TRACE(str(dtype_name(ta), " + ", dtype_name(tb)));
      const Tensor a = host_normal(shape, ta, rng_), b = host_normal(shape, tb, rng_);
      Tensor out = Tensor::empty(shape, ta), gout = poisoned_gpu(shape, ta);
      ops::add(a, b, out);
      ops::add(on_gpu(a), on_gpu(b), gout);
      EXPECT_CLOSE(gout, out, ta);
      Tensor acc = a.clone(), gacc = on_gpu(a);
      ops::add_inplace(acc, b);
      ops::add_inplace(gacc, on_gpu(b));
      EXPECT_CLOSE(gacc, acc, ta);
      ops::scale_inplace(acc, -0.37f);
      ops::scale_inplace(gacc, -0.37f);
      EXPECT_CLOSE(gacc, acc, ta);
    }
  }
  // Casts round to nearest even on both sides: the stored values agree exactly.
  for (auto [from, to] : {std::pair{DType::f32, DType::bf16}, std::pair{DType::bf16, DType::f32},
                          std::pair{DType::f32, DType::f16}, std::pair{DType::f16, DType::bf16}}) {
    SCOPED_TRACE(str(dtype_name(from), " -> ", dtype_name(to)));
    const Tensor src = host_normal(shape, from, rng_, 10.f);
    Tensor dst = Tensor::empty(shape, to), gdst = poisoned_gpu(shape, to);
    ops::cast(src, dst);
    ops::cast(on_gpu(src), gdst);
    EXPECT_EQ(gdst.to_floats(), dst.to_floats());
  }
}

// A head group's columns of a projection weight, gathered and scattered back: bytes only, so the
// GPU's pitched copy equals the CPU's row copies exactly.
TEST_F(GpuOps, CopyColumnsGathersAndScatters) {
  SCOPED_TRACE(trace());
  for (DType t : kDtypes) {
    SCOPED_TRACE(dtype_name(t));
    const Tensor w = host_normal({257, 4096}, t, rng_);
    Tensor part = Tensor::empty({257, 512}, t), gpart = poisoned_gpu({257, 512}, t);
    ops::copy_columns(w, 1536, part, 0, 512);
    ops::copy_columns(on_gpu(w), 1536, gpart, 0, 512);
    EXPECT_EQ(gpart.to_floats(), part.to_floats());
    Tensor back = host_normal({257, 4096}, t, rng_), gback = on_gpu(back);
    ops::copy_columns(part, 0, back, 512, 512);
    ops::copy_columns(gpart, 0, gback, 512, 512);
    EXPECT_EQ(gback.to_floats(), back.to_floats());
  }
}

TEST_F(GpuOps, CrossEntropyForwardBackwardAndInPlace) {
  SCOPED_TRACE(trace());
  struct Case {
    int64_t T, V;
  };
  for (Case s : {Case{37, 5003}, Case{4, 151936}}) {
    for (DType t : kDtypes) {
      SCOPED_TRACE(str(s.T, "x", s.V, " ", dtype_name(t)));
      const Tensor logits = host_normal({s.T, s.V}, t, rng_, 3.f);
      std::uniform_int_distribution<int64_t> pick(0, s.V - 1);
      std::vector<int64_t> tv(static_cast<size_t>(s.T));
      for (size_t i = 0; i < tv.size(); ++i) tv[i] = i % 4 == 1 ? -100 : pick(rng_);
      Tensor targets = Tensor::empty({s.T}, DType::i64);
      std::copy(tv.begin(), tv.end(), targets.data_as<int64_t>());
      const Tensor gtargets = on_gpu(targets);
      const double scale = 1.0 / 29;

      Tensor dl = Tensor::empty({s.T, s.V}, t), gdl = poisoned_gpu({s.T, s.V}, t);
      int64_t valid = -1, gvalid = -2;
      const double loss = ops::cross_entropy_forward_backward(logits, targets, scale, &dl, &valid);
      const double gloss = ops::cross_entropy_forward_backward(on_gpu(logits), gtargets, scale, &gdl, &gvalid);
      EXPECT_EQ(gvalid, valid);
      EXPECT_NEAR(gloss, loss, 1e-5 * std::abs(loss));
      EXPECT_CLOSE(gdl, dl, t);

      // Loss only, and the gradient written over the logits themselves.
      EXPECT_NEAR(ops::cross_entropy_forward_backward(on_gpu(logits), gtargets, scale, nullptr, nullptr), loss,
                  1e-5 * std::abs(loss));
      Tensor inplace = on_gpu(logits);
      EXPECT_NEAR(ops::cross_entropy_forward_backward(inplace, gtargets, scale, &inplace, nullptr), loss,
                  1e-5 * std::abs(loss));
      EXPECT_CLOSE(inplace, dl, t);
    }
  }
}

struct AttnCase {
  int64_t T, S, Hq, Hkv, d;
  bool causal;
  int64_t q_offset, k_offset;
};

std::string attn_name(const AttnCase& c) {
  return str("T=", c.T, " S=", c.S, " Hq=", c.Hq, " Hkv=", c.Hkv, " d=", c.d, c.causal ? " causal" : " full",
             " q_offset=", c.q_offset, " k_offset=", c.k_offset);
}

// lse values agree where finite, and -inf (a row that saw no key) sits in the same places.
void expect_lse(const Tensor& got, const Tensor& want) {
  std::vector<float> g = got.to_floats(), w = want.to_floats();
  ASSERT_EQ(g.size(), w.size());
  for (size_t i = 0; i < g.size(); ++i) {
    ASSERT_EQ(std::isinf(g[i]), std::isinf(w[i])) << "lse element " << i << ": " << g[i] << " vs " << w[i];
    if (std::isinf(w[i])) g[i] = w[i] = 0.f;
  }
  const Tensor gt = Tensor::from_floats(g, got.shape(), DType::f32);
  const Tensor wt = Tensor::from_floats(w, want.shape(), DType::f32);
  EXPECT_CLOSE(gt, wt, DType::f32);
}

// Forward and backward of one case on the CPU and the GPU from the same inputs; backward starts
// from the CPU's forward results, so only backward is compared there.
void compare_attention(const AttnCase& c, DType t, std::mt19937& rng) {
  ops::AttentionParams p;
  p.causal = c.causal;
  p.q_offset = c.q_offset;
  p.k_offset = c.k_offset;
  const Tensor q = host_normal({c.T, c.Hq, c.d}, t, rng);
  const Tensor k = host_normal({c.S, c.Hkv, c.d}, t, rng);
  const Tensor v = host_normal({c.S, c.Hkv, c.d}, t, rng);
  const Tensor gq = on_gpu(q), gk = on_gpu(k), gv = on_gpu(v);
  Tensor out = Tensor::empty({c.T, c.Hq, c.d}, t), lse = Tensor::empty({c.Hq, c.T}, DType::f32);
  Tensor gout = poisoned_gpu({c.T, c.Hq, c.d}, t), glse = poisoned_gpu({c.Hq, c.T}, DType::f32);
  ops::attention_forward(q, k, v, out, lse, p);
  ops::attention_forward(gq, gk, gv, gout, glse, p);
  EXPECT_CLOSE(gout, out, t);
  expect_lse(glse, lse);

  const Tensor dout = host_normal({c.T, c.Hq, c.d}, t, rng);
  Tensor dq = Tensor::empty(q.shape(), t), dk = Tensor::empty(k.shape(), t), dv = Tensor::empty(v.shape(), t);
  Tensor gdq = poisoned_gpu(q.shape(), t), gdk = poisoned_gpu(k.shape(), t), gdv = poisoned_gpu(v.shape(), t);
  ops::attention_backward(q, k, v, out, lse, dout, dq, dk, dv, p);
  ops::attention_backward(gq, gk, gv, on_gpu(out), on_gpu(lse), on_gpu(dout), gdq, gdk, gdv, p);
  EXPECT_CLOSE(gdq, dq, t);
  EXPECT_CLOSE(gdk, dk, t);
  EXPECT_CLOSE(gdv, dv, t);
}

#ifdef LCX_HAVE_CUDA
// Selects the attention kernels for one test and restores the automatic choice after it.
struct KernelChoice {
  explicit KernelChoice(cuda::AttentionKernel k) { cuda::set_attention_kernel(k); }
  ~KernelChoice() { cuda::set_attention_kernel(cuda::AttentionKernel::automatic); }
};
#endif

TEST_F(GpuOps, AttentionOwnKernelsAgainstCpu) {
  SCOPED_TRACE(trace());
#ifdef LCX_HAVE_CUDA
  KernelChoice own(cuda::AttentionKernel::own);
#endif
  const AttnCase cases[] = {
      {130, 130, 4, 2, 64, true, 0, 0},   // causal, GQA, ragged last tile
      {70, 200, 4, 1, 64, true, 130, 0},  // the last 70 queries of a 200-token sequence
      {65, 100, 2, 2, 32, false, 0, 0},   // a full (non-causal) ring block
      {96, 96, 8, 2, 128, true, 0, 0},    // Qwen3's head_dim and group of 4
      {50, 50, 2, 1, 80, true, 0, 0},     // a head_dim padded inside its tile
      {40, 60, 2, 2, 64, true, 0, 20},    // the first 20 queries see no key: lse -inf, out 0
      {64, 64, 4, 2, 128, false, 128, 0}, // a ring block wholly in the past
  };
  // bf16/fp16 with head_dim 64 or 128 take the tensor-core kernels, everything else the fp32 ones.
  for (const AttnCase& c : cases)
    for (DType t : {DType::f32, DType::bf16, DType::f16}) {
      SCOPED_TRACE(str(attn_name(c), " ", dtype_name(t)));
      compare_attention(c, t, rng_);
    }
}

#ifdef LCX_HAVE_CUDA
TEST_F(GpuOps, AttentionCudnnAgainstCpu) {
  SCOPED_TRACE(trace());
  if (cuda::cudnn_version().empty()) GTEST_SKIP() << "libcudnn.so.9 is not loadable here";
  RecordProperty("cudnn", cuda::cudnn_version());
  KernelChoice cudnn(cuda::AttentionKernel::cudnn);
  const AttnCase cases[] = {
      {130, 130, 4, 2, 64, true, 0, 0},
      {96, 96, 8, 2, 128, true, 0, 0},
      {256, 256, 4, 4, 128, true, 64, 64},  // equal offsets: a diagonal ring block
      {65, 100, 2, 2, 64, false, 0, 0},
      {128, 192, 8, 2, 128, false, 0, 0},
  };
  for (const AttnCase& c : cases)
    for (DType t : {DType::bf16, DType::f16}) {
      SCOPED_TRACE(str(attn_name(c), " ", dtype_name(t), " cuDNN ", cuda::cudnn_version()));
      compare_attention(c, t, rng_);
    }
}

// cuDNN and the tensor-core kernels on one larger causal GQA case: each is the other's second
// opinion where the CPU would be slow.
TEST_F(GpuOps, AttentionCudnnAgreesWithOwnKernels) {
  SCOPED_TRACE(trace());
  if (cuda::cudnn_version().empty()) GTEST_SKIP() << "libcudnn.so.9 is not loadable here";
  const int64_t T = 2048, Hq = 16, Hkv = 4, d = 128;
  ops::AttentionParams p;
  const Tensor q = on_gpu(host_normal({T, Hq, d}, DType::bf16, rng_));
  const Tensor k = on_gpu(host_normal({T, Hkv, d}, DType::bf16, rng_));
  const Tensor v = on_gpu(host_normal({T, Hkv, d}, DType::bf16, rng_));
  const Tensor dout = on_gpu(host_normal({T, Hq, d}, DType::bf16, rng_));
  Tensor out[2], lse[2], dq[2], dk[2], dv[2];
  const cuda::AttentionKernel kinds[2] = {cuda::AttentionKernel::cudnn, cuda::AttentionKernel::own};
  for (int i = 0; i < 2; ++i) {
    KernelChoice choice(kinds[i]);
    out[i] = poisoned_gpu({T, Hq, d}, DType::bf16);
    lse[i] = poisoned_gpu({Hq, T}, DType::f32);
    dq[i] = poisoned_gpu({T, Hq, d}, DType::bf16);
    dk[i] = poisoned_gpu({T, Hkv, d}, DType::bf16);
    dv[i] = poisoned_gpu({T, Hkv, d}, DType::bf16);
    ops::attention_forward(q, k, v, out[i], lse[i], p);
    ops::attention_backward(q, k, v, out[i], lse[i], dout, dq[i], dk[i], dv[i], p);
  }
  EXPECT_CLOSE(out[0], out[1], DType::bf16);
  EXPECT_LE(rel_l2(lse[0], lse[1]), 1e-4);
  EXPECT_CLOSE(dq[0], dq[1], DType::bf16);
  EXPECT_CLOSE(dk[0], dk[1], DType::bf16);
  EXPECT_CLOSE(dv[0], dv[1], DType::bf16);
}

// The memory plan's cuDNN terms (lcx/plan.h) against what the loaded cuDNN asks, for the head
// groups and lengths the plan is used at (one kv head per group of Qwen3 shapes, 32k to 1M).
TEST_F(GpuOps, PlanCudnnWorkspacesAreWhatCudnnAsks) {
  if (cuda::cudnn_version().empty()) GTEST_SKIP() << "libcudnn.so.9 is not loadable here";
  RecordProperty("cudnn", cuda::cudnn_version());
  KernelChoice cudnn(cuda::AttentionKernel::cudnn);
  const int64_t heads[][2] = {{2, 1}, {4, 1}, {32, 8}};
  for (const auto& h : heads)
    for (int64_t T : {32768, 131072, 1048576}) {
      SCOPED_TRACE(str("Hq ", h[0], " Hkv ", h[1], " T ", T, " cuDNN ", cuda::cudnn_version()));
      EXPECT_EQ(cuda::cudnn_attention_workspace(false, T, T, h[0], h[1], 128, DType::bf16, true), kCudnnForwardWorkspace);
      EXPECT_EQ(cuda::cudnn_attention_workspace(true, T, T, h[0], h[1], 128, DType::bf16, true),
                cudnn_backward_workspace_bytes(h[0], T, 128));
    }
}
#endif

}  // namespace
}  // namespace lcx::test
