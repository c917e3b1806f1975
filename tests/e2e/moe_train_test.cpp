// Qwen3-MoE end to end on the CPU, through the real lcx-train: a tiny qwen3_moe (every layer
// sparse, the load-balancing loss trained) trains on dp 2 (ZeRO-3), cp_ring 2, sp_ulysses 2 and
// cp 2 x sp 2 thread-ranks, with the experts in token tiles, chunked loss and offload, as on one
// rank with 2 sequences a step (the auxiliary loss is the mean over a step's sequences, its
// statistics summed over the ranks sharing one); the log carries aux_loss and the experts' load;
// a run resumes bit for bit; expert parallelism (ep 2) trains as one rank and resumes bit for bit;
// LoRA on the experts ([lora] experts = true) trains on ep 2 as on one rank, its checkpoints hold
// every expert's factors under PEFT's keys, and it resumes bit for bit.
#include <gtest/gtest.h>

#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>

#include "lcx/safetensors.h"
#include "support/test_util.h"

namespace lcx {
namespace {

namespace fs = std::filesystem;

struct MoeTrain : ::testing::Test {
  fs::path dir = test::temp_dir("moe-e2e");
  void SetUp() override {
    if (!fs::exists(test::qwen3_tokenizer())) GTEST_SKIP() << "data/qwen3/tokenizer.json absent: run scripts/fetch_data.sh";
    std::ofstream out(dir / "data.tokens", std::ios::binary);
    std::mt19937 rng(4);
    for (int i = 0; i < 32 * 24; ++i) {
      const uint32_t t = rng() % 256;
      out.write(reinterpret_cast<const char*>(&t), 4);
    }
  }

  struct Result {
    int exit_code = -1;
    std::string output;
    std::vector<nlohmann::json> rows;  // metrics.jsonl's step rows
    std::map<std::string, std::vector<float>> weights;  // the last checkpoint's model.safetensors
  };

  // 3 steps of a tiny qwen3_moe with `plugins` loaded; `train` adds [train] lines, `tables` more tables.
  Result train(const std::string& name, const std::vector<std::string>& plugins, const std::string& train = "",
               const std::string& tables = "", const std::string& args = "") {
    const fs::path o = dir / name;
    std::string load;
    for (const auto& p : plugins) load += (load.empty() ? "\"" : ", \"") + p + "\"";
    std::string text = test::tiny_run_manifest(o, dir / "data.tokens", 5, false, "max_steps = 3\n" + train,
                                               "[plugins]\nload = [" + load + "]\n" + tables);
    const std::string dense = "\"vocab_size\": 256,";
    text.replace(text.find(dense), dense.size(),
                 "\"vocab_size\": 256, \"model_type\": \"qwen3_moe\", \"num_experts\": 6, \"num_experts_per_tok\": 2, "
                 "\"moe_intermediate_size\": 24, \"norm_topk_prob\": true, \"output_router_logits\": true, "
                 "\"router_aux_loss_coef\": 0.05,");
    test::write_file(o / "run.toml", text);
    Result r;
    const auto c = test::run_command(test::lcx_train() + " --config " + (o / "run.toml").string() + " " + args);
    r.exit_code = c.exit_code;
    r.output = c.output;
    std::ifstream in(o / "metrics.jsonl");
    for (std::string line; std::getline(in, line);) {
      nlohmann::json j = nlohmann::json::parse(line);
      if (j.contains("step_s")) r.rows.push_back(std::move(j));
    }
    const fs::path ck = o / "checkpoint-3" / "model.safetensors";
    if (fs::exists(ck)) {
      auto st = safetensors::Checkpoint::open(ck.string());
      for (const auto& n : st.names()) r.weights[n] = st.load(n, DType::f32).to_floats();
    }
    return r;
  }
};

void expect_same_training(const MoeTrain::Result& got, const MoeTrain::Result& want, const std::string& what) {
  ASSERT_EQ(got.exit_code, 0) << what << "\n" << got.output;
  ASSERT_EQ(got.rows.size(), 3u) << what;
  for (size_t i = 0; i < 3; ++i) {
    const double loss = want.rows[i].at("loss").get<double>(), aux = want.rows[i].at("aux_loss").get<double>();
    EXPECT_NEAR(got.rows[i].at("loss").get<double>(), loss, 1e-5 * loss) << what << " step " << i + 1;
    EXPECT_NEAR(got.rows[i].at("aux_loss").get<double>(), aux, 1e-5 * aux) << what << " step " << i + 1;
  }
  ASSERT_EQ(got.weights.size(), want.weights.size()) << what;
  for (const auto& [name, v] : want.weights) EXPECT_LE(test::rel_l2(got.weights.at(name), v), 1e-4) << what << " " << name;
}

TEST_F(MoeTrain, EveryMeshAndPluginTrainsAsOneRank) {
  const Result one = train("one", {}, "grad_accum = 2\n");
  ASSERT_EQ(one.exit_code, 0) << one.output;
  ASSERT_EQ(one.rows.size(), 3u);
  for (const auto& r : one.rows) {
    EXPECT_GT(r.at("aux_loss").get<double>(), 0.9);  // E sum_e f_e P_e is 1 when balanced, more when not
    EXPECT_GE(r.at("expert_tokens_max").get<int64_t>(), r.at("expert_tokens_min").get<int64_t>());
  }
  EXPECT_TRUE(one.weights.count("model.layers.1.mlp.experts.5.down_proj.weight")) << "the Hub's layout, per expert";
  EXPECT_NE(one.output.find("'aux_loss'"), std::string::npos) << one.output;
  expect_same_training(train("dp2", {}, "", "[distributed]\nnproc_per_node = 2\n"), one, "dp 2 (ZeRO-3)");
  expect_same_training(train("cp2", {"cp_ring"}, "grad_accum = 2\n", "[distributed]\nnproc_per_node = 2\ncp = 2\n"), one,
                       "cp_ring 2");
  expect_same_training(train("sp2", {"sp_ulysses"}, "grad_accum = 2\n", "[distributed]\nnproc_per_node = 2\nsp = 2\n"), one,
                       "sp_ulysses 2");
  expect_same_training(train("cp2sp2", {"cp_ring", "sp_ulysses"}, "grad_accum = 2\n",
                             "[distributed]\nnproc_per_node = 4\ncp = 2\nsp = 2\n"),
                       one, "cp 2 x sp 2");
  expect_same_training(train("plugins", {"loss_chunked", "offload"}, "grad_accum = 2\n",
                             "[loss_chunked]\nchunk_rows = 8\n[qwen3]\nmoe_tile_rows = 10\n"),
                       one, "loss_chunked + offload + token tiles of 10");
}

TEST_F(MoeTrain, ResumesBitForBit) {
  const Result straight = train("resume", {}, "save_steps = 1\n");
  ASSERT_EQ(straight.exit_code, 0) << straight.output;
  const auto saved = straight.weights;
  fs::remove_all(dir / "resume" / "checkpoint-3");
  fs::remove(dir / "resume" / "metrics.jsonl");
  const Result resumed = train("resume", {}, "save_steps = 1\n", "", "--resume latest");  // from checkpoint-2
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  ASSERT_EQ(resumed.rows.size(), 1u);
  EXPECT_EQ(resumed.rows[0].at("loss"), straight.rows[2].at("loss"));
  EXPECT_EQ(resumed.rows[0].at("aux_loss"), straight.rows[2].at("aux_loss"));
  for (const auto& [name, v] : saved) EXPECT_EQ(resumed.weights.at(name), v) << name;
}

// Expert parallelism ([distributed] ep 2, parameters replicated): each rank holds 3 of the 6
// experts, its optimizer state only theirs. Across dp 2, inside cp 2 (with the experts in token
// tiles of 10) and inside dp 2 x cp 2 (the experts' gradients summed over the two ranks holding
// the same experts) it trains as one rank does with 2 sequences a step: loss, aux_loss, and the
// checkpoint's weights, every expert written in the Hub's layout; so it does when the epoch's last
// step leaves one dp rank without a sequence. It resumes bit for bit, and is refused by key with
// ZeRO-3, on one rank, and where ep does not divide the 6 experts (ep 4).
TEST_F(MoeTrain, ExpertParallelTrainsAsOneRankAndResumes) {
  const Result one = train("one", {}, "grad_accum = 2\n");
  ASSERT_EQ(one.exit_code, 0) << one.output;
  const std::string ep = "ep = 2\nshard_parameters = false\n";
  expect_same_training(train("ep2dp2", {}, "", "[distributed]\nnproc_per_node = 2\n" + ep), one, "ep 2 across dp 2");
  expect_same_training(train("ep2cp2", {"cp_ring"}, "grad_accum = 2\n",
                             "[distributed]\nnproc_per_node = 2\ncp = 2\n" + ep + "[qwen3]\nmoe_tile_rows = 10\n"),
                       one, "ep 2 inside cp 2, token tiles of 10");
  expect_same_training(train("ep2dp2cp2", {"cp_ring"}, "", "[distributed]\nnproc_per_node = 4\ncp = 2\n" + ep), one,
                       "ep 2 inside dp 2 x cp 2");
  EXPECT_TRUE(one.weights.count("model.layers.1.mlp.experts.5.down_proj.weight"));
  // Steps of 10 sequences over the 24: the third has 4, all on the first dp rank; the second runs
  // as many passes that weigh nothing, so its experts serve the first rank's rows.
  const Result ten = train("one10", {}, "grad_accum = 10\n");
  ASSERT_EQ(ten.exit_code, 0) << ten.output;
  expect_same_training(train("ep2short", {}, "grad_accum = 5\n", "[distributed]\nnproc_per_node = 2\n" + ep), ten,
                       "ep 2 across dp 2, a short last step");

  const std::string tables = "[distributed]\nnproc_per_node = 2\n" + ep;
  const Result straight = train("ep_resume", {}, "save_steps = 1\n", tables);
  ASSERT_EQ(straight.exit_code, 0) << straight.output;
  EXPECT_TRUE(fs::exists(dir / "ep_resume" / "checkpoint-3" / "optimizer-experts1-of-2.safetensors"));
  const auto saved = straight.weights;
  fs::remove_all(dir / "ep_resume" / "checkpoint-3");
  fs::remove(dir / "ep_resume" / "metrics.jsonl");
  const Result resumed = train("ep_resume", {}, "save_steps = 1\n", tables, "--resume latest");
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  ASSERT_EQ(resumed.rows.size(), 1u);
  EXPECT_EQ(resumed.rows[0].at("loss"), straight.rows[2].at("loss"));
  EXPECT_EQ(resumed.rows[0].at("aux_loss"), straight.rows[2].at("aux_loss"));
  EXPECT_EQ(resumed.rows[0].at("grad_norm"), straight.rows[2].at("grad_norm"));
  ASSERT_EQ(resumed.weights.size(), saved.size());
  for (const auto& [name, v] : saved) EXPECT_EQ(resumed.weights.at(name), v) << name;
  std::printf("ep 2 across dp 2: step 3 loss %.7f (one rank %.7f), aux %.7f (%.7f), grad norm %.6f (%.6f); resumed step 3 "
              "loss %.7f\n",
              straight.rows[2].at("loss").get<double>(), one.rows[2].at("loss").get<double>(),
              straight.rows[2].at("aux_loss").get<double>(), one.rows[2].at("aux_loss").get<double>(),
              straight.rows[2].at("grad_norm").get<double>(), one.rows[2].at("grad_norm").get<double>(),
              resumed.rows[0].at("loss").get<double>());
  EXPECT_NEAR(straight.rows[2].at("grad_norm").get<double>(), one.rows[2].at("grad_norm").get<double>(),
              1e-4 * one.rows[2].at("grad_norm").get<double>());

  const Result zero3 = train("ep_zero3", {}, "", "[distributed]\nnproc_per_node = 2\nep = 2\n");
  EXPECT_NE(zero3.exit_code, 0);
  EXPECT_NE(zero3.output.find("shard_parameters"), std::string::npos) << zero3.output;
  const Result alone = train("ep_alone", {}, "", "[distributed]\nep = 2\nshard_parameters = false\n");
  EXPECT_NE(alone.exit_code, 0);
  EXPECT_NE(alone.output.find("[distributed] ep = 2 splits the experts"), std::string::npos) << alone.output;
  const Result four = train("ep_four", {}, "", "[distributed]\nnproc_per_node = 4\nep = 4\nshard_parameters = false\n");
  EXPECT_NE(four.exit_code, 0);
  EXPECT_NE(four.output.find("does not divide the model's 6 experts"), std::string::npos) << four.output;
}

// LoRA with the experts adapted: one rank with 2 sequences a step, ZeRO-3 over dp 2, and ep 2
// across dp 2 (each rank holding 3 experts' factors), train alike; the ep run's checkpoints gather every expert's factors
// to rank 0 (PEFT's per-expert keys), equal to one rank's, and a resume from step 2 repeats step 3
// bit for bit.
TEST_F(MoeTrain, ExpertLoraTrainsOnExpertRanksAsOneRankAndResumes) {
  const std::string lora = "[lora]\nr = 4\nalpha = 8\nexperts = true\n";
  auto adapter = [&](const std::string& name) {
    std::map<std::string, std::vector<float>> out;
    const fs::path f = dir / name / "checkpoint-3" / "adapter_model.safetensors";
    if (!fs::exists(f)) return out;
    auto st = safetensors::Checkpoint::open(f.string());
    for (const auto& n : st.names()) out[n] = st.load(n, DType::f32).to_floats();
    return out;
  };
  const Result one = train("lora_one", {"lora"}, "grad_accum = 2\nsave_steps = 3\n", lora);
  ASSERT_EQ(one.exit_code, 0) << one.output;
  const std::string tables = lora + "[distributed]\nnproc_per_node = 2\nep = 2\nshard_parameters = false\n";
  const Result ep = train("lora_ep", {"lora"}, "save_steps = 1\n", tables);
  ASSERT_EQ(ep.exit_code, 0) << ep.output;
  ASSERT_EQ(ep.rows.size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    const double loss = one.rows[i].at("loss").get<double>();
    EXPECT_NEAR(ep.rows[i].at("loss").get<double>(), loss, 1e-5 * loss) << "step " << i + 1;
    // The gradient norm counts each expert's factors once, as one rank does.
    const double norm = one.rows[i].at("grad_norm").get<double>();
    EXPECT_NEAR(ep.rows[i].at("grad_norm").get<double>(), norm, 1e-4 * norm) << "step " << i + 1;
  }
  // ZeRO-3 over dp 2 (ep 1): the experts' factors sharded with the rest, gathered per layer.
  const Result zero3 = train("lora_zero3", {"lora"}, "save_steps = 3\n", lora + "[distributed]\nnproc_per_node = 2\n");
  ASSERT_EQ(zero3.exit_code, 0) << zero3.output;
  ASSERT_EQ(zero3.rows.size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    const double loss = one.rows[i].at("loss").get<double>();
    EXPECT_NEAR(zero3.rows[i].at("loss").get<double>(), loss, 1e-5 * loss) << "ZeRO-3, step " << i + 1;
    const double norm = one.rows[i].at("grad_norm").get<double>();
    EXPECT_NEAR(zero3.rows[i].at("grad_norm").get<double>(), norm, 1e-4 * norm) << "ZeRO-3, step " << i + 1;
  }
  const auto want = adapter("lora_one"), got = adapter("lora_ep");
  const auto sharded = adapter("lora_zero3");
  ASSERT_EQ(sharded.size(), want.size());
  for (const auto& [name, v] : want) EXPECT_LE(test::rel_l2(sharded.at(name), v), 1e-4) << "ZeRO-3 " << name;
  ASSERT_EQ(got.size(), want.size());
  EXPECT_TRUE(want.count("base_model.model.model.layers.1.mlp.experts.5.down_proj.lora_B.weight"));
  double worst = 0;
  for (const auto& [name, v] : want) {
    const double e = test::rel_l2(got.at(name), v);
    EXPECT_LE(e, 1e-4) << name;
    if (name.find("lora_B") != std::string::npos) worst = std::max(worst, e);
  }
  fs::remove_all(dir / "lora_ep" / "checkpoint-3");
  fs::remove(dir / "lora_ep" / "metrics.jsonl");
  const Result resumed = train("lora_ep", {"lora"}, "save_steps = 1\n", tables, "--resume latest");
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  ASSERT_EQ(resumed.rows.size(), 1u);
  EXPECT_EQ(resumed.rows[0].at("loss"), ep.rows[2].at("loss"));
  EXPECT_EQ(resumed.rows[0].at("grad_norm"), ep.rows[2].at("grad_norm"));
  const auto again = adapter("lora_ep");
  for (const auto& [name, v] : got) EXPECT_EQ(again.at(name), v) << name;
  std::printf("expert LoRA, ep 2 across dp 2: step 3 loss %.7f (one rank %.7f, ZeRO-3 %.7f), grad norm %.6f (%.6f, %.6f), "
              "%zu adapter tensors, worst lora_B rel L2 %.2e; resumed step 3 loss %.7f\n",
              ep.rows[2].at("loss").get<double>(), one.rows[2].at("loss").get<double>(), zero3.rows[2].at("loss").get<double>(),
              ep.rows[2].at("grad_norm").get<double>(), one.rows[2].at("grad_norm").get<double>(),
              zero3.rows[2].at("grad_norm").get<double>(), got.size(), worst, resumed.rows[0].at("loss").get<double>());
}

}  // namespace
}  // namespace lcx
