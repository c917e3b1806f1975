// Virtual ranks on one GPU: the in-process communicator with CUDA tensors gives the same results
// as on the CPU (bit for bit, since it sums on the host in rank order).
#include <gtest/gtest.h>

#include "dist/comm_cases.h"

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

}  // namespace
}  // namespace lcx
