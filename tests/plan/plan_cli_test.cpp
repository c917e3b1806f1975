// lcx-train --plan as a user runs it, on a machine without a GPU.
#include <gtest/gtest.h>

#include "lcx/tensor.h"
#include "support/test_util.h"

namespace lcx {
namespace {

using test::run_command;

std::string recipe() { return std::string(LCX_SOURCE_DIR) + "/configs/qwen3_8b_1m_8gpu.toml"; }

TEST(PlanCli, RecipePrintsTheBreakdownWithoutAGpu) {
  // models/Qwen3-8B is not downloaded here: the plan takes the public Qwen3-8B shape by the
  // folder's name; cp_ring plans its own ring buffers.
  auto r = run_command(test::lcx_train() + " --plan --config " + recipe() + " --gpu-memory 80GB");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const char* s : {"the public qwen3-8b shape", "1,048,576 tokens", "cp 8", "131,072 tokens per rank",
                        "weights", "gradients", "master weights", "optimizer state", "saved activations (GPU)",
                        "saved activations (host)", "largest transient", "allocator reserve", "peak",
                        "pinned host memory", "longest sequence that fits", "ring K/V receive buffers",
                        "loss_chunked", "rope_yarn", "plan: peak_bytes="})
    EXPECT_NE(r.output.find(s), std::string::npos) << s << "\n" << r.output;
}

TEST(PlanCli, ShapeFromInitWhenThePathIsCleared) {
  auto r = run_command(test::lcx_train() + " --plan --config " + recipe() +
                       " --gpu-memory 141GB --set model.path= --set model.init=qwen3-4b");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("preset qwen3-4b"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("hidden 2560"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("141.00 GiB"), std::string::npos) << r.output;
}

TEST(PlanCli, TooSmallGpuNamesTheKnobs) {
  auto r = run_command(test::lcx_train() + " --plan --config " + recipe() + " --gpu-memory 40GB --disable loss_chunked");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("does NOT fit"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("load loss_chunked"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("raise distributed.cp to "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("lower data.seq_len to "), std::string::npos) << r.output;
}

TEST(PlanCli, OtherRefusalsStopThePlan) {
  auto r = run_command(test::lcx_train() + " --plan --config " + recipe() +
                       " --gpu-memory 80GB --set loss_chunked.chunk_rows=0");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("chunk_rows"), std::string::npos) << r.output;
}

TEST(PlanCli, GpuMemoryIsRequiredWithoutAGpu) {
  if (cuda_available()) GTEST_SKIP() << "this machine has a GPU: --plan asks it";
  auto r = run_command(test::lcx_train() + " --plan --config " + recipe());
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("--gpu-memory 80GB"), std::string::npos) << r.output;
  auto bad = run_command(test::lcx_train() + " --plan --config " + recipe() + " --gpu-memory lots");
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_NE(bad.output.find("--gpu-memory 'lots' is not a size"), std::string::npos) << bad.output;
}

}  // namespace
}  // namespace lcx
