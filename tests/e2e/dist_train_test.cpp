// Data-parallel training with thread-ranks on the CPU: N ranks, each one sequence a step, must
// train the same model as one rank that accumulates the same N sequences, with and without
// ZeRO-3 sharding of parameters, gradients and optimizer state.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <map>
#include <random>
#include <nlohmann/json.hpp>

#include "lcx/error.h"
#include "lcx/safetensors.h"
#include "lcx/tensor.h"
#include "support/test_util.h"

namespace lcx {
namespace {


struct DistTrain : ::testing::Test {
  std::filesystem::path dir = test::temp_dir("dist");
  // Each test's runs write checkpoints of several hundred MB: gone with the test.
  void TearDown() override {
    std::error_code ec;
    std::filesystem::remove_all(dir, ec);
  }
  void SetUp() override {
    if (!std::filesystem::exists(test::qwen3_tokenizer())) GTEST_SKIP() << "data/qwen3/tokenizer.json absent: run scripts/fetch_data.sh";
    std::ofstream out(dir / "data.tokens", std::ios::binary);
    std::mt19937 rng(7);
    for (int i = 0; i < 32 * 24; ++i) {
      uint32_t t = rng() % 256;
      out.write(reinterpret_cast<const char*>(&t), 4);
    }
  }

  // Trains 3 steps; returns the losses and the final weights.
  // `args`: more command-line arguments (e.g. --set run.device=cuda).
  std::pair<std::vector<double>, std::map<std::string, std::vector<float>>> train(const std::string& name,
                                                                                  const std::string& extra,
                                                                                  const std::string& args = {}) {
    auto out = dir / name;
    // extra: [train] lines first, then other tables.
    std::string text = test::tiny_run_manifest(out, dir / "data.tokens", 5, false, "max_steps = 3\nweight_decay = 0.1\n" + extra);
    test::write_file(out / "run.toml", text);
    auto r = test::run_command(test::lcx_train() + " --config " + (out / "run.toml").string() + " " + args);
    EXPECT_EQ(r.exit_code, 0) << r.output;
    std::vector<double> losses;
    std::ifstream in(out / "metrics.jsonl");
    for (std::string line; std::getline(in, line);) losses.push_back(nlohmann::json::parse(line).at("loss").get<double>());
    std::map<std::string, std::vector<float>> weights;
    auto ck = safetensors::Checkpoint::open((out / "checkpoint-3").string());
    for (const auto& n : ck.names()) weights[n] = ck.load(n, DType::f32).to_floats();
    return {losses, weights};
  }
};

void expect_close(const std::map<std::string, std::vector<float>>& a, const std::map<std::string, std::vector<float>>& b,
                  double tol = 1e-5) {
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [name, va] : a) {
    const auto& vb = b.at(name);
    EXPECT_LE(test::rel_l2(va, vb), tol) << name;
  }
}

TEST_F(DistTrain, RanksMatchOneRankWithAndWithoutSharding) {
  for (int n : {2, 4}) {
    auto one = train(str("one", n), str("grad_accum = ", n, "\n"));
    ASSERT_EQ(one.first.size(), 3u);
    for (bool shard : {false, true}) {
      auto many = train(str("ranks", n, shard ? "z" : "r"),
                        str("[distributed]\nnproc_per_node = ", n, "\nshard_parameters = ", shard ? "true" : "false", "\n"));
      ASSERT_EQ(many.first.size(), 3u) << n << " ranks, shard " << shard;
      for (size_t i = 0; i < 3; ++i) EXPECT_NEAR(many.first[i], one.first[i], 1e-5 * one.first[i]) << n << " ranks step " << i;
      expect_close(many.second, one.second);
    }
  }
}

// bf16 weights: sharded ranks compute in bf16 as unsharded ones do. Between layers a sharded
// parameter has no full value (the head included), so the step cannot read the activations'
// dtype off the head; it once fell back to fp32 there, which on a GPU also meant the fp32
// attention kernels instead of cuDNN's bf16 ones (27x slower at 8B).
TEST_F(DistTrain, ShardedRanksComputeInTheWeightsDtype) {
  const std::string bf16 = "--set model.dtype=bf16";
  auto plain = train("bf16r", "[distributed]\nnproc_per_node = 2\nshard_parameters = false\n", bf16);
  auto sharded = train("bf16z", "[distributed]\nnproc_per_node = 2\nshard_parameters = true\n", bf16);
  auto fp32 = train("fp32z", "[distributed]\nnproc_per_node = 2\nshard_parameters = true\n");
  ASSERT_EQ(plain.first.size(), 3u);
  ASSERT_EQ(sharded.first.size(), 3u);
  ASSERT_EQ(fp32.first.size(), 3u);
  // The first step's loss depends only on the initial weights and the activations' dtype.
  EXPECT_GT(std::abs(plain.first[0] - fp32.first[0]), 1e-6 * fp32.first[0]) << "bf16 and fp32 agree: the check is blind";
  EXPECT_NEAR(sharded.first[0], plain.first[0], 1e-7 * plain.first[0]);
}

// Virtual ranks: threads sharing one GPU, sharded (ZeRO-3) by default. The GPU sums in another
// order than the CPU, so the tolerances are fp32-on-GPU ones.
TEST_F(DistTrain, VirtualRanksOnOneGpuMatchOneRank) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU on this machine";
  const std::string gpu = "--set run.device=cuda";
  for (int n : {2, 4}) {
    auto one = train(str("gpu_one", n), str("grad_accum = ", n, "\n"), gpu);
    auto many = train(str("gpu_ranks", n), str("[distributed]\nnproc_per_node = ", n, "\nvirtual_ranks = true\n"), gpu);
    ASSERT_EQ(many.first.size(), 3u);
    for (size_t i = 0; i < 3; ++i) EXPECT_NEAR(many.first[i], one.first[i], 1e-4 * one.first[i]) << n << " ranks step " << i;
    expect_close(many.second, one.second, 1e-3);
  }
}

TEST_F(DistTrain, ShardedCheckpointResumesOnTheSameRanksOnly) {
  auto full = train("z", "save_steps = 1\n[distributed]\nnproc_per_node = 2\n");
  ASSERT_TRUE(std::filesystem::exists(dir / "z" / "checkpoint-2" / "optimizer-rank1-of-2.safetensors"));
  auto m = (dir / "z" / "run.toml").string();
  std::filesystem::remove_all(dir / "z" / "checkpoint-3");
  std::filesystem::remove(dir / "z" / "metrics.jsonl");
  auto r = test::run_command(test::lcx_train() + " --config " + m + " --resume latest");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::ifstream in(dir / "z" / "metrics.jsonl");
  std::string line;
  ASSERT_TRUE(std::getline(in, line));
  EXPECT_EQ(nlohmann::json::parse(line).at("loss").get<double>(), full.first[2]);
  auto bad = test::run_command(test::lcx_train() + " --config " + m + " --resume latest --set distributed.nproc_per_node=4");
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.output.find("sharded over 2 ranks"), std::string::npos) << bad.output;
}

// cp_ring over 2 thread-ranks on packed documents trains as one rank does. With more than one rank
// per sequence the trainer cuts each step's later sequences and the next step's on a worker thread
// while the step runs (cp_ring's layouts of packed documents take host time), so this run also
// checks that the worker's shard() calls, beside the step's attention, change nothing.
TEST_F(DistTrain, CpRingThreadRanksTrainPackedDocumentsAsOneRank) {
  // Short documents: Qwen3's <|endoftext|> (id 151643) closes each, so the model's vocabulary
  // must hold it.
  std::ofstream out(dir / "docs.tokens", std::ios::binary);
  std::mt19937 rng(13);
  for (int i = 0; i < 32 * 24; ++i) {
    const uint32_t t = rng() % 7 == 0 ? 151643u : rng() % 256;
    out.write(reinterpret_cast<const char*>(&t), 4);
  }
  out.close();
  auto run = [&](const std::string& name, const std::string& tables, const std::string& args = {}) {
    const auto o = dir / name;
    std::string text = test::tiny_run_manifest(o, dir / "docs.tokens", 5, false, "max_steps = 3\ngrad_accum = 2\n", tables);
    const std::string small = "\"vocab_size\": 256", large = "\"vocab_size\": 151936";
    text.replace(text.find(small), small.size(), large);
    test::write_file(o / "run.toml", text);
    const auto r = test::run_command(test::lcx_train() + " --config " + (o / "run.toml").string() + args);
    EXPECT_EQ(r.exit_code, 0) << r.output;
    return o;
  };
  std::map<std::string, std::vector<double>> flops;
  auto losses = [&](const std::filesystem::path& o) {
    std::vector<double> v;
    std::ifstream in(o / "metrics.jsonl");
    for (std::string line; std::getline(in, line);) {
      const auto j = nlohmann::json::parse(line);
      EXPECT_GE(j.at("time_shard_s").get<double>(), 0.0) << line;
      v.push_back(j.at("loss").get<double>());
      flops[o.filename().string()].push_back(j.at("flops").get<double>());
      // 2 sequences a step of short documents (an EOS every 7 tokens or so, in 32-token sequences)
      EXPECT_GT(j.at("documents").get<int64_t>(), 4) << line;
    }
    return v;
  };
  const auto one = losses(run("docs_one", ""));
  const auto across = losses(run("docs_across", "", " --set data.attend_across_documents=true"));
  // The step's FLOPs count the attention it does: each document's own square when masked, the
  // sequence's when not. Same sequences, so the two differ by 6 x layers x heads x head_dim (the
  // tiny model's 2, 4, 8) times a whole number of pairs, and only there.
  ASSERT_EQ(flops["docs_one"].size(), 3u);
  ASSERT_EQ(flops["docs_across"].size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    const double pairs = (flops["docs_across"][i] - flops["docs_one"][i]) / (6.0 * 2 * 4 * 8);
    EXPECT_GT(pairs, 32.0) << "step " << i + 1 << ": masked documents counted as one causal sequence";
    EXPECT_NEAR(pairs, std::round(pairs), 1e-6) << "step " << i + 1;
  }
  const auto two = losses(run("docs_cp2", "[plugins]\nload = [\"cp_ring\"]\n[distributed]\nnproc_per_node = 2\ncp = 2\n"));
  ASSERT_EQ(one.size(), 3u);
  ASSERT_EQ(across.size(), 3u);
  ASSERT_EQ(two.size(), 3u);
  // The documents are masked: attending across them trains otherwise (else this check is blind).
  EXPECT_GT(std::abs(across[0] - one[0]), 1e-4 * one[0]);
  for (size_t i = 0; i < 3; ++i) EXPECT_NEAR(two[i], one[i], 1e-5 * one[i]) << "step " << i + 1;
}

}  // namespace
}  // namespace lcx
