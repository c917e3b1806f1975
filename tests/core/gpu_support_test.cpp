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
  EXPECT_NE(why.find("NVIDIA A100-SXM4-80GB is sm_80"), std::string::npos) << why;
  EXPECT_NE(why.find("targets 90"), std::string::npos) << why;
}

}  // namespace
}  // namespace lcx
