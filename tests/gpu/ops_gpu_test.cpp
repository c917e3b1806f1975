// The attention kernels one by one against the CPU (the own kernels, cuDNN, and each against the
// other on a larger case), the memory plan's cuDNN terms against what cuDNN asks, and the grouped
// GEMMs' refusal of 16-bit rows that cuBLAS cannot read aligned. Every op on the automatic kernel
// choice against its CPU twin is the op table's (backend_ops_test.cpp); the same rules hold here:
// fresh random inputs, NaN-poisoned outputs, relative L2 within 1e-5 for fp32 storage and 1e-2 for
// bf16/fp16.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "gpu/attention_shapes.h"
#include "gpu/gpu_test_util.h"
#include "lcx/ops.h"
#include "lcx/plan.h"
#include "support/test_util.h"

#ifdef LCX_HAVE_CUDA
#include "kernels/attention_table.h"
#include "kernels/attention/cudnn/attention_cudnn.h"
#include "kernels/attention/dispatch.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/grouped_gemm_hopper.h"
#include "kernels/cudnn_sizes.h"
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

using test::AttnCase;

std::string attn_name(const AttnCase& c) {
  return str("T=", c.T, " S=", c.S, " Hq=", c.Hq, " Hkv=", c.Hkv, " d=", c.d, c.causal ? " causal" : " full",
             " q_offset=", c.q_offset, " k_offset=", c.k_offset);
}

// lse values agree where finite (relative L2 within `tol`: fp32's bar unless told), and -inf (a row
// that saw no key) sits in the same places.
void expect_lse(const Tensor& got, const Tensor& want, double tol = tolerance(DType::f32)) {
  std::vector<float> g = got.to_floats(), w = want.to_floats();
  ASSERT_EQ(g.size(), w.size());
  for (size_t i = 0; i < g.size(); ++i) {
    ASSERT_EQ(std::isinf(g[i]), std::isinf(w[i])) << "lse element " << i << ": " << g[i] << " vs " << w[i];
    if (std::isinf(w[i])) g[i] = w[i] = 0.f;
  }
  const Tensor gt = Tensor::from_floats(g, got.shape(), DType::f32);
  const Tensor wt = Tensor::from_floats(w, want.shape(), DType::f32);
  EXPECT_LE(rel_l2(gt, wt), tol);
}

// Forward and backward of one case on the CPU and the GPU from the same inputs; backward starts
// from the CPU's forward results, so only backward is compared there.
void compare_attention(const AttnCase& c, DType t, std::mt19937& rng) {
  const ops::AttentionParams p = test::attention_params(c);
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
  explicit KernelChoice(ops::attention::Choice k) { ops::attention::set_choice(k); }
  ~KernelChoice() { ops::attention::set_choice(ops::attention::Choice::automatic); }
};
#endif

TEST_F(GpuOps, AttentionOwnKernelsAgainstCpu) {
  SCOPED_TRACE(trace());
#ifdef LCX_HAVE_CUDA
  KernelChoice own(ops::attention::Choice::own);
#endif
  // bf16/fp16 with head_dim 64 or 128 take the tensor-core kernels, everything else the fp32 ones.
  for (const AttnCase& c : test::kAttentionShapes)
    for (DType t : {DType::f32, DType::bf16, DType::f16}) {
      SCOPED_TRACE(str(attn_name(c), " ", dtype_name(t)));
      compare_attention(c, t, rng_);
    }
}

#ifdef LCX_HAVE_CUDA
// The tensor-core kernels (kernels/attention/mma/) forced: what an A100 or an RTX 4090 runs without
// cuDNN, which the own kernels' order leaves to the Hopper ones on an H100 (bf16, head_dim 128).
TEST_F(GpuOps, AttentionMmaKernelsAgainstCpu) {
  SCOPED_TRACE(trace());
  KernelChoice mma(ops::attention::Choice::mma);
  for (const AttnCase& c : test::kAttentionShapes) {
    if (c.d != 64 && c.d != 128) continue;
    for (DType t : {DType::bf16, DType::f16}) {
      SCOPED_TRACE(str(attn_name(c), " ", dtype_name(t)));
      compare_attention(c, t, rng_);
    }
  }
}

// The Hopper forward (TMA + wgmma, kernels/attention/hopper/forward_sm90a.cu) against the CPU on
// shapes that walk its pipeline (kHopperShapes, attention_shapes.h). The kernel must be the one that
// ran ([run] attention = "hopper" makes anything else an error): the test stops where it does not
// apply (not a compute capability 9.0 GPU).
TEST_F(GpuOps, AttentionHopperForwardAgainstCpu) {
  SCOPED_TRACE(trace());
  KernelChoice hopper(ops::attention::Choice::hopper);
  for (const AttnCase& c : test::kHopperShapes) {
    SCOPED_TRACE(attn_name(c));
    const ops::AttentionParams p = test::attention_params(c);
    const DType t = DType::bf16;
    const Tensor q = host_normal({c.T, c.Hq, c.d}, t, rng_), k = host_normal({c.S, c.Hkv, c.d}, t, rng_),
                 v = host_normal({c.S, c.Hkv, c.d}, t, rng_);
    const Tensor gq = on_gpu(q), gk = on_gpu(k), gv = on_gpu(v);
    Tensor gout = poisoned_gpu({c.T, c.Hq, c.d}, t), glse = poisoned_gpu({c.Hq, c.T}, DType::f32);
    if (!ops::cuda::attention_forward_hopper_applies(gq, gk, gv, gout)) GTEST_SKIP() << "not a compute capability 9.0 GPU";
    Tensor out = Tensor::empty({c.T, c.Hq, c.d}, t), lse = Tensor::empty({c.Hq, c.T}, DType::f32);
    ops::attention_forward(q, k, v, out, lse, p);
    ops::attention_forward(gq, gk, gv, gout, glse, p);
    EXPECT_CLOSE(gout, out, t);
    expect_lse(glse, lse);
  }
}

// The Hopper backward (kernels/attention/hopper/backward_sm90a.cu) against the CPU on the same
// shapes: dq, dk, dv within bf16's bar, from the CPU's forward results (out, lse); and the same bits
// on a second run (dQ's additions come in key-block order).
TEST_F(GpuOps, AttentionHopperBackwardAgainstCpu) {
  SCOPED_TRACE(trace());
  KernelChoice hopper(ops::attention::Choice::hopper);
  for (const AttnCase& c : test::kHopperShapes) {
    SCOPED_TRACE(attn_name(c));
    const ops::AttentionParams p = test::attention_params(c);
    const DType t = DType::bf16;
    const Tensor q = host_normal({c.T, c.Hq, c.d}, t, rng_), k = host_normal({c.S, c.Hkv, c.d}, t, rng_),
                 v = host_normal({c.S, c.Hkv, c.d}, t, rng_), dout = host_normal({c.T, c.Hq, c.d}, t, rng_);
    Tensor out = Tensor::empty({c.T, c.Hq, c.d}, t), lse = Tensor::empty({c.Hq, c.T}, DType::f32);
    ops::attention_forward(q, k, v, out, lse, p);
    const Tensor gq = on_gpu(q), gk = on_gpu(k), gv = on_gpu(v), gout = on_gpu(out), glse = on_gpu(lse),
                 gdout = on_gpu(dout);
    if (!ops::cuda::attention_forward_hopper_applies(gq, gk, gv, gout)) GTEST_SKIP() << "not a compute capability 9.0 GPU";
    Tensor dq = Tensor::empty(q.shape(), t), dk = Tensor::empty(k.shape(), t), dv = Tensor::empty(v.shape(), t);
    ops::attention_backward(q, k, v, out, lse, dout, dq, dk, dv, p);
    std::vector<float> first;
    for (int run = 0; run < 2; ++run) {
      Tensor gdq = poisoned_gpu(q.shape(), t), gdk = poisoned_gpu(k.shape(), t), gdv = poisoned_gpu(v.shape(), t);
      ops::attention_backward(gq, gk, gv, gout, glse, gdout, gdq, gdk, gdv, p);
      if (run == 0) {
        EXPECT_CLOSE(gdq, dq, t);
        EXPECT_CLOSE(gdk, dk, t);
        EXPECT_CLOSE(gdv, dv, t);
        first = gdq.to_floats();
      } else {
        EXPECT_EQ(gdq.to_floats(), first) << "dq differs between two runs";
      }
    }
  }
}

// The automatic choice at a long causal call (kernels/attention/dispatch.h kOwnForwardMinRows): the
// Hopper forward runs, bit for bit what [run] attention = "own" writes, within bf16's bar of cuDNN's; a tile
// short of the threshold, cuDNN's bits.
TEST_F(GpuOps, AttentionAutomaticForwardTakesTheHopperKernelWhereItIsFaster) {
  SCOPED_TRACE(trace());
  for (const int64_t T : {ops::attention::kOwnForwardMinRows, ops::attention::kOwnForwardMinRows - 128}) {
    SCOPED_TRACE(str("T=", T));
    const Tensor q = on_gpu(host_normal({T, 2, 128}, DType::bf16, rng_)), k = on_gpu(host_normal({T, 1, 128}, DType::bf16, rng_)),
                 v = on_gpu(host_normal({T, 1, 128}, DType::bf16, rng_));
    Tensor outs[3], lses[3];
    const ops::attention::Choice kinds[3] = {ops::attention::Choice::automatic, ops::attention::Choice::own,
                                            ops::attention::Choice::cudnn};
    for (int i = 0; i < 3; ++i) {
      if (cuda::cudnn_version().empty() && i == 2) GTEST_SKIP() << "no cuDNN to compare with";
      KernelChoice choice(kinds[i]);
      outs[i] = poisoned_gpu({T, 2, 128}, DType::bf16);
      lses[i] = poisoned_gpu({2, T}, DType::f32);
      ops::AttentionParams p;
      ops::attention_forward(q, k, v, outs[i], lses[i], p);
    }
    if (!ops::cuda::attention_forward_hopper_applies(q, k, v, outs[0])) GTEST_SKIP() << "not a compute capability 9.0 GPU";
    const int same_as = T >= ops::attention::kOwnForwardMinRows ? 1 : 2;
    EXPECT_EQ(outs[0].to_floats(), outs[same_as].to_floats());
    EXPECT_EQ(lses[0].to_floats(), lses[same_as].to_floats());
    EXPECT_CLOSE(outs[1], outs[2], DType::bf16);
    expect_lse(lses[1], lses[2]);
  }
}

// Forward and backward of one call on cuDNN, then on the own kernels, into poisoned outputs, each
// result within bf16 tolerance of the other (the LSE's -inf rows, queries with no key, equal).
// [run] attention = "cudnn" makes a call cuDNN refuses an error, so passing means cuDNN ran it.
void expect_cudnn_equals_own(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& dout,
                             const ops::AttentionParams& p) {
  Tensor out[2], lse[2], dq[2], dk[2], dv[2];
  const ops::attention::Choice kinds[2] = {ops::attention::Choice::cudnn, ops::attention::Choice::own};
  for (int i = 0; i < 2; ++i) {
    KernelChoice choice(kinds[i]);
    out[i] = poisoned_gpu(q.shape(), q.dtype());
    lse[i] = poisoned_gpu({q.size(1), q.size(0)}, DType::f32);
    dq[i] = poisoned_gpu(q.shape(), q.dtype());
    dk[i] = poisoned_gpu(k.shape(), k.dtype());
    dv[i] = poisoned_gpu(v.shape(), v.dtype());
    ops::attention_forward(q, k, v, out[i], lse[i], p);
    ops::attention_backward(q, k, v, out[i], lse[i], dout, dq[i], dk[i], dv[i], p);
  }
  EXPECT_CLOSE(out[0], out[1], q.dtype());
  expect_lse(lse[0], lse[1], 1e-4);
  EXPECT_CLOSE(dq[0], dq[1], q.dtype());
  EXPECT_CLOSE(dk[0], dk[1], q.dtype());
  EXPECT_CLOSE(dv[0], dv[1], q.dtype());
}

TEST_F(GpuOps, AttentionCudnnAgainstCpu) {
  SCOPED_TRACE(trace());
  if (cuda::cudnn_version().empty()) GTEST_SKIP() << "libcudnn.so.9 is not loadable here";
  RecordProperty("cudnn", cuda::cudnn_version());
  KernelChoice cudnn(ops::attention::Choice::cudnn);
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
  expect_cudnn_equals_own(q, k, v, dout, p);
}

// Document-masked attention on cuDNN's batches (kernels/attention/cudnn/documents.cpp: ragged, in
// place, where the loaded cuDNN builds those plans) against the own kernels run once per document,
// on a Qwen3-8B-shaped mix too large for the CPU: a document of 5,000 rows (padded to 5,120), one
// of a single row, several per padded size (the batches of 2 and 4), lengths that are no multiple
// of 8. [run] attention = "cudnn" makes a refused
// batch an error, so passing means cuDNN ran every document.
TEST_F(GpuOps, AttentionDocumentsOnCudnnAgreeWithOwnKernels) {
  SCOPED_TRACE(trace());
  if (cuda::cudnn_version().empty()) GTEST_SKIP() << "libcudnn.so.9 is not loadable here";
  const int64_t T = 8192, Hq = 32, Hkv = 8, d = 128;
  const std::vector<int64_t> documents{0, 5000, 5001, 5130, 5400, 6000, 6999, 7200, 7333, 7461, T};
  ops::AttentionParams p;
  p.causal = true;
  p.documents = documents;
  const Tensor q = on_gpu(host_normal({T, Hq, d}, DType::bf16, rng_));
  const Tensor k = on_gpu(host_normal({T, Hkv, d}, DType::bf16, rng_));
  const Tensor v = on_gpu(host_normal({T, Hkv, d}, DType::bf16, rng_));
  const Tensor dout = on_gpu(host_normal({T, Hq, d}, DType::bf16, rng_));
  expect_cudnn_equals_own(q, k, v, dout, p);
}

// A ring's pieces with queries and keys at other positions (q_offset != k_offset) on cuDNN's padded
// batches of (query, key) pairs against the own kernels per document. A zigzag piece: a query chunk
// against an earlier key chunk, one document spanning both (its keys all before its queries: full
// attention on cuDNN), documents with keys only or queries only beside it (LSE -inf, no gradient).
// The same piece inside one document (the cp_ring case of a long book). A non-causal piece with
// chunks overlapping: several documents per padded pair (batches of 2 and 1), query and key lengths
// differing. A causal piece with the chunks overlapping: a document whose
// keys reach its queries' positions is causal within, which the own kernels keep; cuDNN's full
// attention there would differ. [run] attention = "cudnn" makes a refused batch an error.
TEST_F(GpuOps, AttentionDocumentPiecesApartOnCudnnAgreeWithOwnKernels) {
  SCOPED_TRACE(trace());
  if (cuda::cudnn_version().empty()) GTEST_SKIP() << "libcudnn.so.9 is not loadable here";
  const int64_t Hq = 8, Hkv = 2, d = 128;
  struct Piece {
    const char* name;
    bool causal;
    int64_t T, q_offset, S, k_offset;
    std::vector<int64_t> documents;
  };
  const Piece pieces[] = {
      {"zigzag: queries 8192.. against keys 0..4096", true, 4096, 8192, 4096, 0,
       {0, 700, 2500, 9500, 9501, 11000, 12288}},
      // One document over both chunks: no mask is left, and a causal block whose keys all precede its
      // queries is full attention (ops.cpp), which cuDNN takes.
      {"zigzag, one document: queries 8192.. against keys 0..4096", true, 4096, 8192, 4096, 0, {0, 12288}},
      {"not causal, overlapping", false, 3000, 500, 4000, 0, {0, 300, 1200, 1201, 2000, 2600, 3900, 4000}},
      {"causal, overlapping", true, 3000, 500, 4000, 0, {0, 300, 1200, 1201, 2000, 2600, 3900, 4000}},
  };
  for (const Piece& c : pieces) {
    SCOPED_TRACE(c.name);
    ops::AttentionParams p;
    p.causal = c.causal;
    p.q_offset = c.q_offset;
    p.k_offset = c.k_offset;
    p.documents = c.documents;
    const Tensor q = on_gpu(host_normal({c.T, Hq, d}, DType::bf16, rng_));
    const Tensor k = on_gpu(host_normal({c.S, Hkv, d}, DType::bf16, rng_));
    const Tensor v = on_gpu(host_normal({c.S, Hkv, d}, DType::bf16, rng_));
    const Tensor dout = on_gpu(host_normal({c.T, Hq, d}, DType::bf16, rng_));
    expect_cudnn_equals_own(q, k, v, dout, p);
  }
}

// cuDNN's batches of documents (attention_documents.cpp) called directly on spans that leave rows
// to no batch, on the ragged path (cuDNN reads and writes the documents in place) and on the padded
// fallback: each document's rows of out, the LSE, dq, dk, dv equal the own kernels' on it, and
// every other row keeps its poison. The layout is what a write of padded rows would clobber: a
// batch of two documents of 200 and 210 rows (both padded to 256) with 30 rows of no document after
// the first, inside its padded rows; a document of 300 rows (padded to 384) right before one of 37
// (padded to 128) whose smaller batch runs first; 223 rows of no document; a last document of 1,048
// rows (padded to 1,280) ending at the tensors' end. GQA, so dk and dv come from cuDNN's reduction
// over each group. The ragged plans must build on the loaded cuDNN (the fallback is for others).
// got's rows marked in `in` (for an LSE [H, rows], its columns) within tol of want's (relative L2),
// and every other element still NaN (poisoned_gpu): nothing written outside those rows.
void expect_rows_written(const Tensor& got, const Tensor& want, const std::vector<char>& in, bool columns, double tol) {
  const std::vector<float> g = got.to_floats(), w = want.to_floats();
  const size_t rows = in.size(), per_row = columns ? 1 : g.size() / rows;
  std::vector<float> gs, ws;
  int64_t clobbered = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    const size_t row = columns ? i % rows : i / per_row;
    if (!in[row]) {
      clobbered += !std::isnan(g[i]);
      continue;
    }
    gs.push_back(g[i]);
    ws.push_back(w[i]);
  }
  EXPECT_EQ(clobbered, 0) << "elements written outside the rows";
  EXPECT_LE(rel_l2(gs, ws), tol);
}

TEST_F(GpuOps, AttentionDocumentBatchesOnCudnnTouchOnlyTheirRows) {
  SCOPED_TRACE(trace());
  if (cuda::cudnn_version().empty()) GTEST_SKIP() << "libcudnn.so.9 is not loadable here";
  RecordProperty("cudnn", cuda::cudnn_version());
  const int64_t T = 2048, Hq = 8, Hkv = 2, d = 128;
  const DType t = DType::bf16;
  const std::vector<ops::cuda::DocumentSpan> spans{{0, 200}, {230, 210}, {440, 300}, {740, 37}, {1000, 1048}};
  // Every row in some document for the own kernels' reference: the spans and the rows between them.
  const std::vector<int64_t> documents{0, 200, 230, 440, 740, 777, 1000, T};
  std::vector<char> in_span(T, 0);
  for (const auto& sp : spans) std::fill_n(in_span.begin() + sp.begin, sp.length, 1);
  const Tensor q = on_gpu(host_normal({T, Hq, d}, t, rng_)), k = on_gpu(host_normal({T, Hkv, d}, t, rng_));
  const Tensor v = on_gpu(host_normal({T, Hkv, d}, t, rng_)), dout = on_gpu(host_normal({T, Hq, d}, t, rng_));
  ops::AttentionParams p;
  p.causal = true;
  p.documents = documents;
  Tensor out = poisoned_gpu({T, Hq, d}, t), lse = poisoned_gpu({Hq, T}, DType::f32);
  Tensor dq = poisoned_gpu({T, Hq, d}, t), dk = poisoned_gpu({T, Hkv, d}, t), dv = poisoned_gpu({T, Hkv, d}, t);
  {
    KernelChoice own(ops::attention::Choice::own);
    ops::attention_forward(q, k, v, out, lse, p);
    ops::attention_backward(q, k, v, out, lse, dout, dq, dk, dv, p);
  }
  auto expect_rows = [&](const Tensor& got, const Tensor& want, bool columns, const char* name) {
    SCOPED_TRACE(name);
    expect_rows_written(got, want, in_span, columns, columns ? 1e-4 : tolerance(t));
  };
  KernelChoice cudnn(ops::attention::Choice::cudnn);
  ops::AttentionParams r;
  r.causal = true;
  r.scale = 1.f / std::sqrt(static_cast<float>(d));
  for (bool ragged : {true, false}) {
    SCOPED_TRACE(ragged ? "ragged" : "padded copies");
    cuda::set_cudnn_ragged_documents(ragged);
    if (ragged) {
      for (bool backward : {false, true})
        EXPECT_TRUE(cuda::cudnn_batch_attention_ready(backward, true, 2, 256, 256, Hq, Hkv, d, t, true))
            << "cuDNN " << cuda::cudnn_version() << " refuses the ragged " << (backward ? "backward" : "forward");
    }
    Tensor o = poisoned_gpu({T, Hq, d}, t), l = poisoned_gpu({Hq, T}, DType::f32);
    Tensor gq = poisoned_gpu({T, Hq, d}, t), gk = poisoned_gpu({T, Hkv, d}, t), gv = poisoned_gpu({T, Hkv, d}, t);
    const std::vector<char> ran = ops::cuda::attention_forward_documents(q, k, v, o, l, r, spans, spans, ops::run_work);
    const std::vector<char> ran_back =
        ops::cuda::attention_backward_documents(q, k, v, out, lse, dout, gq, gk, gv, r, spans, spans, ops::run_work);
    for (size_t i = 0; i < spans.size(); ++i) {
      EXPECT_TRUE(ran[i]) << "document " << i;
      EXPECT_TRUE(ran_back[i]) << "document " << i;
    }
    expect_rows(o, out, false, "out");
    expect_rows(l, lse, true, "lse");
    expect_rows(gq, dq, false, "dq");
    expect_rows(gk, dk, false, "dk");
    expect_rows(gv, dv, false, "dv");
  }
  cuda::set_cudnn_ragged_documents(true);
}

// Blocks of one call (ops::attention_forward_blocks, a ring step's rounds under document masks) on
// cuDNN's batches, read in place and through padded copies, and on the own kernels block by block:
// each block's rows match the CPU twin (fp32 on the same bf16 values) within bf16 tolerance, rows
// outside every block stay NaN. Full blocks at unrelated rows of q and k, of lengths in several
// classes, and causal ones (square, equal positions).
TEST_F(GpuOps, AttentionBlocksMatchTheCpu) {
  SCOPED_TRACE(trace());
  const int64_t T = 3072, S = 2560, Hq = 8, Hkv = 2, d = 128;
  const DType t = DType::bf16;
  const std::vector<ops::AttentionBlock> full = {{0, 700, 1800, 700}, {700, 90, 0, 1500}, {1000, 1300, 1500, 200},
                                                 {2400, 5, 1700, 64}};
  const std::vector<ops::AttentionBlock> causal = {{0, 1100, 1200, 1100}, {1200, 300, 0, 300}, {2000, 77, 500, 77}};
  const Tensor hq = host_normal({T, Hq, d}, t, rng_), hk = host_normal({S, Hkv, d}, t, rng_);
  const Tensor hv = host_normal({S, Hkv, d}, t, rng_), hdout = host_normal({T, Hq, d}, t, rng_);
  const Tensor q = on_gpu(hq), k = on_gpu(hk), v = on_gpu(hv), dout = on_gpu(hdout);
  for (bool is_causal : {false, true}) {
    const std::vector<ops::AttentionBlock>& blocks = is_causal ? causal : full;
    std::vector<char> q_in(T, 0), k_in(S, 0);
    for (const ops::AttentionBlock& b : blocks) {
      std::fill_n(q_in.begin() + b.q_begin, b.q_rows, 1);
      std::fill_n(k_in.begin() + b.k_begin, b.k_rows, 1);
    }
    // The CPU twin in fp32; its rows outside the blocks are never read.
    const Tensor cq = hq.to(DType::f32), ck = hk.to(DType::f32), cv = hv.to(DType::f32), cdout = hdout.to(DType::f32);
    Tensor out = Tensor::zeros({T, Hq, d}, DType::f32), lse = Tensor::zeros({Hq, T}, DType::f32);
    Tensor dq = Tensor::zeros({T, Hq, d}, DType::f32), dk = Tensor::zeros({S, Hkv, d}, DType::f32),
           dv = Tensor::zeros({S, Hkv, d}, DType::f32);
    ops::attention_forward_blocks(cq, ck, cv, out, lse, 0.f, is_causal, blocks);
    ops::attention_backward_blocks(cq, ck, cv, out, lse, cdout, dq, dk, dv, 0.f, is_causal, blocks);
    auto expect_rows = [&](const Tensor& got, const Tensor& want, const std::vector<char>& in, bool columns,
                           const char* name) {
      SCOPED_TRACE(name);
      expect_rows_written(got, want, in, columns, columns ? 1e-3 : tolerance(t));
    };
    for (int way = 0; way < 3; ++way) {
      SCOPED_TRACE(str(is_causal ? "causal" : "full", way == 0 ? ", ragged" : way == 1 ? ", padded copies" : ", own"));
      if (way < 2 && cuda::cudnn_version().empty()) continue;
      cuda::set_cudnn_ragged_documents(way == 0);
      KernelChoice choice(way == 2 ? ops::attention::Choice::own : ops::attention::Choice::cudnn);
      Tensor o = poisoned_gpu({T, Hq, d}, t), l = poisoned_gpu({Hq, T}, DType::f32);
      Tensor gq = poisoned_gpu({T, Hq, d}, t), gk = poisoned_gpu({S, Hkv, d}, t), gv = poisoned_gpu({S, Hkv, d}, t);
      ops::attention_forward_blocks(q, k, v, o, l, 0.f, is_causal, blocks);
      // The backward reads the GPU's own out and LSE, as a ring does.
      ops::attention_backward_blocks(q, k, v, o, l, dout, gq, gk, gv, 0.f, is_causal, blocks);
      expect_rows(o, out, q_in, false, "out");
      expect_rows(l, lse, q_in, true, "lse");
      expect_rows(gq, dq, q_in, false, "dq");
      expect_rows(gk, dk, k_in, false, "dk");
      expect_rows(gv, dv, k_in, false, "dv");
    }
    cuda::set_cudnn_ragged_documents(true);
  }
}

// A rehearsal's attention table (kernels/attention_table.h) keeps each attention call's allocations: the same
// count and the same peak as the real call, on cuDNN, on the own kernels, per document under a
// document mask (the own kernels on row slices, ops.cpp) and on cuDNN's ragged batches of
// documents, the same for a ring's piece of queries after its keys (q_offset = T) and for the
// padded copies that stand in where cuDNN refuses ragged plans, and zeros out.
TEST_F(GpuOps, AttentionCutAllocatesWhatTheRealCallDoes) {
  SCOPED_TRACE(trace());
  const int64_t T = 4096, Hq = 4, Hkv = 2, d = 128;
  const DType t = DType::bf16;
  ops::AttentionParams p;
  p.causal = true;
  const Tensor q = on_gpu(host_normal({T, Hq, d}, t, rng_)), k = on_gpu(host_normal({T, Hkv, d}, t, rng_));
  const Tensor v = on_gpu(host_normal({T, Hkv, d}, t, rng_)), dout = on_gpu(host_normal({T, Hq, d}, t, rng_));
  Allocator& a = allocator_for(Device::cuda());
  struct Use {
    int64_t allocations, peak_above_start;
  };
  auto call = [&](Tensor& out, Tensor& lse, Tensor& dq, Tensor& dk, Tensor& dv) {
    a.reset_peak();
    const AllocatorStats before = a.stats();
    ops::attention_forward(q, k, v, out, lse, p);
    ops::attention_backward(q, k, v, out, lse, dout, dq, dk, dv, p);
    const AllocatorStats after = a.stats();
    return Use{after.allocations - before.allocations, after.peak_bytes - before.live_bytes};
  };
  const std::vector<int64_t> documents{0, 1000, 1001, 2500, T};
  const std::vector<int64_t> apart{0, 1000, 1001, 2500, T + 300, T + 1500, 2 * T};
  const char* variants[] = {"cudnn", "own kernels", "per document", "ragged batches of documents (cuDNN)",
                            "queries after keys, ragged batches (cuDNN)", "padded copies of documents (cuDNN)"};
  for (int variant = 0; variant < 6; ++variant) {
    const ops::attention::Choice kernel =
        variant == 0 || variant >= 3 ? ops::attention::Choice::cudnn : ops::attention::Choice::own;
    if (kernel == ops::attention::Choice::cudnn && cuda::cudnn_version().empty()) continue;
    SCOPED_TRACE(variants[variant]);
    KernelChoice choice(kernel);
    p.documents = variant == 4   ? std::span<const int64_t>(apart)
                  : variant >= 2 ? std::span<const int64_t>(documents)
                                 : std::span<const int64_t>();
    p.q_offset = variant == 4 ? T : 0;
    cuda::set_cudnn_ragged_documents(variant != 5);
    Tensor out = poisoned_gpu({T, Hq, d}, t), lse = poisoned_gpu({Hq, T}, DType::f32);
    Tensor dq = poisoned_gpu({T, Hq, d}, t), dk = poisoned_gpu({T, Hkv, d}, t), dv = poisoned_gpu({T, Hkv, d}, t);
    const Use real = call(out, lse, dq, dk, dv);
    ops::install_attention(ops::rehearsal_attention());
    const Use cut = call(out, lse, dq, dk, dv);
    ops::install_attention(ops::computing_attention());
    EXPECT_EQ(cut.allocations, real.allocations);
    EXPECT_EQ(cut.peak_above_start, real.peak_above_start);
    EXPECT_GT(real.allocations, 0);
    for (const Tensor* x : {&out, &lse, &dq, &dk, &dv})
      for (float f : x->to_floats()) ASSERT_EQ(f, 0.f);
  }
  cuda::set_cudnn_ragged_documents(true);
}

// The memory plan's cuDNN terms (kernels/cudnn_sizes.h) against what the loaded cuDNN asks, for the head
// groups and lengths the plan is used at (one kv head per group of Qwen3 shapes, 32k to 1M).
TEST_F(GpuOps, PlanCudnnWorkspacesAreWhatCudnnAsks) {
  if (cuda::cudnn_version().empty()) GTEST_SKIP() << "libcudnn.so.9 is not loadable here";
  RecordProperty("cudnn", cuda::cudnn_version());
  KernelChoice cudnn(ops::attention::Choice::cudnn);
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

// cuBLAS's grouped GEMM reads 16-bit matrices that start 16-byte aligned: bf16 rows of 13 values put
// the second group's rows off, and the op runs a GEMM per group instead, equal to the CPU twin.
TEST_F(GpuOps, GroupedMatmulOfMisalignedBf16RowsMatchesTheCpuTwin) {
  const Tensor x = host_normal({10, 13}, DType::bf16, rng_);
  const Tensor w = host_normal({2, 8, 13}, DType::bf16, rng_);
  const std::vector<int64_t> offsets{0, 3, 10};
  Tensor want = Tensor::zeros({10, 8}, DType::bf16), y = Tensor::zeros({10, 8}, DType::bf16, Device::cuda());
  ops::grouped_matmul(x, w, true, offsets, want);
  ops::grouped_matmul(on_gpu(x), on_gpu(w), true, offsets, y);
  const std::vector<float> a = y.to_floats(), b = want.to_floats();
  for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], b[i], 2e-2 * (1 + std::abs(b[i]))) << i;
  Tensor dw = Tensor::zeros({2, 8, 13}, DType::f32, Device::cuda()), dw_want = Tensor::zeros({2, 8, 13}, DType::f32);
  ops::grouped_matmul_wgrad(want, x, offsets, dw_want);
  ops::grouped_matmul_wgrad(on_gpu(want), on_gpu(x), offsets, dw);
  const std::vector<float> c = dw.to_floats(), d = dw_want.to_floats();
  for (size_t i = 0; i < c.size(); ++i) EXPECT_NEAR(c[i], d[i], 2e-2 * (1 + std::abs(d[i]))) << i;
}


#ifdef LCX_HAVE_CUDA
// lcx's Hopper grouped GEMMs (kernels/cuda/grouped_gemm_sm90a.cu), both designs, called directly:
// the forward (x w[g]^T), the input gradient (dy w[g], into fp32 with alpha 0.7 and beta 0.3) and
// the weights' gradient into fp32 (beta 1,
// and beta 0.5 where empty groups are rescaled), against the CPU twin over 16 groups of skewed
// sizes (empty ones first, inside and last; tails of 1 to 127 rows past a tile). Then at a step's
// scale (65,536 rows, Qwen3-30B-A3B's 128 experts of 2048 -> 768, one 4x the mean, some empty)
// against cuBLAS's grouped GEMM. Stops where the kernels do not serve (not a compute capability 9.0
// GPU).
TEST_F(GpuOps, HopperGroupedGemmMatchesTheCpuTwin) {
  SCOPED_TRACE(trace());
  std::vector<int64_t> off{0};
  for (int64_t rows : {0, 1, 130, 7, 0, 300, 64, 65, 129, 2, 0, 500, 33, 128, 256, 0}) off.push_back(off.back() + rows);
  const int64_t G = 16, R = off.back(), K = 256, N = 512;
  const Tensor x = host_normal({R, K}, DType::bf16, rng_), dy = host_normal({R, N}, DType::bf16, rng_);
  const Tensor w_nk = host_normal({G, N, K}, DType::bf16, rng_);
  const Tensor dw0 = host_normal({G, N, K}, DType::f32, rng_);
  for (const bool ping : {false, true}) {
    SCOPED_TRACE(ping ? "ping-pong" : "cooperative");
    ops::cuda::grouped_hopper::set_ping_pong(ping);
    Tensor y = Tensor::zeros({R, N}, DType::bf16, Device::cuda()), y_want = Tensor::zeros({R, N}, DType::bf16);
    if (!ops::cuda::grouped_hopper::grouped_matmul(on_gpu(x), on_gpu(w_nk), true, off, y, 1.f, 0.f))
      GTEST_SKIP() << "not a compute capability 9.0 GPU";
    ops::grouped_matmul(x, w_nk, true, off, y_want);
    EXPECT_CLOSE(y.to(Device::cpu()), y_want, DType::bf16);

    Tensor dx = on_gpu(host_normal({R, K}, DType::f32, rng_)), dx_want = dx.to(Device::cpu());
    ASSERT_TRUE(ops::cuda::grouped_hopper::grouped_matmul(on_gpu(dy), on_gpu(w_nk), false, off, dx, 0.7f, 0.3f));
    ops::grouped_matmul(dy, w_nk, false, off, dx_want, 0.7f, 0.3f);
    EXPECT_CLOSE(dx.to(Device::cpu()), dx_want, DType::bf16);

    for (const float beta : {1.f, 0.5f}) {
      Tensor dw = on_gpu(dw0), dw_want = dw0.to(Device::cpu());
      ASSERT_TRUE(ops::cuda::grouped_hopper::grouped_matmul_wgrad(on_gpu(dy), on_gpu(x), off, dw, 1.f, beta));
      ops::grouped_matmul_wgrad(dy, x, off, dw_want, 1.f, beta);
      EXPECT_CLOSE(dw.to(Device::cpu()), dw_want, DType::bf16);
    }
  }

  const int64_t E = 128, H = 2048, I = 768, rows = 65536;
  std::vector<int64_t> big{0};
  for (int64_t e = 0; e < E; ++e)
    big.push_back(e + 1 == E ? rows : big.back() + (e % 32 == 3 ? 4 * rows / E : e % 16 == 7 ? 0 : rows / E - 33));
  const Tensor xs = on_gpu(host_normal({rows, H}, DType::bf16, rng_));
  const Tensor w = on_gpu(host_normal({E, I, H}, DType::bf16, rng_));
  Tensor want = Tensor::zeros({rows, I}, DType::bf16, Device::cuda());
  ops::cuda::grouped_matmul(xs, w, true, big, want, 1.f, 0.f);  // cuBLAS's (the run's choice is cublas)
  for (const bool ping : {false, true}) {
    SCOPED_TRACE(ping ? "ping-pong, 65,536 rows" : "cooperative, 65,536 rows");
    ops::cuda::grouped_hopper::set_ping_pong(ping);
    Tensor got = Tensor::zeros({rows, I}, DType::bf16, Device::cuda());
    ASSERT_TRUE(ops::cuda::grouped_hopper::grouped_matmul(xs, w, true, big, got, 1.f, 0.f));
    EXPECT_CLOSE(got.to(Device::cpu()), want.to(Device::cpu()), DType::bf16);
  }
  ops::cuda::grouped_hopper::set_ping_pong(false);
}
#endif

}  // namespace
}  // namespace lcx::test
