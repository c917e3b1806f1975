#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "lcx/tensor.h"

namespace lcx {
namespace {

TEST(DType, Bf16RoundsToNearestEven) {
  // 1 + 2^-8 lies exactly between two bf16 values (1 and 1 + 2^-7): ties go to the even one (1).
  EXPECT_EQ(float_to_bf16(1.0f + std::ldexp(1.0f, -8)).bits, float_to_bf16(1.0f).bits);
  // 1 + 3*2^-8 is a tie between 1+2^-7 (odd) and 1+2^-6 (even).
  EXPECT_EQ(bf16_to_float(float_to_bf16(1.0f + 3 * std::ldexp(1.0f, -8))), 1.0f + std::ldexp(1.0f, -6));
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_EQ(bf16_to_float(float_to_bf16(-2.5f)), -2.5f);
}

TEST(DType, Fp16RoundTripsAndSaturates) {
  for (float v : {0.0f, 1.0f, -0.5f, 65504.0f, 6.1035156e-05f, 5.9604645e-08f, 3.14159f})
    EXPECT_NEAR(f16_to_float(float_to_f16(v)), v, std::abs(v) * 1e-3f) << v;
  EXPECT_TRUE(std::isinf(f16_to_float(float_to_f16(1e6f))));
  EXPECT_EQ(f16_to_float(float_to_f16(1e-9f)), 0.0f);
  EXPECT_EQ(dtype_from_name("BF16"), DType::bf16);
  EXPECT_THROW(dtype_from_name("F8"), Error);
}

TEST(Tensor, RowsShareStorageAndViewsCheckCounts) {
  Tensor t = Tensor::from_floats({1, 2, 3, 4, 5, 6}, {3, 2}, DType::f32);
  Tensor r = t.rows(1, 3);
  EXPECT_EQ(r.shape(), (Shape{2, 2}));
  r.data_as<float>()[0] = 30;
  EXPECT_EQ(t.to_floats()[2], 30);
  EXPECT_EQ(t.view({6}).numel(), 6);
  EXPECT_THROW(t.view({4}), Error);
  EXPECT_THROW(t.rows(2, 4), Error);
  EXPECT_EQ(t.size(-1), 2);
}

TEST(Tensor, ConvertsBetweenDtypes) {
  Tensor t = Tensor::from_floats({1.5f, -2.0f, 1e-3f}, {3}, DType::bf16);
  EXPECT_EQ(t.nbytes(), 6u);
  Tensor f = t.to(DType::f32);
  EXPECT_EQ(f.to_floats()[0], 1.5f);
  EXPECT_NEAR(f.to_floats()[2], 1e-3f, 1e-5f);
  Tensor i = Tensor::from_floats({7, -1}, {2}, DType::i64);
  EXPECT_EQ(i.data_as<int64_t>()[1], -1);
}

TEST(Allocator, TracksLivePeakAndCategories) {
  Allocator& a = allocator_for(Device::cpu());
  a.reset_peak();
  AllocatorStats before = a.stats();
  {
    Tensor w = Tensor::empty({1024}, DType::f32, Device::cpu(), MemoryCategory::weights);
    Tensor x = Tensor::empty({256}, DType::f32, Device::cpu(), MemoryCategory::transient);
    AllocatorStats mid = a.stats();
    EXPECT_EQ(mid.live_bytes - before.live_bytes, 5 * 1024);
    EXPECT_EQ(mid.live_by_category[int(MemoryCategory::weights)] -
                  before.live_by_category[int(MemoryCategory::weights)],
              4096);
    EXPECT_GE(mid.reserved_bytes, mid.live_bytes);
  }
  AllocatorStats after = a.stats();
  EXPECT_EQ(after.live_bytes, before.live_bytes);
  EXPECT_EQ(after.peak_bytes - before.live_bytes, 5 * 1024);
  EXPECT_EQ(after.frees - before.frees, 2);
}

TEST(Allocator, RecorderSeesEventsOnlyWhenEnabled) {
  Allocator& a = allocator_for(Device::cpu());
  MemoryRecorder& rec = a.recorder();
  rec.clear();
  { Tensor t = Tensor::empty({10}, DType::f32); }
  EXPECT_TRUE(rec.events().empty());
  rec.enable(true);
  rec.set_tag("layer 3 forward");
  { Tensor t = Tensor::empty({10}, DType::f32, Device::cpu(), MemoryCategory::activations); }
  rec.enable(false);
  auto ev = rec.events();
  ASSERT_EQ(ev.size(), 2u);
  EXPECT_EQ(ev[0].delta, 40);
  EXPECT_EQ(ev[1].delta, -40);
  EXPECT_EQ(ev[0].category, MemoryCategory::activations);
  EXPECT_EQ(ev[0].tag, "layer 3 forward");
  EXPECT_EQ(ev[0].live_after - ev[1].live_after, 40);
}

TEST(Tensor, CudaTensorsWhenAGpuIsPresent) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU on this machine";
  Tensor h = Tensor::from_floats({1, 2, 3, 4}, {2, 2}, DType::bf16);
  Tensor d = h.to(Device::cuda(0));
  EXPECT_TRUE(d.device().is_cuda());
  EXPECT_EQ(d.to_floats(), h.to_floats());
  AllocatorStats s = allocator_for(Device::cuda(0)).stats();
  EXPECT_GE(s.live_bytes, 8);
  d.zero();
  EXPECT_EQ(d.to_floats(), std::vector<float>(4, 0.0f));
}

}  // namespace
}  // namespace lcx
