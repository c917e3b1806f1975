// lcx-train --plan as a user runs it, on a machine without a GPU.
#include <gtest/gtest.h>

#include <filesystem>

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

// The recipe: every candidate planned and timed by the cost model, the fastest that fits chosen.
// Kept attention (no attention forward in the backward) is predicted faster than the recompute,
// one head group faster than eight; a smaller GPU budget moves the choice to what fits.
TEST(PlanCli, ChoosesTheFastestRecipeThatFits) {
  const std::string dir = ::testing::TempDir() + "lcx-plan-recipe";
  std::filesystem::create_directories(dir);
  test::write_file(dir + "/plan.toml", "[model]\nmodule = \"qwen3\"\ninit = \"qwen3-4b\"\n[data]\nseq_len = 65536\n"
                                       "[train]\nmaster_dtype = \"bf16\"\n[plugins]\nload = [\"loss_chunked\"]\n");
  auto chosen_line = [](const std::string& out) {
    const size_t at = out.find("<- chosen");
    if (at == std::string::npos) return std::string();
    return out.substr(out.rfind('\n', at) + 1, at - out.rfind('\n', at) - 1);
  };
  auto predicted = [](const std::string& out, const std::string& recipe) {
    const size_t at = out.find(recipe + ": predicted step ");
    return at == std::string::npos ? -1.0 : std::stod(out.substr(at + recipe.size() + 17));
  };
  auto big = run_command(test::lcx_train() + " --plan --config " + dir + "/plan.toml --gpu-memory 141GB");
  ASSERT_EQ(big.exit_code, 0) << big.output;
  EXPECT_NE(chosen_line(big.output).find("fits   attention kept from the forward, one head group"), std::string::npos)
      << big.output;
  const double kept = predicted(big.output, "attention kept from the forward, one head group");
  const double recomputed = predicted(big.output, "attention recomputed, one head group");
  const double grouped = predicted(big.output, "attention recomputed, 8 head groups");
  EXPECT_GT(kept, 5);
  EXPECT_LT(kept, recomputed);
  EXPECT_LT(recomputed, grouped);
  // Kept on the GPU, 36 layers of attention outputs do not fit 55 GB: the recompute does.
  auto small = run_command(test::lcx_train() + " --plan --config " + dir + "/plan.toml --gpu-memory 55GB");
  ASSERT_EQ(small.exit_code, 0) << small.output;
  EXPECT_NE(chosen_line(small.output).find("fits   attention recomputed, one head group"), std::string::npos)
      << small.output;
  // A key set in the manifest is the plan's input, not its choice: kept attention off moves the
  // model's plan to the recompute for every candidate.
  auto off = run_command(test::lcx_train() + " --plan --config " + dir +
                         "/plan.toml --gpu-memory 141GB --set qwen3.keep_attention=false");
  ASSERT_EQ(off.exit_code, 0) << off.output;
  EXPECT_EQ(predicted(off.output, "attention kept from the forward, one head group"), recomputed) << off.output;
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
