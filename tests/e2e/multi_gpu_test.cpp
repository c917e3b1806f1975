// Worker processes on several GPUs, one rank each, talking through NCCL: lcx-train started with
// [distributed] nproc_per_node = 2 must train as the in-process virtual ranks on one GPU do (data
// parallel, ZeRO-3 sharded), and cp_ring / sp_ulysses across two GPUs must train as one rank.
// Skipped, visibly, on machines with fewer than two GPUs.
#include <gtest/gtest.h>

#include <fstream>
#include <random>

#include "lcx/tensor.h"
#include "support/test_util.h"
#include "support/trained_run.h"

namespace lcx {
namespace {

using Trained = test::TrainedRun;

struct MultiGpu : ::testing::Test {
  std::filesystem::path dir = test::temp_dir("multi-gpu");
  void SetUp() override {
    if (cuda_device_count() < 2) GTEST_SKIP() << "needs 2 GPUs, this machine has " << cuda_device_count();
    if (!std::filesystem::exists(test::qwen3_tokenizer())) GTEST_SKIP() << "data/qwen3/tokenizer.json absent";
    std::ofstream out(dir / "data.tokens", std::ios::binary);
    std::mt19937 rng(11);
    for (int i = 0; i < 32 * 24; ++i) {
      const uint32_t t = rng() % 256;
      out.write(reinterpret_cast<const char*>(&t), 4);
    }
  }

  // Three steps on the GPU; `tables` adds [plugins] / [distributed] tables.
  Trained train(const std::string& name, const std::string& train_lines, const std::string& tables,
                const std::string& overrides = "") {
    const auto out = dir / name;
    test::write_file(out / "run.toml", test::tiny_run_manifest(out, dir / "data.tokens", 5, false,
                                                               "max_steps = 3\nweight_decay = 0.1\n" + train_lines, tables));
    const auto r = test::run_command(test::lcx_train() + " --config " + (out / "run.toml").string() + " --set run.device=cuda" + overrides);
    EXPECT_EQ(r.exit_code, 0) << r.output;
    return test::read_trained_run(out, "checkpoint-3");
  }
};

void expect_same(const Trained& got, const Trained& want, double loss_tol, double weight_tol, const std::string& what) {
  ASSERT_EQ(got.losses.size(), 3u) << what;
  ASSERT_EQ(want.losses.size(), 3u) << what;
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_NEAR(got.losses[i], want.losses[i], loss_tol * want.losses[i]) << what << ", step " << i + 1;
    EXPECT_NEAR(got.grad_norms[i], want.grad_norms[i], 20 * loss_tol * want.grad_norms[i]) << what << ", step " << i + 1;
  }
  ASSERT_EQ(got.weights.size(), want.weights.size()) << what;
  for (const auto& [name, a] : got.weights) {
    const auto& b = want.weights.at(name);
    EXPECT_LE(test::rel_l2(a, b), weight_tol) << what << ": " << name;
  }
}

TEST_F(MultiGpu, NcclWorkersTrainAsVirtualRanks) {
  for (bool shard : {true, false}) {
    const std::string d = str("[distributed]\nnproc_per_node = 2\nshard_parameters = ", shard ? "true" : "false", "\n");
    const Trained threads = train(str("virtual", shard), "", d + "virtual_ranks = true\n");
    const Trained nccl = train(str("nccl", shard), "", d);
    expect_same(nccl, threads, 1e-5, 1e-4, str("2 NCCL workers vs 2 virtual ranks, shard ", shard));
  }
}

TEST_F(MultiGpu, CpRingAcrossTwoGpusTrainsAsOneRank) {
  const Trained one = train("cp1", "", "");
  // The data is one continuous text here (no EOS in it), as the one-rank run reads it.
  const Trained two = train("cp2", "", "[plugins]\nload = [\"cp_ring\"]\n[distributed]\nnproc_per_node = 2\ncp = 2\n",
                            " --set data.attend_across_documents=true");
  expect_same(two, one, 1e-5, 1e-3, "cp_ring over 2 GPUs");
}

TEST_F(MultiGpu, UlyssesAcrossTwoGpusTrainsAsOneRank) {
  const Trained one = train("sp1", "", "");
  const Trained two =
      train("sp2", "", "[plugins]\nload = [\"sp_ulysses\"]\n[distributed]\nnproc_per_node = 2\nsp = 2\n");
  expect_same(two, one, 1e-5, 1e-3, "sp_ulysses over 2 GPUs");
}

}  // namespace
}  // namespace lcx
