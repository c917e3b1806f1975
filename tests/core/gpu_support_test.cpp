// Which GPUs lcx takes, by compute capability: the start's refusal reads as the user should see it.
#include "util/gpu_support.h"

#include <gtest/gtest.h>

namespace lcx {
namespace {

TEST(GpuSupport, RefusesBelowAmpereByName) {
  EXPECT_EQ(gpu_refusal("Tesla T4", 7, 5), "Tesla T4 is sm_75; lcx needs sm_80 or newer (Ampere)");
  EXPECT_EQ(gpu_refusal("Tesla V100-SXM2-16GB", 7, 0), "Tesla V100-SXM2-16GB is sm_70; lcx needs sm_80 or newer (Ampere)");
}

TEST(GpuSupport, TakesAmpereAndLater) {
  EXPECT_EQ(gpu_refusal("NVIDIA A100-SXM4-80GB", 8, 0), "");
  EXPECT_EQ(gpu_refusal("NVIDIA GeForce RTX 4090", 8, 9), "");
  EXPECT_EQ(gpu_refusal("NVIDIA H100 80GB HBM3", 9, 0), "");
  EXPECT_EQ(gpu_refusal("NVIDIA B200", 10, 0), "");
}

TEST(GpuSupport, BuildRefusalNamesTheGpuAndTheTargets) {
  const std::string why = gpu_build_refusal("NVIDIA A100-SXM4-80GB", 8, 0, "90");
  EXPECT_EQ(why, "NVIDIA A100-SXM4-80GB is sm_80, and this lcx was built for CUDA targets 90 only, none of which it runs");
}

// What each build runs on: CI's sm_90 with its PTX, a release's every target, a native one.
TEST(GpuSupport, BuildTargetsCoverTheGpusTheirCodeRuns) {
  const char* release = "80-real,86-real,89-real,90a-real,100-real,100-virtual";
  for (const auto& [major, minor] : {std::pair{8, 0}, {8, 6}, {8, 7}, {8, 9}, {9, 0}, {10, 0}, {10, 3}, {12, 0}})
    EXPECT_EQ(gpu_build_refusal("gpu", major, minor, release), "") << major << minor;
  EXPECT_EQ(gpu_build_refusal("B200", 10, 0, "90"), "");      // compute_90 PTX, compiled by the driver
  EXPECT_EQ(gpu_build_refusal("H100", 9, 0, "90a-real"), "");
  EXPECT_NE(gpu_build_refusal("B200", 10, 0, "90a-real"), "");  // arch-specific code: sm_90 alone
  EXPECT_NE(gpu_build_refusal("A100", 8, 0, "90"), "");
  EXPECT_EQ(gpu_build_refusal("RTX 4090", 8, 9, "80-real"), "");  // sm_80 machine code runs on sm_89
  EXPECT_NE(gpu_build_refusal("A100", 8, 0, "86-real"), "");
  EXPECT_NE(gpu_build_refusal("H100", 9, 0, "89-real,100-virtual"), "");
}

}  // namespace
}  // namespace lcx
