// loss_chunked on the GPU: the fused chunk kernel against its CPU twin, and the plugin's CUDA path
// (cuBLASLt GEMMs in bf16 with fp32 accumulation, the fused kernel writing bf16 dlogits) against
// core's plain loss computed on the CPU in fp32 from the same bf16 inputs, at bf16 tolerance, over
// every case of loss_chunked_cases.h. Skipped, visibly, without a GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "gpu/gpu_test_util.h"
#include "lcx/defaults.h"
#include "lcx/ops.h"
#include "plugins/loss_chunked_cases.h"

namespace lcx {
namespace {

using test::LossCase;

// The loss the plugin adds on the GPU, one kernel over a chunk: row losses and the gradient in
// each storage it can write (separate fp32, in place, bf16, none), on a vocabulary that takes the
// 16-byte path (V % 4 == 0, the real 151,936 among them) and on odd ones that take the scalar path.
TEST(CrossEntropyChunkGpu, MatchesCpuTwin) {
  LCX_SKIP_WITHOUT_GPU();
  const uint32_t seed = test::fresh_seed();
  SCOPED_TRACE(str("seed ", seed));
  std::mt19937 rng(seed);
  for (int64_t V : {int64_t{1}, int64_t{33}, int64_t{1000}, int64_t{4097}, int64_t{151936}}) {
    SCOPED_TRACE(str("V=", V));
    const int64_t n = V > 10000 ? 5 : 37;
    const Tensor logits = test::random_tensor({n, V}, rng, 4.f);
    const Tensor targets = test::make_targets(n, V, rng, {{1, 3}}, 0.2);
    const float scale = 1.f / 300;
    Tensor loss = Tensor::empty({n}, DType::f32), want = Tensor::empty({n, V}, DType::f32);
    ops::cross_entropy_chunk(logits, targets, scale, loss, &want);

    const Tensor g_logits = logits.to(Device::cuda()), g_targets = targets.to(Device::cuda());
    for (DType out : {DType::f32, DType::bf16}) {
      Tensor g_loss = test::poisoned_gpu({n}, DType::f32), g_d = test::poisoned_gpu({n, V}, out);
      ops::cross_entropy_chunk(g_logits, g_targets, scale, g_loss, &g_d);
      EXPECT_LT(test::rel_l2(g_loss, loss), 1e-5) << dtype_name(out) << " row losses";
      EXPECT_LT(test::rel_l2(g_d, want), out == DType::f32 ? 1e-5 : 5e-3) << dtype_name(out) << " dlogits";
    }
    Tensor in_place = logits.to(Device::cuda());
    Tensor g_loss = test::poisoned_gpu({n}, DType::f32);
    ops::cross_entropy_chunk(in_place, g_targets, scale, g_loss, &in_place);
    EXPECT_LT(test::rel_l2(in_place, want), 1e-5) << "dlogits in place";
    Tensor fwd = test::poisoned_gpu({n}, DType::f32);
    ops::cross_entropy_chunk(g_logits, g_targets, scale, fwd, nullptr);
    EXPECT_LT(test::rel_l2(fwd, loss), 1e-5) << "forward only";
    // Ignored rows: loss exactly 0 and a gradient of exact zeros.
    const auto l = fwd.to_floats();
    const auto d = in_place.to_floats();
    for (int64_t r : {int64_t{1}, int64_t{2}}) {
      EXPECT_EQ(l[static_cast<size_t>(r)], 0.f);
      for (int64_t i = r * V; i < (r + 1) * V; ++i) ASSERT_EQ(d[static_cast<size_t>(i)], 0.f) << "row " << r;
    }
  }
}

// The plugin on the GPU in bf16 against core's loss on the CPU in fp32 from the same bf16 values:
// what the GPU's bf16 GEMMs and bf16 dlogits cost, held to the bf16 bar.
void compare_gpu(const LossCase& c, uint32_t seed) {
  SCOPED_TRACE(test::describe(c));
  const test::LossInputs in = test::make_inputs(c, seed);
  auto full = make_full_logits_loss();
  auto chunked = test::load_chunked(c.chunk_rows, Device::cuda());
  const double scale = 1.0 / 37;
  const test::LossOutputs ref = test::run_loss(*full, in, Device::cpu(), DType::f32, scale);
  const test::LossOutputs got = test::run_loss(*chunked, in, Device::cuda(), c.dtype, scale);
  const test::LossOutputs plain_gpu = test::run_loss(*full, in, Device::cuda(), c.dtype, scale);

  EXPECT_EQ(got.result.valid, ref.result.valid);
  EXPECT_EQ(got.forward_only.valid, ref.result.valid);
  const double tol = 1e-4 * std::fabs(ref.result.loss_sum) + 1e-4;
  EXPECT_NEAR(got.result.loss_sum, ref.result.loss_sum, tol);
  EXPECT_NEAR(got.forward_only.loss_sum, ref.result.loss_sum, tol);
  EXPECT_NEAR(plain_gpu.result.loss_sum, ref.result.loss_sum, tol);
  const double bar = test::tolerance(c.dtype);
  EXPECT_LT(test::rel_l2(got.grad_hidden, ref.grad_hidden), bar) << "grad_hidden";
  // What the loss added to the head's gradient, without the starting value that would hide it.
  Tensor added = got.grad_head.clone(), added_ref = ref.grad_head.clone(), minus = in.grad_head0.clone();
  ops::scale_inplace(minus, -1.f);
  ops::add_inplace(added, minus);
  ops::add_inplace(added_ref, minus);
  EXPECT_LT(test::rel_l2(added, added_ref), bar) << "grad_head";
  // The chunked loss on the GPU is no further from the fp32 truth than core's plain GPU loss is
  // (plus a sliver: both are bf16 results).
  EXPECT_LT(test::rel_l2(got.grad_hidden, ref.grad_hidden),
            1.5 * test::rel_l2(plain_gpu.grad_hidden, ref.grad_hidden) + 1e-3);
  const int64_t skipped = test::expect_skipped_rows_zero(got.grad_hidden, in.targets, c.chunk_rows);
  // A one-row last chunk may be ignored by chance; the cases with ignored ranges must skip.
  if (!c.ignored.empty()) {
    EXPECT_GT(skipped, 0) << "the case meant to have fully ignored chunks";
  }
}

TEST(LossChunkedGpu, Bf16MatchesPlainLossOverTheIssueCases) {
  LCX_SKIP_WITHOUT_GPU();
  uint32_t seed = 40;
  for (const LossCase& c : test::issue_cases(DType::bf16)) compare_gpu(c, seed++);
}

TEST(LossChunkedGpu, Fp32MatchesPlainLoss) {
  LCX_SKIP_WITHOUT_GPU();
  compare_gpu({300, 32, 257, 64, false, {{64, 128}}, DType::f32}, 60);
  compare_gpu({300, 32, 256, 64, true, {}, DType::f32}, 61);
}

// On the GPU the loss holds one slice of fp32 logits (256 rows at most), the chunk's bf16
// gradient and the per-token losses: the CUDA allocator's peak over a call says so.
TEST(LossChunkedGpu, PeakIsOneSliceOfLogitsAndOneChunkOfGradient) {
  LCX_SKIP_WITHOUT_GPU();
  const int64_t T = 4096, H = 256, V = 32000;
  std::mt19937 rng(70);
  const Tensor hidden = test::random_tensor({T, H}, rng, 1.f).to(DType::bf16).to(Device::cuda());
  const Tensor head = test::random_tensor({V, H}, rng, 0.5f).to(DType::bf16).to(Device::cuda());
  const Tensor targets = test::make_targets(T, V, rng, {}).to(Device::cuda());
  Tensor gh = Tensor::empty({T, H}, DType::bf16, Device::cuda());
  Tensor gw = Tensor::zeros({V, H}, DType::f32, Device::cuda());
  for (int64_t C : {int64_t{256}, int64_t{1024}}) {
    auto chunked = test::load_chunked(C, Device::cuda());
    chunked->forward_backward(hidden, head, targets, 1.0 / T, gh, gw);  // cuBLASLt picks its algorithms
    Allocator& a = allocator_for(Device::cuda());
    backend_for(Device::cuda())->synchronize();
    const int64_t live = a.stats().live_bytes;
    a.reset_peak();
    const LossResult r = chunked->forward_backward(hidden, head, targets, 1.0 / T, gh, gw);
    const int64_t added = a.stats().peak_bytes - live;
    const int64_t want = std::min<int64_t>(C, 256) * V * 4 + C * V * 2 + T * 4;
    EXPECT_GT(r.valid, 0);
    EXPECT_GE(added, want) << "chunk_rows " << C;
    EXPECT_LE(added, want + (1 << 20)) << "chunk_rows " << C;  // matmul's rare fp32 staging would show here
    std::cout << "[ memory   ] T=" << T << " V=" << V << " chunk_rows=" << C << ": the loss added " << added
              << " B on the GPU\n";
  }
}

}  // namespace
}  // namespace lcx
