// sp_ulysses with virtual ranks: thread-ranks whose tensors all live on one GPU, exchanging
// through the in-process communicator. The same cases as the CPU suite at GPU sizes (d = 128, the
// cuDNN path for bf16), each against the single-rank run of the same kernels and dtype; and the
// same with sp_ulysses stacked over cp_ring (cp x sp, tests/plugins/sp_cp_cases.h).
#include <gtest/gtest.h>

#include "gpu/gpu_test_util.h"
#include "plugins/sp_cp_cases.h"

namespace lcx {
namespace {

TEST(SpUlyssesGpu, AttentionEqualsSingleRank) {
  LCX_SKIP_WITHOUT_GPU();
  for (DType dt : {DType::bf16, DType::f32})
    for (int sp : {2, 4, 8})
      for (int64_t Hkv : test::kv_cases(sp, 32)) {
        test::AttentionCase c;
        c.sp = sp;
        c.Hq = 32;
        c.Hkv = Hkv;
        c.d = 128;
        c.tokens_per_rank = 512 / sp * 3;
        c.device = Device::cuda();
        c.dtype = dt;
        c.tol.l2 = dt == DType::f32 ? 1e-5 : 1e-2;
        test::check_attention(c);
      }
}

TEST(SpUlyssesGpu, AttentionBackwardWithoutItsForward) {
  LCX_SKIP_WITHOUT_GPU();
  for (int64_t Hkv : {int64_t{2}, int64_t{8}}) {
    test::AttentionCase c;
    c.sp = 4;
    c.Hq = 16;
    c.Hkv = Hkv;
    c.d = 128;
    c.tokens_per_rank = 300;
    c.device = Device::cuda();
    c.dtype = DType::bf16;
    c.tol.l2 = 1e-2;
    c.reuse_forward = false;
    test::check_attention(c);
  }
}

TEST(SpUlyssesGpu, AttentionWithDocumentsEqualsSingleRank) {
  LCX_SKIP_WITHOUT_GPU();
  for (DType dt : {DType::bf16, DType::f32})
    for (int sp : {2, 4}) {
      test::AttentionCase c;
      c.sp = sp;
      c.Hq = 32;
      c.Hkv = 8;
      c.d = 128;
      c.tokens_per_rank = 1536 / sp;
      c.device = Device::cuda();
      c.dtype = dt;
      c.tol.l2 = dt == DType::f32 ? 1e-5 : 1e-2;
      c.documents = {0, 1, 300, 301, 1000, 1536};
      test::check_attention(c);
    }
}

// The GPU step case the sp and sp x cp steps share: a tiny model at 1,024 tokens in dtype dt.
test::StepCase gpu_step_case(int sp, int64_t Hkv, DType dt) {
  test::StepCase c;
  c.sp = sp;
  c.L = 1024;
  c.Hq = 8;
  c.Hkv = Hkv;
  c.d = 64;
  c.hidden = 128;
  c.vocab = 512;
  c.device = Device::cuda();
  c.weight_dtype = dt;
  c.tol.l2 = dt == DType::f32 ? 1e-4 : 3e-2;
  c.loss_rtol = dt == DType::f32 ? 1e-5 : 1e-2;
  return c;
}

// The GPU attention case of a cp x sp mesh: 1,536 tokens, 16 query heads of 128, in dtype dt.
test::Attention2dCase gpu_attention_2d_case(int cp, int sp, int64_t Hkv, DType dt) {
  test::Attention2dCase c;
  c.cp = cp;
  c.sp = sp;
  c.L = 1536;
  c.Hq = 16;
  c.Hkv = Hkv;
  c.d = 128;
  c.device = Device::cuda();
  c.dtype = dt;
  c.tol.l2 = dt == DType::f32 ? 1e-4 : 1e-2;  // as cp_ring_gpu: the ring merges partial results
  return c;
}

TEST(SpUlyssesGpu, TrainingStepEqualsSingleRank) {
  LCX_SKIP_WITHOUT_GPU();
  for (DType dt : {DType::f32, DType::bf16})
    for (int sp : {2, 4, 8})
      for (int64_t Hkv : {int64_t{2}, int64_t{8}}) test::check_step(gpu_step_case(sp, Hkv, dt));
}

TEST(SpCpGpu, AttentionEqualsSingleRank) {
  LCX_SKIP_WITHOUT_GPU();
  for (DType dt : {DType::bf16, DType::f32})
    for (auto [cp, sp] : {std::pair{2, 2}, {2, 4}, {4, 2}})
      for (int64_t Hkv : {int64_t{2}, int64_t{8}}) {
        test::Attention2dCase c = gpu_attention_2d_case(cp, sp, Hkv, dt);
        test::check_attention_2d(c);
        c.documents = {0, 1, 300, 301, 1000, 1536};
        test::check_attention_2d(c);
      }
}

TEST(SpCpGpu, TrainingStepEqualsSingleRank) {
  LCX_SKIP_WITHOUT_GPU();
  for (DType dt : {DType::f32, DType::bf16})
    for (auto [cp, sp] : {std::pair{2, 2}, {2, 4}, {4, 2}}) test::check_step_2d(cp, gpu_step_case(sp, 2, dt));
}

// The other placement ([distributed] order = "cp_inner"), on one mesh: each rank's shard is its
// seq_index, no longer its world rank, and the communicators must follow.
TEST(SpCpGpu, CpInnerEqualsSingleRank) {
  LCX_SKIP_WITHOUT_GPU();
  test::Attention2dCase a = gpu_attention_2d_case(2, 4, 2, DType::bf16);
  a.order = MeshOrder::cp_inner;
  test::check_attention_2d(a);
  a.documents = {0, 1, 300, 301, 1000, 1536};
  test::check_attention_2d(a);
  test::check_step_2d(2, gpu_step_case(4, 2, DType::bf16), MeshOrder::cp_inner);
}

}  // namespace
}  // namespace lcx
