// cp_ring with virtual ranks: the in-process thread-ranks of the CPU suite, each computing on the
// same GPU through the CUDA kernels (cuDNN's fused attention where present) and the plugin's merge
// kernel. bf16 attention is held to the bf16 bar against an fp32 CPU reference on the same
// rounded inputs; whole training steps against the single-rank step on the GPU.
#include <gtest/gtest.h>

#include "plugins/cp_ring_cases.h"
#include "balance.h"

namespace lcx {
namespace {

#define LCX_SKIP_WITHOUT_GPU() \
  if (!::lcx::cuda_available()) GTEST_SKIP() << "no CUDA device visible"

constexpr double kBf16Tol = 1e-2;

class CpRingAttentionGpu : public ::testing::TestWithParam<int> {};

TEST_P(CpRingAttentionGpu, Bf16Gqa1) {
  LCX_SKIP_WITHOUT_GPU();
  test::expect_ring_attention({GetParam(), 96, 4, 4, 128}, Device::cuda(), DType::bf16, kBf16Tol);
}

TEST_P(CpRingAttentionGpu, Bf16Gqa4) {
  LCX_SKIP_WITHOUT_GPU();
  test::expect_ring_attention({GetParam(), 80, 8, 2, 64}, Device::cuda(), DType::bf16, kBf16Tol);
}

TEST_P(CpRingAttentionGpu, Fp32Gqa4) {
  LCX_SKIP_WITHOUT_GPU();
  test::expect_ring_attention({GetParam(), 40, 8, 2, 64}, Device::cuda(), DType::f32, 1e-4);
}

// Packed documents: the chunk pairs run document by document on the own kernels, with offsets.
TEST_P(CpRingAttentionGpu, Bf16PackedDocuments) {
  LCX_SKIP_WITHOUT_GPU();
  const int cp = GetParam();
  const int64_t L = 2 * cp * 96;
  test::expect_ring_attention({cp, 96, 8, 2, 128, true, {0, 1, 50, 97, 300, L - 7, L}}, Device::cuda(), DType::bf16,
                              kBf16Tol);
}

// Sliding-window layers: each chunk's halo fetched, one windowed call per chunk over [halo; chunk]
// at their positions (queries after the first key), head_dim 64, 128 and 256; with documents.
TEST_P(CpRingAttentionGpu, Bf16Window) {
  LCX_SKIP_WITHOUT_GPU();
  const int cp = GetParam();
  const int64_t L = 2 * cp * 96;
  for (int64_t d : {64, 128, 256})
    for (int64_t w : {32, 130}) {
      test::expect_ring_attention({cp, 96, 8, 2, d, true, {}, {}, w}, Device::cuda(), DType::bf16, kBf16Tol);
      test::expect_ring_attention({cp, 96, 8, 2, d, true, {0, 1, 50, 97, 300, L - 7, L}, {}, w}, Device::cuda(),
                                  DType::bf16, kBf16Tol);
    }
}

// The default layout with its chunks' bounds moved: pieces of unequal rows through the rounds.
TEST(CpRingAttentionGpuMovedBounds, Bf16PackedDocuments) {
  LCX_SKIP_WITHOUT_GPU();
  for (const auto& [cp, docs] : test::kMovedBounds) {
    const int64_t L = docs.back();
    ASSERT_FALSE(cp_ring::balanced_layout(docs, L, cp).bounds.empty()) << "cp " << cp;
    test::expect_ring_attention({cp, L / (2 * cp), 8, 2, 128, true, docs}, Device::cuda(), DType::bf16, kBf16Tol);
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, CpRingAttentionGpu, ::testing::Values(2, 4, 8),
                         [](const auto& info) { return str("cp", info.param); });

class CpRingStepGpu : public ::testing::TestWithParam<int> {};

TEST_P(CpRingStepGpu, Fp32EqualsSingleRankStep) {
  LCX_SKIP_WITHOUT_GPU();
  const int cp = GetParam();
  const Sequence seq = test::random_sequence(64, 64, 9);
  const test::StepOutcome want = test::single_rank_step(seq, Device::cuda(), DType::f32);
  const test::StepOutcome got = test::cp_step(seq, cp, Device::cuda(), DType::f32);
  test::expect_same_step(got, want, 1e-4, 2e-3, str("cp = ", cp, " fp32 on the GPU"));
}

TEST_P(CpRingStepGpu, Bf16TracksSingleRankStep) {
  LCX_SKIP_WITHOUT_GPU();
  const int cp = GetParam();
  const Sequence seq = test::random_sequence(64, 64, 9);
  const test::StepOutcome want = test::single_rank_step(seq, Device::cuda(), DType::bf16);
  const test::StepOutcome got = test::cp_step(seq, cp, Device::cuda(), DType::bf16);
  test::expect_same_step(got, want, 1e-2, 5e-2, str("cp = ", cp, " bf16 on the GPU"));
}

INSTANTIATE_TEST_SUITE_P(Ranks, CpRingStepGpu, ::testing::Values(2, 4),
                         [](const auto& info) { return str("cp", info.param); });

}  // namespace
}  // namespace lcx
