// Virtual ranks on one GPU: the in-process communicator with CUDA tensors gives the same results
// as on the CPU (bit for bit, since it sums on the host in rank order). With two GPUs or more, the
// NCCL communicator in one process per GPU, started by the launcher.
#include <gtest/gtest.h>

#include <algorithm>

#include "distributed/comm_cases.h"
#include "distributed/launcher.h"
#ifdef LCX_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace lcx {
namespace {

class CommVirtualRanks : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override {
    if (!cuda_available()) GTEST_SKIP() << "no GPU visible";
  }
};

TEST_P(CommVirtualRanks, Collectives) {
  const int world = GetParam();
  for (DType dt : {DType::f32, DType::bf16}) {
    test::check_all_reduce(world, dt, Device::cuda());
    test::check_reduce_scatter(world, dt, Device::cuda());
    test::check_all_gather(world, dt, Device::cuda());
    test::check_all_to_all(world, dt, Device::cuda());
  }
}

TEST_P(CommVirtualRanks, Ring) {
  test::check_ring(GetParam(), DType::bf16, Device::cuda(), false);
  test::check_ring(GetParam(), DType::f32, Device::cuda(), true);
}

INSTANTIATE_TEST_SUITE_P(Ranks, CommVirtualRanks, ::testing::Values(1, 2, 4),
                         [](const auto& info) { return std::to_string(info.param) + "ranks"; });

TEST(Nccl, CollectivesAcrossProcesses) {
#ifdef LCX_HAVE_CUDA
  int gpus = 0;
  if (!cuda_available() || cudaGetDeviceCount(&gpus) != cudaSuccess || gpus < 2)
    GTEST_SKIP() << "needs 2 GPUs, " << gpus << " visible";
  std::string failure;
  LaunchOptions opts;
  opts.kill_grace_s = 5;
  opts.failure = &failure;
  EnvMap env = process_env();
  env.erase("MASTER_PORT");
  EXPECT_EQ(launch_workers(std::min(gpus, 4), {std::string(LCX_BUILD_DIR) + "/tests/dist_worker", "nccl"}, env, opts), 0)
      << failure;
#else
  GTEST_SKIP() << "built without CUDA";
#endif
}

}  // namespace
}  // namespace lcx
