// lcx-train --plan as a user runs it, on a machine without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <map>
#include <regex>
#include <sstream>

#include "lcx/tensor.h"
#include "support/test_util.h"

namespace lcx {
namespace {

using test::run_command;

std::string recipe() { return std::string(LCX_SOURCE_DIR) + "/configs/qwen3_8b_1m_8gpu.toml"; }

TEST(PlanCli, RecipePrintsTheBreakdownWithoutAGpu) {
  // models/Qwen3-8B is not downloaded here: the plan takes the public Qwen3-8B shape by the
  // folder's name; cp_ring plans its own ring buffers.
  auto r = run_command(test::lcx_train() + " --plan --config " + recipe() + " --gpu-memory 80GB --verbose");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const char* s : {"the public qwen3-8b shape", "1,048,576 tokens", "cp 8", "131,072 tokens per rank",
                        "weights", "gradients", "master weights", "optimizer state", "saved activations (GPU)",
                        "saved activations (host)", "largest transient", "allocator reserve", "peak",
                        "pinned host memory", "longest sequence: ", "ring K/V receive buffers",
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

// The 16-GPU recipe stacks sp_ulysses over cp_ring; the plan counts both at the composed
// shard (4,194,304 / 16 tokens per rank; the ring over the cp shard's rows on the rank's heads).
TEST(PlanCli, SixteenGpuRecipePlansTheStackedMesh) {
  auto r = run_command(test::lcx_train() + " --plan --config " + std::string(LCX_SOURCE_DIR) +
                       "/configs/qwen3_8b_4m_16gpu.toml --gpu-memory 141GB --verbose");
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

// The parts of `--plan`'s output, read by its sections: the verdict, the recipe's values by
// <provider>.<knob>, the fix lines, and the candidates with their values.
using Knobs = std::map<std::string, std::string>;
struct Candidate {
  std::string verdict;  // "fits", "short (GPU)", "short (host)", "short (GPU, host)"
  double seconds = 0;
  Knobs knobs;
  bool chosen = false;
};
struct PlanOutput {
  std::string verdict, gpu, host, longest;  // the verdict's lines
  Knobs recipe;
  double predicted = -1;
  std::vector<std::string> fixes;
  std::vector<Candidate> candidates;
  const Candidate* chosen() const {
    for (const Candidate& c : candidates)
      if (c.chosen) return &c;
    return nullptr;
  }
  // The first candidate whose values include all of `want`.
  const Candidate* find(const Knobs& want) const {
    for (const Candidate& c : candidates)
      if (std::all_of(want.begin(), want.end(), [&](const auto& kv) {
            auto it = c.knobs.find(kv.first);
            return it != c.knobs.end() && it->second == kv.second;
          }))
        return &c;
    return nullptr;
  }
};

// The value of `name` in `knobs`; empty where absent.
std::string value_of(const Knobs& knobs, const std::string& name) {
  auto it = knobs.find(name);
  return it == knobs.end() ? std::string() : it->second;
}

// "a = 1, b.c = true" -> {a: 1, b.c: true}.
Knobs parse_knobs(const std::string& text) {
  Knobs out;
  std::stringstream ss(text);
  for (std::string item; std::getline(ss, item, ',');) {
    const size_t eq = item.find(" = ");
    if (eq == std::string::npos) continue;
    const size_t first = item.find_first_not_of(' ');
    out[item.substr(first, eq - first)] = item.substr(eq + 3);
  }
  return out;
}

PlanOutput parse_plan(const std::string& out) {
  PlanOutput p;
  std::stringstream ss(out);
  std::string section;
  const std::regex candidate(R"(^  (fits|short \([^)]*\))\s+([\d.]+) s  GPU\s+\S+ \S+  host\s+\S+ \S+  (.*?)(   <- chosen)?$)");
  const std::regex knob(R"(^  (\S+) = (\S+))");
  for (std::string line; std::getline(ss, line);) {
    if (line.empty()) {
      section.clear();
      continue;
    }
    if (line[0] != ' ') {
      section = line.substr(0, line.find_first_of(":( "));
      if (section == "verdict") p.verdict = line.substr(9);
      if (section == "recipe" && line.find("predicted step ") != std::string::npos)
        p.predicted = std::stod(line.substr(line.find("predicted step ") + 15));
      continue;
    }
    std::smatch m;
    if (section == "verdict") {
      if (line.rfind("  GPU:", 0) == 0) p.gpu = line;
      if (line.rfind("  host:", 0) == 0) p.host = line;
      if (line.rfind("  longest sequence:", 0) == 0) p.longest = line;
    } else if (section == "recipe" && std::regex_search(line, m, knob)) {
      p.recipe[m[1]] = m[2];
    } else if (section == "fixes") {
      p.fixes.push_back(line.substr(2));
    } else if (section == "candidates" && std::regex_match(line, m, candidate)) {
      p.candidates.push_back({m[1], std::stod(m[2]), parse_knobs(m[3]), m[4].matched});
    }
  }
  return p;
}

// The recipe: every candidate planned and timed by the cost model, the fastest that fits chosen.
// Kept attention (no attention forward in the backward) is predicted faster than the recompute,
// one head group faster than eight; a smaller GPU budget moves the choice to what fits.
TEST(PlanCli, ChoosesTheFastestRecipeThatFits) {
  const std::string dir = ::testing::TempDir() + "lcx-plan-recipe";
  std::filesystem::create_directories(dir);
  test::write_file(dir + "/plan.toml", "[model]\nmodule = \"qwen3\"\ninit = \"qwen3-4b\"\n[data]\nseq_len = 65536\n"
                                       "[train]\nmaster_dtype = \"bf16\"\ncheckpoint_every = 1\n"
                                       "[plugins]\nload = [\"loss_chunked\"]\n");
  // Every candidate fits 141 GB with the largest loss chunks (the plan's choice of chunk_rows).
  auto predicted = [](const PlanOutput& p, Knobs want) {
    want["loss_chunked.chunk_rows"] = "4096";
    const Candidate* c = p.find(want);
    return c ? c->seconds : -1.0;
  };
  auto big_run = run_command(test::lcx_train() + " --plan --config " + dir + "/plan.toml --gpu-memory 141GB");
  ASSERT_EQ(big_run.exit_code, 0) << big_run.output;
  const PlanOutput big = parse_plan(big_run.output);
  ASSERT_TRUE(big.chosen()) << big_run.output;
  EXPECT_EQ(big.chosen()->verdict, "fits");
  EXPECT_EQ(big.chosen()->knobs, big.recipe);
  EXPECT_EQ(big.recipe.at("qwen3.keep_attention"), "true") << big_run.output;
  EXPECT_EQ(big.recipe.at("qwen3.attention_head_groups"), "1") << big_run.output;
  const double kept = predicted(big, {{"qwen3.keep_attention", "true"}, {"qwen3.attention_head_groups", "1"}});
  const double recomputed = predicted(big, {{"qwen3.keep_attention", "false"}, {"qwen3.attention_head_groups", "1"}});
  const double grouped = predicted(big, {{"qwen3.keep_attention", "false"}, {"qwen3.attention_head_groups", "8"}});
  EXPECT_GT(kept, 5);
  EXPECT_LT(kept, recomputed);
  EXPECT_LT(recomputed, grouped);
  EXPECT_NEAR(big.predicted, kept, 0.05);
  // Kept on the GPU, 36 layers of attention outputs do not fit 55 GB: the recompute does.
  auto small_run = run_command(test::lcx_train() + " --plan --config " + dir + "/plan.toml --gpu-memory 55GB");
  ASSERT_EQ(small_run.exit_code, 0) << small_run.output;
  const PlanOutput small = parse_plan(small_run.output);
  EXPECT_EQ(small.recipe.at("qwen3.keep_attention"), "false") << small_run.output;
  EXPECT_EQ(small.recipe.at("qwen3.attention_head_groups"), "1") << small_run.output;
  // A key set in the manifest is the plan's input, not its choice: kept attention off leaves the
  // model nothing to choose there, and plans the recompute.
  auto off_run = run_command(test::lcx_train() + " --plan --config " + dir +
                             "/plan.toml --gpu-memory 141GB --set qwen3.keep_attention=false");
  ASSERT_EQ(off_run.exit_code, 0) << off_run.output;
  const PlanOutput off = parse_plan(off_run.output);
  EXPECT_EQ(predicted(off, {{"qwen3.attention_head_groups", "1"}}), recomputed) << off_run.output;
  for (const Candidate& c : off.candidates) EXPECT_EQ(c.knobs.count("qwen3.keep_attention"), 0u) << off_run.output;
}

// The MLP's tiles and the loss's chunks are the plan's choice. Qwen3-4B at 131,072 tokens: with
// room, one tile of the whole sequence and 4,096-row chunks (the least work); at 50 GB, tiles of
// 16,384 rows beside deeper recompute. Keys set in the manifest win (the recipe names no rows,
// the breakdown plans the keys'); a bad value stops the plan naming the key and the fix.
TEST(PlanCli, TilesAndLossChunksAreThePlansChoiceAndKeysWin) {
  const std::string dir = ::testing::TempDir() + "lcx-plan-rows";
  std::filesystem::create_directories(dir);
  test::write_file(dir + "/plan.toml", "[model]\nmodule = \"qwen3\"\ninit = \"qwen3-4b\"\n[data]\nseq_len = 131072\n"
                                       "[train]\nmaster_dtype = \"bf16\"\n"
                                       "[plugins]\nload = [\"loss_chunked\", \"tiled_mlp\"]\n");
  const std::string plan = test::lcx_train() + " --plan --config " + dir + "/plan.toml";
  auto big_run = run_command(plan + " --gpu-memory 141GB");
  ASSERT_EQ(big_run.exit_code, 0) << big_run.output;
  const PlanOutput big = parse_plan(big_run.output);
  ASSERT_TRUE(big.chosen()) << big_run.output;
  EXPECT_EQ(big.chosen()->verdict, "fits");
  for (const auto& [k, v] : Knobs{{"qwen3.keep_attention", "true"},
                                  {"qwen3.attention_head_groups", "1"},
                                  {"tiled_mlp.tile_rows", "131072"},
                                  {"loss_chunked.chunk_rows", "4096"}})
    EXPECT_EQ(value_of(big.recipe, k), v) << k << "\n" << big_run.output;
  auto tight_run = run_command(plan + " --gpu-memory 50GB");
  ASSERT_EQ(tight_run.exit_code, 0) << tight_run.output;
  const PlanOutput tight = parse_plan(tight_run.output);
  ASSERT_TRUE(tight.chosen()) << tight_run.output;
  EXPECT_EQ(tight.chosen()->verdict, "fits");
  EXPECT_EQ(value_of(tight.recipe, "tiled_mlp.tile_rows"), "16384") << tight_run.output;
  EXPECT_EQ(value_of(tight.recipe, "loss_chunked.chunk_rows"), "4096") << tight_run.output;
  auto keyed_run = run_command(plan + " --gpu-memory 50GB --set tiled_mlp.tile_rows=8192 --set loss_chunked.chunk_rows=256");
  ASSERT_EQ(keyed_run.exit_code, 0) << keyed_run.output;
  const PlanOutput keyed = parse_plan(keyed_run.output);
  ASSERT_TRUE(keyed.chosen()) << keyed_run.output;
  EXPECT_EQ(keyed.chosen()->knobs.count("tiled_mlp.tile_rows"), 0u) << keyed_run.output;
  EXPECT_EQ(keyed.chosen()->knobs.count("loss_chunked.chunk_rows"), 0u) << keyed_run.output;
  auto terms = run_command(plan + " --gpu-memory 50GB --set tiled_mlp.tile_rows=8192 --set loss_chunked.chunk_rows=256 "
                                  "--verbose");
  for (const char* s : {"backward: MLP dact, dgate, dup [8192,I] (one tile)", "one chunk's dlogits [256,V]"})
    EXPECT_NE(terms.output.find(s), std::string::npos) << s << "\n" << terms.output;
  auto bad = run_command(plan + " --gpu-memory 50GB --set tiled_mlp.tile_rows=big");
  EXPECT_EQ(bad.exit_code, 2) << bad.output;
  EXPECT_NE(bad.output.find("tiled_mlp.tile_rows: 'big' is neither \"auto\" nor an integer"), std::string::npos)
      << bad.output;
  EXPECT_NE(bad.output.find("fix: \"auto\" (the plan's choice"), std::string::npos) << bad.output;
}

// A provider's knob reaches the plan with no change in core: the test plugin lanes_mlp (built for
// the tests alone) declares lanes_mlp.lanes (8 or 1 scratch lanes of 256 MiB, more: faster); the
// plan searches it, prints it by its provider's name, takes 8 with room and 1 where 8 do not fit,
// and a key set wins.
TEST(PlanCli, APluginsOwnKnobIsSearchedAndPrinted) {
  const std::string dir = ::testing::TempDir() + "lcx-plan-lanes";
  std::filesystem::create_directories(dir);
  test::write_file(dir + "/plan.toml", "[model]\nmodule = \"qwen3\"\ninit = \"qwen3-0.6b\"\n[data]\nseq_len = 4096\n"
                                       "[train]\ncheckpoint_every = 1\n"
                                       "[plugins]\ndir = \"" + std::string(LCX_FIXTURE_PLUGIN_DIR) + "\"\n"
                                       "load = [\"lanes_mlp\"]\n");
  // The model's own choices set, so that the lanes alone are left to trade memory for time.
  const std::string plan = test::lcx_train() + " --plan --config " + dir +
                           "/plan.toml --host-memory 1TB --set qwen3.keep_attention=false --set qwen3.attention_head_groups=1";
  auto roomy_run = run_command(plan + " --gpu-memory 141GB");
  ASSERT_EQ(roomy_run.exit_code, 0) << roomy_run.output;
  const PlanOutput roomy = parse_plan(roomy_run.output);
  EXPECT_EQ(value_of(roomy.recipe, "lanes_mlp.lanes"), "8") << roomy_run.output;
  const Candidate* eight = roomy.find({{"lanes_mlp.lanes", "8"}});
  const Candidate* one = roomy.find({{"lanes_mlp.lanes", "1"}});
  ASSERT_TRUE(eight && one) << roomy_run.output;
  EXPECT_LT(eight->seconds, one->seconds);
  EXPECT_NE(roomy_run.output.find("scratch lanes of the test MLP"), std::string::npos) << roomy_run.output;
  // Just below the peak with 8 lanes (7 x 256 MiB above the one with a single lane): 1 lane.
  const std::string verbose = run_command(plan + " --gpu-memory 141GB --set lanes_mlp.lanes=8 --verbose").output;
  const size_t at = verbose.find("peak_bytes=");
  ASSERT_NE(at, std::string::npos) << verbose;
  const int64_t peak8 = std::stoll(verbose.substr(at + 11));
  auto tight_run = run_command(plan + " --gpu-memory " + std::to_string(peak8 - 1));
  ASSERT_EQ(tight_run.exit_code, 0) << tight_run.output;
  EXPECT_EQ(parse_plan(tight_run.output).recipe["lanes_mlp.lanes"], "1") << tight_run.output;
  // The key set: nothing left to choose.
  auto keyed_run = run_command(plan + " --gpu-memory 141GB --set lanes_mlp.lanes=1");
  ASSERT_EQ(keyed_run.exit_code, 0) << keyed_run.output;
  EXPECT_EQ(parse_plan(keyed_run.output).recipe.count("lanes_mlp.lanes"), 0u) << keyed_run.output;
}

// The verdict first (the line after the manifest's), by budget and by how much; the recipe's
// knobs each with the words users know them by; the terms only with --verbose; one longest
// sequence, defined; and a step that does not fit exits 1 with its fixes as --set lines.
TEST(PlanCli, VerdictFirstAndFixesToPaste) {
  auto r = run_command(test::lcx_train() + " --plan --config " + recipe() + " --gpu-memory 141GB --host-memory 1TB");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(r.output.find("verdict: fits\n"), r.output.find('\n') + 1) << r.output;
  const PlanOutput p = parse_plan(r.output);
  EXPECT_NE(p.gpu.find("of 141.00 GiB (--gpu-memory): fits"), std::string::npos) << p.gpu;
  EXPECT_NE(p.host.find("of 1024.00 GiB (--host-memory): fits"), std::string::npos) << p.host;
  EXPECT_NE(p.longest.find("tokens (the longest at which some recipe fits both budgets"), std::string::npos) << p.longest;
  size_t longest_lines = 0;
  for (size_t at = r.output.find("longest sequence"); at != std::string::npos; at = r.output.find("longest sequence", at + 1))
    ++longest_lines;
  EXPECT_EQ(longest_lines, 1u) << r.output;
  for (const char* words : {"gradient checkpointing", "selective recompute", "activation offload", "chunked loss"})
    EXPECT_NE(r.output.find(words), std::string::npos) << words << "\n" << r.output;
  EXPECT_EQ(r.output.find("\nterms:\n"), std::string::npos) << r.output;
  EXPECT_TRUE(p.fixes.empty()) << r.output;
  auto verbose = run_command(test::lcx_train() + " --plan --config " + recipe() + " --gpu-memory 141GB --host-memory 1TB "
                                                                                  "--verbose");
  EXPECT_NE(verbose.output.find("\nterms:\n"), std::string::npos) << verbose.output;

  // Another machine planned (--gpu-memory) with this one's host figure says which figure it took.
  auto here = run_command(test::lcx_train() + " --plan --config " + recipe() + " --gpu-memory 141GB");
  const PlanOutput h = parse_plan(here.output);
  EXPECT_TRUE(h.host.find("this machine's available memory") != std::string::npos ||
              h.host.find("not checked") != std::string::npos)
      << h.host;
  EXPECT_NE(h.host.find("--host-memory SIZE"), std::string::npos) << h.host;

  // Too small a GPU: exit 1, the verdict names the GPU's shortfall, the fixes paste as --set lines,
  // and a short candidate says which budget it lacks.
  auto small = run_command(test::lcx_train() + " --plan --config " + recipe() +
                           " --gpu-memory 40GB --host-memory 1TB --disable loss_chunked");
  EXPECT_EQ(small.exit_code, 1) << small.output;
  const PlanOutput s = parse_plan(small.output);
  EXPECT_EQ(s.verdict, "does NOT fit") << small.output;
  EXPECT_NE(s.gpu.find("short by "), std::string::npos) << s.gpu;
  auto has_fix = [&](const std::string& prefix) {
    return std::any_of(s.fixes.begin(), s.fixes.end(), [&](const std::string& f) { return f.rfind(prefix, 0) == 0; });
  };
  EXPECT_TRUE(has_fix("--set 'plugins.load=[\"rope_yarn\",\"offload\",\"cp_ring\",\"loss_chunked\"]'")) << small.output;
  EXPECT_TRUE(has_fix("--set 'plugins.load=[\"rope_yarn\",\"offload\",\"cp_ring\",\"host_adamw\",\"loss_chunked\",\"tiled_mlp\"]' "
                      "--set distributed.cp=16"))
      << small.output;
  // The shorter sequence is the longest one above, at which the run re-plans.
  const size_t tokens = s.longest.find("longest sequence: ");
  ASSERT_NE(tokens, std::string::npos) << s.longest;
  std::string longest = s.longest.substr(tokens + 18, s.longest.find(" tokens") - tokens - 18);
  std::erase(longest, ',');
  EXPECT_TRUE(has_fix("--set data.seq_len=" + longest + " ")) << small.output;
  ASSERT_FALSE(s.candidates.empty()) << small.output;
  for (const Candidate& c : s.candidates) EXPECT_EQ(c.verdict, "short (GPU)") << small.output;
}

TEST(PlanCli, ShapeFromInitWhenThePathIsCleared) {
  auto r = run_command(test::lcx_train() + " --plan --config " + recipe() +
                       " --gpu-memory 141GB --set model.path= --set model.init=qwen3-4b");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("preset qwen3-4b"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("hidden 2560"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("141.00 GiB"), std::string::npos) << r.output;
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

// The host's memory is the plan's second budget, counted per node. The 8-GPU recipe with every
// saved input in pinned memory (offload.gpu_layers = 0) pins 36 GiB per rank with the attention
// recomputed, 72.56 GiB with it kept: 288 and 580.5 GiB for the node's 8 ranks.
TEST(PlanCli, HostMemoryIsABudgetCountedOverTheNodesRanks) {
  const std::string plan = test::lcx_train() + " --plan --config " + recipe() + " --gpu-memory 141GB";
  auto r = run_command(plan + " --host-memory 125GB --set offload.gpu_layers=0 --set train.checkpoint_every=1");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  // Nothing fits 125 GB: the recipe pinning least is taken, and the breakdown is of it.
  for (const std::string& s :
       {plan_row("pinned host memory", "36.00 GiB", "per rank"), plan_row("pinned host, node", "288.00 GiB", "8 ranks on one node")})
    EXPECT_NE(r.output.find(s), std::string::npos) << s << "\n" << r.output;
  const PlanOutput p = parse_plan(r.output);
  EXPECT_EQ(p.verdict, "does NOT fit");
  EXPECT_NE(p.host.find("288.00 GiB pinned (8 ranks on one node) of 125.00 GiB (--host-memory): short by 163.00 GiB"),
            std::string::npos)
      << p.host;
  ASSERT_FALSE(p.fixes.empty()) << r.output;
  EXPECT_EQ(p.fixes.back().rfind("host: lower data.seq_len, keep fewer layers' inputs in host memory", 0), 0u) << r.output;
  ASSERT_TRUE(p.chosen()) << r.output;
  EXPECT_EQ(p.chosen()->verdict, "short (host)");
  EXPECT_DOUBLE_EQ(p.chosen()->seconds, 343.7);
  EXPECT_EQ(p.chosen()->knobs, (Knobs{{"train.checkpoint_every", "1"}, {"qwen3.keep_attention", "false"},
                                      {"loss_chunked.chunk_rows", "256"}}));
  for (const Candidate& c : p.candidates) EXPECT_NE(c.verdict, "fits") << "no recipe fits 125 GB of host: " << r.output;
  // A node with ample host memory takes the faster recipe that keeps the attention.
  auto ample_run = run_command(plan + " --host-memory 1TB --set offload.gpu_layers=0 --set train.checkpoint_every=1");
  ASSERT_EQ(ample_run.exit_code, 0) << ample_run.output;
  const PlanOutput ample = parse_plan(ample_run.output);
  EXPECT_NE(ample.host.find("of 1024.00 GiB (--host-memory): fits, 443.50 GiB to spare"), std::string::npos) << ample.host;
  EXPECT_EQ(value_of(ample.recipe, "qwen3.keep_attention"), "true") << ample_run.output;
  EXPECT_TRUE(ample.fixes.empty()) << ample_run.output;
  // Left to the plan (gpu_layers and checkpoint_every "auto"), 131,072 tokens per rank leave room
  // for every input on the GPU beside the kept attention: nothing pinned, the fastest recipe.
  auto placed_run = run_command(plan + " --host-memory 125GB");
  ASSERT_EQ(placed_run.exit_code, 0) << placed_run.output;
  const PlanOutput placed = parse_plan(placed_run.output);
  ASSERT_TRUE(placed.chosen()) << placed_run.output;
  EXPECT_EQ(placed.chosen()->verdict, "fits");
  EXPECT_DOUBLE_EQ(placed.chosen()->seconds, 272.0);
  EXPECT_EQ(placed.recipe, (Knobs{{"train.checkpoint_every", "1"}, {"qwen3.keep_attention", "true"},
                                  {"loss_chunked.chunk_rows", "4096"}, {"offload.gpu_layers", "36"}}))
      << placed_run.output;
  EXPECT_NE(placed.gpu.find("peak 115.66 GiB of 141.00 GiB"), std::string::npos) << placed.gpu;
  EXPECT_NE(placed.host.find("0.00 GiB pinned"), std::string::npos) << placed.host;

  // One rank with the offload plugin moving every input, on a host of 8 GB: 36 layer inputs of 64k
  // tokens do not fit.
  const std::string dir = ::testing::TempDir() + "lcx-plan-host";
  std::filesystem::create_directories(dir);
  test::write_file(dir + "/plan.toml", "[model]\nmodule = \"qwen3\"\ninit = \"qwen3-4b\"\n[data]\nseq_len = 65536\n"
                                       "[plugins]\nload = [\"loss_chunked\", \"offload\"]\n");
  auto small = run_command(test::lcx_train() + " --plan --config " + dir +
                           "/plan.toml --gpu-memory 141GB --host-memory 8GB --set offload.gpu_layers=0 "
                           "--set train.checkpoint_every=1");
  EXPECT_EQ(small.exit_code, 1) << small.output;
  const PlanOutput one = parse_plan(small.output);
  EXPECT_NE(one.host.find("of 8.00 GiB (--host-memory): short by 3.25 GiB"), std::string::npos) << one.host;
  ASSERT_FALSE(one.fixes.empty()) << small.output;
  EXPECT_EQ(one.fixes.back().rfind("host: lower data.seq_len", 0), 0u) << small.output;
  EXPECT_EQ(small.output.find("pinned host, node"), std::string::npos) << "one rank: " << small.output;
  auto bad = run_command(test::lcx_train() + " --plan --config " + dir + "/plan.toml --gpu-memory 141GB --host-memory lots");
  EXPECT_EQ(bad.exit_code, 2) << bad.output;
  EXPECT_NE(bad.output.find("--host-memory 'lots' is not a size"), std::string::npos) << bad.output;
}

// Qwen3-4B at 1,048,576 tokens on one H200 (139 GiB) with 125 GB of host, the recipe of
// docs/PERF.md (83.3 GiB on the GPU with every input offloaded). With every saved input in pinned
// memory (offload.gpu_layers = 0, train.checkpoint_every = 1) no recipe fits the host (180 GiB of
// inputs); left to the plan, the search keeps 13 inputs on the GPU; with 100 GB of host it saves
// every second layer's input. Those figures are unmasked attention's (attend_across_documents =
// true); masked per document, cuDNN's batches read and write the documents in place (ragged
// offsets), holding per padded row little beyond the unmasked call's accumulator and workspace,
// and the plan keeps the recipe.
TEST(PlanCli, HostBudgetMovesTheRecipeToPlacementAndDeeperRecompute) {
  const std::string dir = ::testing::TempDir() + "lcx-plan-4b-1m";
  std::filesystem::create_directories(dir);
  test::write_file(dir + "/plan.toml", "[model]\nmodule = \"qwen3\"\ninit = \"qwen3-4b\"\n[data]\nseq_len = 1048576\n"
                                       "attend_across_documents = true\n"
                                       "[train]\nmaster_dtype = \"bf16\"\n"
                                       "[plugins]\nload = [\"loss_chunked\", \"offload\", \"tiled_mlp\"]\n");
  const std::string plan = test::lcx_train() + " --plan --config " + dir + "/plan.toml --gpu-memory 139GiB --host-memory 125GB";
  auto all_out_run = run_command(plan + " --set offload.gpu_layers=0 --set train.checkpoint_every=1");
  EXPECT_EQ(all_out_run.exit_code, 1) << all_out_run.output;
  const PlanOutput all_out = parse_plan(all_out_run.output);
  ASSERT_FALSE(all_out.fixes.empty()) << all_out_run.output;
  EXPECT_EQ(all_out.fixes.back().rfind("host: ", 0), 0u) << all_out_run.output;
  for (const Candidate& c : all_out.candidates)
    EXPECT_NE(c.verdict, "fits") << "180 GiB of inputs do not fit 125 GB: " << all_out_run.output;
  EXPECT_NE(all_out_run.output.find(plan_row("saved activations (host)", "180.00 GiB", "pinned, not on the GPU")),
            std::string::npos)
      << all_out_run.output;

  const Knobs placed{{"qwen3.keep_attention", "false"}, {"qwen3.attention_head_groups", "4"}, {"offload.gpu_layers", "13"}};
  auto chosen_run = run_command(plan);
  ASSERT_EQ(chosen_run.exit_code, 0) << chosen_run.output;
  const PlanOutput chosen = parse_plan(chosen_run.output);
  ASSERT_TRUE(chosen.chosen()) << chosen_run.output;
  EXPECT_EQ(chosen.chosen()->verdict, "fits");
  EXPECT_EQ(chosen.find(placed), chosen.chosen()) << chosen_run.output;
  const PlanOutput masked = parse_plan(run_command(plan + " --set data.attend_across_documents=false").output);
  ASSERT_TRUE(masked.chosen());
  EXPECT_EQ(masked.find(placed), masked.chosen());
  EXPECT_TRUE(chosen.fixes.empty()) << chosen_run.output;
  EXPECT_NE(chosen.host.find("of 125.00 GiB (--host-memory): fits"), std::string::npos) << chosen.host;
  EXPECT_NE(chosen.gpu.find("of 139.00 GiB (--gpu-memory)"), std::string::npos) << chosen.gpu;
  EXPECT_NE(chosen.longest.find(" tokens (the longest"), std::string::npos) << chosen.longest;
  auto deeper_run = run_command(test::lcx_train() + " --plan --config " + dir +
                                "/plan.toml --gpu-memory 139GiB --host-memory 100GB");
  ASSERT_EQ(deeper_run.exit_code, 0) << deeper_run.output;
  const PlanOutput deeper = parse_plan(deeper_run.output);
  ASSERT_TRUE(deeper.chosen()) << deeper_run.output;
  EXPECT_EQ(deeper.chosen()->verdict, "fits");
  EXPECT_EQ(value_of(deeper.recipe, "train.checkpoint_every"), "2") << deeper_run.output;
}

// Qwen3-8B at 1M on a GPU of 131 GiB (8 GiB below the H200's, where prefetching two inputs fits
// with every second layer saved): with the offload's own prefetch window (3 inputs of 8 GiB)
// nothing fits both budgets; the plan then tries loading nothing ahead (the window's bytes go to
// saved inputs, each copy in is exposed and costed) and fits with every third layer saved. A
// prefetch key set wins: then only rebuilding each input from its saved one (train.rebuild_each, a
// deeper and slower recompute) fits beside the window.
TEST(PlanCli, NothingLoadedAheadWhenTheWindowDoesNotFit) {
  const std::string dir = ::testing::TempDir() + "lcx-plan-8b-1m";
  std::filesystem::create_directories(dir);
  test::write_file(dir + "/plan.toml", "[model]\nmodule = \"qwen3\"\ninit = \"qwen3-8b\"\n[data]\nseq_len = 1048576\n"
                                       "[train]\nmaster_dtype = \"bf16\"\n"
                                       "[plugins]\nload = [\"loss_chunked\", \"offload\", \"tiled_mlp\"]\n");
  const std::string plan = test::lcx_train() + " --plan --config " + dir + "/plan.toml --gpu-memory 131GiB --host-memory 120GiB";
  auto chosen_run = run_command(plan);
  ASSERT_EQ(chosen_run.exit_code, 0) << chosen_run.output;
  const PlanOutput chosen = parse_plan(chosen_run.output);
  ASSERT_TRUE(chosen.chosen()) << chosen_run.output;
  EXPECT_EQ(chosen.chosen()->verdict, "fits");
  EXPECT_EQ(value_of(chosen.recipe, "train.checkpoint_every"), "3") << chosen_run.output;
  EXPECT_EQ(value_of(chosen.recipe, "offload.gpu_layers"), "1") << chosen_run.output;
  EXPECT_EQ(value_of(chosen.recipe, "offload.prefetch"), "0") << chosen_run.output;
  EXPECT_EQ(value_of(chosen.recipe, "train.rebuild_each"), "false") << chosen_run.output;
  auto fixed_run = run_command(plan + " --set offload.prefetch=2");
  const PlanOutput fixed = parse_plan(fixed_run.output);
  ASSERT_FALSE(fixed.candidates.empty()) << fixed_run.output;
  for (const Candidate& c : fixed.candidates) {
    EXPECT_EQ(c.knobs.count("offload.prefetch"), 0u) << fixed_run.output;
    if (c.verdict == "fits") {
      ASSERT_TRUE(c.knobs.count("train.rebuild_each")) << fixed_run.output;
      EXPECT_EQ(c.knobs.at("train.rebuild_each"), "true") << fixed_run.output;
      EXPECT_GT(c.seconds, chosen.chosen()->seconds) << fixed_run.output;
    }
  }
}

}  // namespace
}  // namespace lcx
