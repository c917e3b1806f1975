// lcx-train --plan as a user runs it, on a machine without a GPU.
#include <gtest/gtest.h>

#include <cstdio>
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

// Masked documents under a ring of 8 ranks: the ring masks them, so the plan goes ahead.
TEST(PlanCli, RecipeWithMaskedDocumentsPlansUnderCpRing) {
  auto r = run_command(test::lcx_train() + " --plan --config " + recipe() +
                       " --gpu-memory 80GB --set data.attend_across_documents=false");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("cp 8"), std::string::npos) << r.output;
}

// The packed recipe masks documents under sp_ulysses, which can: planned, not refused.
TEST(PlanCli, PackedRecipePlansUnderSpUlysses) {
  auto r = run_command(test::lcx_train() + " --plan --config " + std::string(LCX_SOURCE_DIR) +
                       "/configs/qwen3_8b_packed_8gpu.toml --gpu-memory 80GB");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const char* s : {"131,072 tokens", "sp 8", "16,384 tokens per rank"})
    EXPECT_NE(r.output.find(s), std::string::npos) << s << "\n" << r.output;
}

// Issue 24: the 16-GPU recipe stacks sp_ulysses over cp_ring; the plan counts both at the composed
// shard (4,194,304 / 16 tokens per rank; the ring over the cp shard's rows on the rank's heads).
TEST(PlanCli, SixteenGpuRecipePlansTheStackedMesh) {
  auto r = run_command(test::lcx_train() + " --plan --config " + std::string(LCX_SOURCE_DIR) +
                       "/configs/qwen3_8b_4m_16gpu.toml --gpu-memory 141GB");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const char* s : {"4,194,304 tokens", "cp 2", "sp 8", "262,144 tokens per rank", "parallelism sp_ulysses",
                        "all-to-all: q, k, v, out in head layout", "ring K/V receive buffers",
                        "placement: order sp_inner: each sp group on 8 neighbouring ranks, each cp ring strided 8 ranks apart"})
    EXPECT_NE(r.output.find(s), std::string::npos) << s << "\n" << r.output;
  // Too small a GPU: the pair grows along the ring's axis as loaded, never swapped for the ring alone.
  auto small = run_command(test::lcx_train() + " --plan --config " + std::string(LCX_SOURCE_DIR) +
                           "/configs/qwen3_8b_4m_16gpu.toml --gpu-memory 60GB --host-memory 2TB");
  EXPECT_NE(small.output.find("raise distributed.cp to 4 (32 GPUs"), std::string::npos) << small.output;
  EXPECT_EQ(small.output.find("load cp_ring"), std::string::npos) << small.output;
}

// [distributed] order: the other placement is planned and printed; a value that names no order is
// refused by its key before any planning, exit code 2.
TEST(PlanCli, SixteenGpuRecipePrintsThePlacementOrder) {
  const std::string plan = test::lcx_train() + " --plan --config " + std::string(LCX_SOURCE_DIR) +
                           "/configs/qwen3_8b_4m_16gpu.toml --gpu-memory 141GB --set distributed.order=";
  auto r = run_command(plan + "cp_inner");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("placement: order cp_inner: each cp ring on 2 neighbouring ranks, each sp group strided 2 "
                          "ranks apart"),
            std::string::npos)
      << r.output;
  auto bad = run_command(plan + "ring_inner");
  EXPECT_EQ(bad.exit_code, 2) << bad.output;
  for (const char* s : {"distributed.order", "'ring_inner' is not allowed", "sp_inner, cp_inner"})
    EXPECT_NE(bad.output.find(s), std::string::npos) << s << "\n" << bad.output;
}

// The recipe: every candidate planned and timed by the cost model, the fastest that fits chosen.
// Kept attention (no attention forward in the backward) is predicted faster than the recompute,
// one head group faster than eight; a smaller GPU budget moves the choice to what fits.
// The recipe line `--plan` marks "<- chosen", without the mark; empty when none is.
std::string chosen_line(const std::string& out) {
  const size_t at = out.find("<- chosen");
  if (at == std::string::npos) return std::string();
  return out.substr(out.rfind('\n', at) + 1, at - out.rfind('\n', at) - 1);
}

TEST(PlanCli, ChoosesTheFastestRecipeThatFits) {
  const std::string dir = ::testing::TempDir() + "lcx-plan-recipe";
  std::filesystem::create_directories(dir);
  test::write_file(dir + "/plan.toml", "[model]\nmodule = \"qwen3\"\ninit = \"qwen3-4b\"\n[data]\nseq_len = 65536\n"
                                       "[train]\nmaster_dtype = \"bf16\"\ncheckpoint_every = 1\n"
                                       "[plugins]\nload = [\"loss_chunked\"]\n");
  // Every candidate fits 141 GB with the largest loss chunks (the plan's choice of chunk_rows).
  auto predicted = [](const std::string& out, std::string recipe) {
    recipe += ", loss chunks of 4,096 rows: predicted step ";
    const size_t at = out.find(recipe);
    return at == std::string::npos ? -1.0 : std::stod(out.substr(at + recipe.size()));
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

// Issue 21 item 4: the MLP's tiles and the loss's chunks are the plan's choice. Qwen3-4B at 131,072
// tokens: with room, one tile of the whole sequence and 4,096-row chunks (the least work); at 50 GB,
// tiles of 16,384 rows beside deeper recompute. Keys set in the manifest win (the recipe names no
// rows, the breakdown plans the keys'); a bad value stops the plan naming the key and the fix.
TEST(PlanCli, TilesAndLossChunksAreThePlansChoiceAndKeysWin) {
  const std::string dir = ::testing::TempDir() + "lcx-plan-rows";
  std::filesystem::create_directories(dir);
  test::write_file(dir + "/plan.toml", "[model]\nmodule = \"qwen3\"\ninit = \"qwen3-4b\"\n[data]\nseq_len = 131072\n"
                                       "[train]\nmaster_dtype = \"bf16\"\n"
                                       "[plugins]\nload = [\"loss_chunked\", \"tiled_mlp\"]\n");
  const std::string plan = test::lcx_train() + " --plan --config " + dir + "/plan.toml";
  auto big = run_command(plan + " --gpu-memory 141GB");
  ASSERT_EQ(big.exit_code, 0) << big.output;
  EXPECT_NE(chosen_line(big.output).find("fits   attention kept from the forward, one head group, MLP tiles of 131,072 rows, "
                                         "loss chunks of 4,096 rows: predicted step "),
            std::string::npos)
      << big.output;
  auto tight = run_command(plan + " --gpu-memory 50GB");
  ASSERT_EQ(tight.exit_code, 0) << tight.output;
  EXPECT_NE(chosen_line(tight.output).find(", MLP tiles of 16,384 rows, loss chunks of 4,096 rows: "), std::string::npos)
      << tight.output;
  EXPECT_EQ(chosen_line(tight.output).rfind("  fits ", 0), 0u) << tight.output;
  auto keyed = run_command(plan + " --gpu-memory 50GB --set tiled_mlp.tile_rows=8192 --set loss_chunked.chunk_rows=256");
  ASSERT_EQ(keyed.exit_code, 0) << keyed.output;
  const std::string line = chosen_line(keyed.output);
  ASSERT_FALSE(line.empty()) << keyed.output;
  EXPECT_EQ(line.find("MLP tiles"), std::string::npos) << line;
  EXPECT_EQ(line.find("loss chunks"), std::string::npos) << line;
  for (const char* s : {"backward: MLP dact, dgate, dup [8192,I] (one tile)", "one chunk's dlogits [256,V]"})
    EXPECT_NE(keyed.output.find(s), std::string::npos) << s << "\n" << keyed.output;
  auto bad = run_command(plan + " --gpu-memory 50GB --set tiled_mlp.tile_rows=big");
  EXPECT_EQ(bad.exit_code, 2) << bad.output;
  EXPECT_NE(bad.output.find("tiled_mlp.tile_rows: 'big' is neither \"auto\" nor an integer"), std::string::npos)
      << bad.output;
  EXPECT_NE(bad.output.find("fix: \"auto\" (the plan's choice"), std::string::npos) << bad.output;
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

// A row of the --plan breakdown as format_plan prints it.
std::string plan_row(const std::string& label, const std::string& value, const std::string& note) {
  char line[256];
  std::snprintf(line, sizeof line, "  %-28s %12s  %s\n", label.c_str(), value.c_str(), note.c_str());
  return line;
}

// Issue 22 item 1: the host's memory is the plan's second budget, counted per node. The 8-GPU
// recipe with every saved input in pinned memory (offload.gpu_layers = 0) pins 36 GiB per rank with
// the attention recomputed, 72.56 GiB with it kept: 288 and 580.5 GiB for the node's 8 ranks.
TEST(PlanCli, HostMemoryIsABudgetCountedOverTheNodesRanks) {
  const std::string plan = test::lcx_train() + " --plan --config " + recipe() + " --gpu-memory 141GB";
  auto r = run_command(plan + " --host-memory 125GB --set offload.gpu_layers=0 --set train.checkpoint_every=1");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  // Nothing fits 125 GB: the recipe pinning least is taken, and the breakdown is of it.
  for (const std::string& s :
       {plan_row("pinned host memory", "36.00 GiB", "per rank"), plan_row("pinned host, node", "288.00 GiB", "8 ranks on one node"),
        plan_row("host memory", "125.00 GiB", "short by 163.00 GiB"),
        std::string("  host fix: lower data.seq_len, keep fewer layers' inputs in host memory"),
        std::string("short  attention recomputed, one head group, loss chunks of 256 rows: predicted step 348.8 s, GPU 48.56 "
                    "GiB, pinned host 288.00 GiB (8 ranks)   <- chosen")})
    EXPECT_NE(r.output.find(s), std::string::npos) << s << "\n" << r.output;
  EXPECT_EQ(r.output.find("fits   attention"), std::string::npos) << "no recipe fits 125 GB of host: " << r.output;
  // A node with ample host memory takes the faster recipe that keeps the attention.
  auto ample = run_command(plan + " --host-memory 1TB --set offload.gpu_layers=0 --set train.checkpoint_every=1");
  ASSERT_EQ(ample.exit_code, 0) << ample.output;
  EXPECT_NE(ample.output.find(plan_row("host memory", "1024.00 GiB", "fits, 443.50 GiB to spare")), std::string::npos)
      << ample.output;
  EXPECT_NE(ample.output.find("fits   attention kept from the forward, one head group"), std::string::npos) << ample.output;
  EXPECT_EQ(ample.output.find("host fix:"), std::string::npos) << ample.output;
  // Left to the plan (gpu_layers and checkpoint_every "auto"), 131,072 tokens per rank leave room
  // for every input on the GPU beside the kept attention: nothing pinned, the fastest recipe.
  auto placed = run_command(plan + " --host-memory 125GB");
  ASSERT_EQ(placed.exit_code, 0) << placed.output;
  EXPECT_NE(placed.output.find("fits   attention kept from the forward, one head group, 36 saved inputs on the GPU, loss "
                               "chunks of 4,096 rows: predicted step 276.7 s, GPU 115.66 GiB, pinned host 0.00 GiB (8 ranks)   "
                               "<- chosen"),
            std::string::npos)
      << placed.output;

  // One rank with the offload plugin moving every input, on a host of 8 GB: 36 layer inputs of 64k
  // tokens do not fit.
  const std::string dir = ::testing::TempDir() + "lcx-plan-host";
  std::filesystem::create_directories(dir);
  test::write_file(dir + "/plan.toml", "[model]\nmodule = \"qwen3\"\ninit = \"qwen3-4b\"\n[data]\nseq_len = 65536\n"
                                       "[plugins]\nload = [\"loss_chunked\", \"offload\"]\n");
  auto small = run_command(test::lcx_train() + " --plan --config " + dir +
                           "/plan.toml --gpu-memory 141GB --host-memory 8GB --set offload.gpu_layers=0 "
                           "--set train.checkpoint_every=1");
  ASSERT_EQ(small.exit_code, 0) << small.output;
  EXPECT_NE(small.output.find(plan_row("host memory", "8.00 GiB", "short by 3.25 GiB")), std::string::npos) << small.output;
  EXPECT_NE(small.output.find("host fix: lower data.seq_len"), std::string::npos) << small.output;
  EXPECT_EQ(small.output.find("pinned host, node"), std::string::npos) << "one rank: " << small.output;
  auto bad = run_command(test::lcx_train() + " --plan --config " + dir + "/plan.toml --gpu-memory 141GB --host-memory lots");
  EXPECT_EQ(bad.exit_code, 2) << bad.output;
  EXPECT_NE(bad.output.find("--host-memory 'lots' is not a size"), std::string::npos) << bad.output;
}

// Issue 22 items 2, 4, 5: Qwen3-4B at 1,048,576 tokens on one H200 (139 GiB) with 125 GB of host,
// the recipe of docs/PERF.md (83.3 GiB on the GPU with every input offloaded). With every saved
// input in pinned memory (offload.gpu_layers = 0, train.checkpoint_every = 1) no recipe fits the
// host (180 GiB of inputs); left to the plan, the search keeps 11 inputs on the GPU (125 GiB
// pinned); with 100 GB of host it saves every second layer's input. Those figures are unmasked
// attention's (attend_across_documents = true); masked per document, cuDNN's batches read and
// write the documents in place (ragged offsets), holding per padded row little beyond the unmasked
// call's accumulator and workspace, and the plan keeps the recipe (with copies of the documents it
// moved to 8 head groups).
TEST(PlanCli, HostBudgetMovesTheRecipeToPlacementAndDeeperRecompute) {
  const std::string dir = ::testing::TempDir() + "lcx-plan-4b-1m";
  std::filesystem::create_directories(dir);
  test::write_file(dir + "/plan.toml", "[model]\nmodule = \"qwen3\"\ninit = \"qwen3-4b\"\n[data]\nseq_len = 1048576\n"
                                       "attend_across_documents = true\n"
                                       "[train]\nmaster_dtype = \"bf16\"\n"
                                       "[plugins]\nload = [\"loss_chunked\", \"offload\", \"tiled_mlp\"]\n");
  const std::string plan = test::lcx_train() + " --plan --config " + dir + "/plan.toml --gpu-memory 139GiB --host-memory 125GB";
  auto all_out = run_command(plan + " --set offload.gpu_layers=0 --set train.checkpoint_every=1");
  ASSERT_EQ(all_out.exit_code, 0) << all_out.output;
  EXPECT_NE(all_out.output.find("host fix: "), std::string::npos) << all_out.output;
  EXPECT_EQ(all_out.output.find("\n  fits "), std::string::npos) << "180 GiB of inputs do not fit 125 GB: " << all_out.output;
  EXPECT_NE(all_out.output.find(plan_row("saved activations (host)", "180.00 GiB", "pinned, not on the GPU")),
            std::string::npos)
      << all_out.output;

  auto chosen = run_command(plan);
  ASSERT_EQ(chosen.exit_code, 0) << chosen.output;
  const std::string line = chosen_line(chosen.output);
  ASSERT_FALSE(line.empty()) << chosen.output;
  EXPECT_EQ(line.rfind("  fits ", 0), 0u) << line;
  EXPECT_NE(line.find("attention recomputed, 4 head groups, 12 saved inputs on the GPU"), std::string::npos) << line;
  const std::string masked = chosen_line(run_command(plan + " --set data.attend_across_documents=false").output);
  EXPECT_NE(masked.find("attention recomputed, 4 head groups, 12 saved inputs on the GPU"), std::string::npos) << masked;
  EXPECT_EQ(chosen.output.find("host fix: "), std::string::npos) << chosen.output;
  const std::string host_fits = plan_row("host memory", "125.00 GiB", "fits");
  EXPECT_NE(chosen.output.find(host_fits.substr(0, host_fits.size() - 1)), std::string::npos) << chosen.output;
  EXPECT_NE(chosen.output.find("longest sequence that fits this machine (GPU 139.00 GiB, host 125.00 GiB"),
            std::string::npos)
      << chosen.output;
  auto deeper = run_command(test::lcx_train() + " --plan --config " + dir +
                            "/plan.toml --gpu-memory 139GiB --host-memory 100GB");
  ASSERT_EQ(deeper.exit_code, 0) << deeper.output;
  const std::string pick = chosen_line(deeper.output);
  ASSERT_FALSE(pick.empty()) << deeper.output;
  EXPECT_EQ(pick.rfind("  fits ", 0), 0u) << pick;
  EXPECT_NE(pick.find("every 2 layers one input saved"), std::string::npos) << pick;
}

// Qwen3-8B at 1M on the same machine: with the offload's own prefetch window (3 inputs of 8 GiB)
// nothing fits both budgets; the plan then tries loading nothing ahead (the window's bytes go to
// saved inputs, each copy in is exposed and costed) and fits with every third layer saved: the
// recipe an H200 rehearsal measured equal to this plan (docs/PERF.md). A prefetch key set wins.
TEST(PlanCli, NothingLoadedAheadWhenTheWindowDoesNotFit) {
  const std::string dir = ::testing::TempDir() + "lcx-plan-8b-1m";
  std::filesystem::create_directories(dir);
  test::write_file(dir + "/plan.toml", "[model]\nmodule = \"qwen3\"\ninit = \"qwen3-8b\"\n[data]\nseq_len = 1048576\n"
                                       "[train]\nmaster_dtype = \"bf16\"\n"
                                       "[plugins]\nload = [\"loss_chunked\", \"offload\", \"tiled_mlp\"]\n");
  const std::string plan = test::lcx_train() + " --plan --config " + dir + "/plan.toml --gpu-memory 139GiB --host-memory 120GiB";
  auto chosen = run_command(plan);
  ASSERT_EQ(chosen.exit_code, 0) << chosen.output;
  const std::string line = chosen_line(chosen.output);
  ASSERT_FALSE(line.empty()) << chosen.output;
  EXPECT_EQ(line.rfind("  fits ", 0), 0u) << line;
  EXPECT_NE(line.find("every 3 layers one input saved, 1 saved inputs on the GPU, nothing loaded ahead"), std::string::npos)
      << line;
  auto fixed = run_command(plan + " --set offload.prefetch=2");
  ASSERT_EQ(fixed.exit_code, 0) << fixed.output;
  EXPECT_EQ(fixed.output.find("nothing loaded ahead"), std::string::npos) << fixed.output;
  EXPECT_EQ(fixed.output.find("\n  fits "), std::string::npos) << fixed.output;
}

}  // namespace
}  // namespace lcx
