// The step trace on a GPU: CUDA events on the compute stream and on a copy stream, read after one
// synchronize, and an event pool that grows past its first size without losing an op.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "gpu/gpu_test_util.h"
#include "lcx/stream.h"
#include "profile/step_profiler.h"

namespace lcx::test {
namespace {

TEST(GpuProfile, EventsOnTwoStreamsAndAGrowingPool) {
  LCX_SKIP_WITHOUT_GPU();
  std::mt19937 rng(fresh_seed());
  const Device gpu = Device::cuda();
  Tensor a = on_gpu(host_normal({2048, 2048}, DType::bf16, rng));
  Tensor c = Tensor::empty({2048, 2048}, DType::bf16, gpu);
  Tensor small = on_gpu(host_normal({256}, DType::f32, rng));
  Tensor host = Tensor::empty({2048, 2048}, DType::bf16, Device::cpu());
  Stream copy = Stream::create_copy(gpu);
  const auto dir = temp_dir("profile-gpu");
  constexpr int kSmallOps = 10000;  // 20,000 events: the pool of 8192 grows twice

  StepProfiler prof(gpu, 2);
  {
    ProfilePhase fwd(StepPhase::forward);
    ops::matmul(a, false, a, true, c);
    for (int i = 0; i < kSmallOps; ++i) ops::scale_inplace(small, 1.0f);
    Event done = Event::create(gpu);
    done.record(Stream::compute(gpu));
    copy.wait(done);
    copy_async(host, c, copy);
  }
  const ProfileReport r = prof.finish(dir.string());
  std::ifstream in(r.trace_path);
  ASSERT_TRUE(in) << r.trace_path;
  const auto j = nlohmann::json::parse(in);
  const auto& sum = j.at("otherData");
  EXPECT_EQ(sum.at("unrecorded_ops"), 0);
  EXPECT_EQ(sum.at("kinds").at("other").at("count"), kSmallOps);
  EXPECT_EQ(sum.at("kinds").at("gemm").at("count"), 1);
  EXPECT_GT(sum.at("kinds").at("gemm").at("ms").get<double>(), 0.001) << "a 2048^3 GEMM takes device time";
  const double step_us = sum.at("step_ms").get<double>() * 1e3;
  int copies_off_compute = 0;
  for (const auto& e : j.at("traceEvents")) {
    if (e.at("ph") != "X") continue;
    EXPECT_GE(e.at("dur").get<double>(), 0) << e.dump();
    EXPECT_LE(e.at("ts").get<double>() + e.at("dur").get<double>(), step_us + 1) << e.dump();
    if (e.at("cat") == "copy" && e.at("name") == "copy D2H" && e.at("tid") != 1) ++copies_off_compute;
  }
  EXPECT_EQ(copies_off_compute, 1) << "the copy stream's copy belongs on its own track";
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace lcx::test
