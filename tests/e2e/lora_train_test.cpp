// LoRA end to end on the CPU, through the real lcx-train: the adapter trains beside every other
// plugin and mesh as on one rank (dp, cp_ring, sp_ulysses, cp x sp thread-ranks; chunked loss,
// YaRN, offload, tiled MLP, host_adamw, packed documents), resumes bit for bit, writes PEFT's
// folder (no base weights), merges into its base as the same model, and shards under ZeRO-3.
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

const char* kLora = "[lora]\nr = 4\nalpha = 8\nmodules_to_save = [\"norm\"]\n";

struct LoraTrain : ::testing::Test {
  fs::path dir = test::temp_dir("lora-e2e");
  std::string lora_extra;  // more [lora] keys for the runs that follow
  void SetUp() override {
    if (!fs::exists(test::qwen3_tokenizer())) GTEST_SKIP() << "data/qwen3/tokenizer.json absent: run scripts/fetch_data.sh";
    std::ofstream out(dir / "data.tokens", std::ios::binary);
    std::mt19937 rng(9);
    for (int i = 0; i < 32 * 24; ++i) {
      // An EOS (151643) now and then: packed documents when [data] masks them.
      const uint32_t t = rng() % 9 == 0 ? 151643u : rng() % 256;
      out.write(reinterpret_cast<const char*>(&t), 4);
    }
  }

  struct Result {
    int exit_code = -1;
    std::string output;
    std::vector<double> losses;
    std::map<std::string, std::vector<float>> adapter;  // checkpoint-3's adapter_model.safetensors
  };

  // 3 steps of the tiny model with the lora plugin (and `plugins`) loaded; `train` adds [train]
  // lines, `tables` more tables.
  Result train(const std::string& name, const std::vector<std::string>& plugins, const std::string& train = "",
               const std::string& tables = "", const std::string& args = "") {
    const fs::path o = dir / name;
    std::string load = "\"lora\"";
    for (const auto& p : plugins) load += ", \"" + p + "\"";
    std::string text = test::tiny_run_manifest(o, dir / "data.tokens", 5, false, "max_steps = 3\nweight_decay = 0.1\n" + train,
                                               "[plugins]\nload = [" + load + "]\n" + kLora + lora_extra + tables);
    const std::string small = "\"vocab_size\": 256", large = "\"vocab_size\": 151936";
    text.replace(text.find(small), small.size(), large);
    test::write_file(o / "run.toml", text);
    Result r;
    const auto c = test::run_command(test::lcx_train() + " --config " + (o / "run.toml").string() + " " + args);
    r.exit_code = c.exit_code;
    r.output = c.output;
    std::ifstream in(o / "metrics.jsonl");
    for (std::string line; std::getline(in, line);) r.losses.push_back(nlohmann::json::parse(line).at("loss").get<double>());
    const fs::path ck = o / "checkpoint-3" / "adapter_model.safetensors";
    if (fs::exists(ck)) {
      auto st = safetensors::Checkpoint::open(ck.string());
      for (const auto& n : st.names()) r.adapter[n] = st.load(n, DType::f32).to_floats();
    }
    return r;
  }
};

void expect_same_training(const LoraTrain::Result& got, const LoraTrain::Result& want, const std::string& what,
                          double tol = 1e-5) {
  ASSERT_EQ(got.exit_code, 0) << what << "\n" << got.output;
  ASSERT_EQ(got.losses.size(), 3u) << what;
  for (size_t i = 0; i < 3; ++i) EXPECT_NEAR(got.losses[i], want.losses[i], tol * want.losses[i]) << what << " step " << i + 1;
  ASSERT_EQ(got.adapter.size(), want.adapter.size()) << what;
  for (const auto& [name, v] : want.adapter) EXPECT_LE(test::rel_l2(got.adapter.at(name), v), 10 * tol) << what << " " << name;
}

TEST_F(LoraTrain, WritesPeftsFolderAndTrainsOnlyTheAdapter) {
  const Result one = train("one", {}, "grad_accum = 2\n");
  ASSERT_EQ(one.exit_code, 0) << one.output;
  ASSERT_EQ(one.losses.size(), 3u);
  const fs::path ck = dir / "one" / "checkpoint-3";
  EXPECT_TRUE(fs::exists(ck / "adapter_config.json"));
  EXPECT_FALSE(fs::exists(ck / "model.safetensors")) << "an adapter checkpoint holds no base weights";
  EXPECT_TRUE(one.adapter.count("base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"));
  EXPECT_TRUE(one.adapter.count("base_model.model.model.norm.weight"));  // modules_to_save
  // Only the adapter and the norms have optimizer state.
  auto opt = safetensors::Checkpoint::open((ck / "optimizer.safetensors").string());
  for (const auto& n : opt.names()) {
    EXPECT_TRUE(n.find("lora_") != std::string::npos || n.find("norm") != std::string::npos) << n;
    EXPECT_EQ(n.find("embed_tokens"), std::string::npos) << n;
  }
  // B left zero would mean no step moved it.
  double b = 0;
  for (float x : one.adapter.at("base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight")) b += std::abs(x);
  EXPECT_GT(b, 0.0);
  EXPECT_NE(one.output.find("lora: r 4"), std::string::npos) << one.output;
}

// The adapter's gradients are summed over ranks as the model's are: dp 2, cp 2, sp 2 and
// cp 2 x sp 2 thread-ranks train as one rank with 2 sequences a step; packed documents masked.
TEST_F(LoraTrain, EveryMeshTrainsAsOneRank) {
  const Result one = train("one", {}, "grad_accum = 2\n");
  expect_same_training(train("dp2", {}, "", "[distributed]\nnproc_per_node = 2\nshard_parameters = false\n"), one, "dp 2");
  // cp and sp below run with ZeRO-3 on (the default on several ranks).
  expect_same_training(train("cp2", {"cp_ring"}, "grad_accum = 2\n", "[distributed]\nnproc_per_node = 2\ncp = 2\n"), one,
                       "cp_ring 2");
  expect_same_training(train("sp2", {"sp_ulysses"}, "grad_accum = 2\n", "[distributed]\nnproc_per_node = 2\nsp = 2\n"), one,
                       "sp_ulysses 2");
  expect_same_training(train("cp2sp2", {"cp_ring", "sp_ulysses"}, "grad_accum = 2\n",
                             "[distributed]\nnproc_per_node = 4\ncp = 2\nsp = 2\n"),
                       one, "cp 2 x sp 2");
}

// The memory and loss plugins change where and in which pieces the step runs, not what it computes.
TEST_F(LoraTrain, EveryOtherPluginTrainsAsTheDefaults) {
  const Result base = train("defaults", {});
  expect_same_training(train("plugins", {"loss_chunked", "offload", "tiled_mlp"}, "", "[loss_chunked]\nchunk_rows = 8\n[tiled_mlp]\ntile_rows = 8\n"),
                       base, "loss_chunked + offload + tiled_mlp");
  expect_same_training(train("host_adamw", {"host_adamw"}), base, "host_adamw");
  expect_same_training(train("every2", {}, "checkpoint_every = 2\n"), base, "checkpoint_every 2");
  // YaRN changes the positions, so the run differs; it must still train and save the adapter.
  const Result yarn = train("yarn", {"rope_yarn"}, "", "[rope_yarn]\nfactor = 2.0\noriginal_max_position_embeddings = 16\n");
  ASSERT_EQ(yarn.exit_code, 0) << yarn.output;
  EXPECT_EQ(yarn.losses.size(), 3u);
  EXPECT_FALSE(yarn.adapter.empty());
}

TEST_F(LoraTrain, ResumesBitForBit) {
  const Result straight = train("resume", {}, "save_steps = 1\n");
  ASSERT_EQ(straight.exit_code, 0) << straight.output;
  const auto saved = straight.adapter;
  fs::remove_all(dir / "resume" / "checkpoint-3");
  fs::remove(dir / "resume" / "metrics.jsonl");
  const Result resumed = train("resume", {}, "save_steps = 1\n", "", "--resume latest");  // from checkpoint-2
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  ASSERT_EQ(resumed.losses.size(), 1u);
  EXPECT_EQ(resumed.losses[0], straight.losses[2]);
  ASSERT_EQ(resumed.adapter.size(), saved.size());
  for (const auto& [name, v] : saved) EXPECT_EQ(resumed.adapter.at(name), v) << name;
}

// Dropout draws its masks by the step, the sequence's place in the step's batch and each
// element's row in the sequence: dp 2, cp 2 and sp 2 train as gradient accumulation 2 on one
// rank, and a resumed run draws the masks the straight run drew, bit for bit.
TEST_F(LoraTrain, DropoutTrainsAsOneRankOnEveryMeshAndResumesBitForBit) {
  const Result plain = train("nodrop", {}, "grad_accum = 2\n");
  lora_extra = "dropout = 0.3\n";
  const Result one = train("drop", {}, "grad_accum = 2\nsave_steps = 1\n");
  ASSERT_EQ(one.exit_code, 0) << one.output;
  ASSERT_EQ(one.losses.size(), 3u);
  EXPECT_NE(one.output.find("dropout 0.3"), std::string::npos) << one.output;
  // B starts at zero, so the first step's loss is the base's either way; the masks show after.
  EXPECT_EQ(one.losses[0], plain.losses[0]);
  EXPECT_NE(one.losses[2], plain.losses[2]);
  expect_same_training(train("dropdp2", {}, "", "[distributed]\nnproc_per_node = 2\nshard_parameters = false\n"), one,
                       "dropout on dp 2");
  // The sequence ranks sum the attention in another order; AdamW's first steps turn that fp32
  // rounding into up to 3e-4 of a factor where its gradient is near zero. Masks drawn by the
  // rank's own row numbers instead put the factors 0.06 to 0.9 apart.
  const double mesh_tol = 1e-4;
  expect_same_training(train("dropcp2", {"cp_ring"}, "grad_accum = 2\n", "[distributed]\nnproc_per_node = 2\ncp = 2\n"), one,
                       "dropout on cp_ring 2", mesh_tol);
  expect_same_training(train("dropsp2", {"sp_ulysses"}, "grad_accum = 2\n", "[distributed]\nnproc_per_node = 2\nsp = 2\n"),
                       one, "dropout on sp_ulysses 2", mesh_tol);
  expect_same_training(train("dropcp2sp2", {"cp_ring", "sp_ulysses"}, "grad_accum = 2\n",
                             "[distributed]\nnproc_per_node = 4\ncp = 2\nsp = 2\n"),
                       one, "dropout on cp 2 x sp 2", mesh_tol);
  const auto saved = one.adapter;
  fs::remove_all(dir / "drop" / "checkpoint-3");
  fs::remove(dir / "drop" / "metrics.jsonl");
  const Result resumed = train("drop", {}, "grad_accum = 2\nsave_steps = 1\n", "", "--resume latest");
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  ASSERT_EQ(resumed.losses.size(), 1u);
  EXPECT_EQ(resumed.losses[0], one.losses[2]);
  ASSERT_EQ(resumed.adapter.size(), saved.size());
  for (const auto& [name, v] : saved) EXPECT_EQ(resumed.adapter.at(name), v) << name;
}

// ZeRO-3: the frozen base and the factors sharded over 2 ranks, gathered around each layer, only
// the factors' (and norms') gradients reduce-scattered: as one rank with 2 sequences a step.
TEST_F(LoraTrain, Zero3ShardsTheFrozenBaseAndTrainsAsOneRank) {
  const Result one = train("one", {}, "grad_accum = 2\n");
  const Result z = train("zero3", {}, "", "[distributed]\nnproc_per_node = 2\nshard_parameters = true\n");
  expect_same_training(z, one, "ZeRO-3 dp 2");
  // Rebuilding each input from the saved one runs a layer's forward again after a backward: the
  // gathers around it follow.
  expect_same_training(train("zero3_each", {}, "checkpoint_every = 3\nrebuild_each = true\n",
                             "[distributed]\nnproc_per_node = 2\nshard_parameters = true\n"),
                       one, "ZeRO-3 dp 2, rebuild_each");
  // Each rank's optimizer state holds its shard of the trained parameters only.
  auto opt = safetensors::Checkpoint::open((dir / "zero3" / "checkpoint-3" / "optimizer-rank0-of-2.safetensors").string());
  for (const auto& n : opt.names()) EXPECT_TRUE(n.find("lora_") != std::string::npos || n.find("norm") != std::string::npos) << n;
}

// merge folds the trained adapter into its base: evaluated as a plain model, the merged folder
// gives the loss the adapter run evaluates to.
TEST_F(LoraTrain, MergedCheckpointIsTheAdaptedModel) {
  // A base folder: the tiny model after one full fine-tuning step.
  const fs::path base_run = dir / "base";
  std::string text = test::tiny_run_manifest(base_run, dir / "data.tokens", 5, false, "max_steps = 1\n");
  text.replace(text.find("\"vocab_size\": 256"), 17, "\"vocab_size\": 151936");
  test::write_file(base_run / "run.toml", text);
  auto r = test::run_command(test::lcx_train() + " --config " + (base_run / "run.toml").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const fs::path base = base_run / "checkpoint-1";
  const Result lora = train("adapted", {}, "", "", "--set model.path=" + base.string() + " --set model.init=");
  ASSERT_EQ(lora.exit_code, 0) << lora.output;
  const fs::path merged = dir / "merged";
  r = test::run_command(test::lcx_train() + " merge --base " + base.string() + " --adapter " +
                        (dir / "adapted" / "checkpoint-3").string() + " --out " + merged.string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto eval = [&](const std::string& extra, const std::string& label) {
    const auto c = test::run_command(test::lcx_train() + " eval --config " + (dir / "adapted" / "run.toml").string() +
                                     " --set model.path=" + base.string() + " --set model.init= " + extra +
                                     " --seq-len 32 --label " + label + " --out " + (dir / "eval").string());
    EXPECT_EQ(c.exit_code, 0) << c.output;
    std::ifstream in(dir / "eval" / (label + ".json"));
    if (!in) return -1.0;
    return nlohmann::json::parse(in).at("mean_loss").get<double>();
  };
  const double adapted = eval("--checkpoint " + (dir / "adapted" / "checkpoint-3").string(), "adapted");
  const double plain = eval("--model " + merged.string() + " --disable lora", "merged");
  ASSERT_GT(adapted, 0);
  EXPECT_NEAR(plain, adapted, 1e-5 * adapted);
}

// An adapter's checkpoint resumed by a run without the adapter is refused: it holds no
// model weights to train whole.
TEST_F(LoraTrain, AdapterCheckpointIsNotResumedAsFullFineTuning) {
  const Result one = train("one", {});
  ASSERT_EQ(one.exit_code, 0) << one.output;
  const fs::path run = dir / "one" / "run.toml";
  auto r = test::run_command(test::lcx_train() + " --config " + run.string() +
                             " --disable lora --resume latest --set train.max_steps=4");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("checkpoint-3 is an adapter's checkpoint (adapter_config.json), but this run trains the whole "
                          "model"),
            std::string::npos)
      << r.output;
  EXPECT_FALSE(fs::exists(dir / "one" / "checkpoint-4"));
}

// A modules_to_save entry that trains nothing (a name no module ends with, or lm_head of
// a model whose head is its embedding) is refused by its key, and so is a resume that would train
// a module the checkpoint did not.
TEST_F(LoraTrain, ModulesToSaveThatTrainNothingOrChangeOnResumeAreRefused) {
  auto none = train("none", {}, "", "", "--set 'lora.modules_to_save=[\"nothing_here\"]'");
  EXPECT_EQ(none.exit_code, 2) << none.output;
  EXPECT_NE(none.output.find("lora.modules_to_save names \"nothing_here\", which matches no module of the model"),
            std::string::npos)
      << none.output;

  std::string tied = test::tiny_run_manifest(dir / "tied", dir / "data.tokens", 5, true, "max_steps = 1\n",
                                             "[plugins]\nload = [\"lora\"]\n[lora]\nr = 4\nmodules_to_save = [\"lm_head\"]\n");
  const std::string small = "\"vocab_size\": 256", large = "\"vocab_size\": 151936";
  tied.replace(tied.find(small), small.size(), large);
  test::write_file(dir / "tied.toml", tied);
  auto head = test::run_command(test::lcx_train() + " --config " + (dir / "tied.toml").string());
  EXPECT_EQ(head.exit_code, 2) << head.output;
  EXPECT_NE(head.output.find("but this model's head is its embedding (tie_word_embeddings)"), std::string::npos) << head.output;
  EXPECT_NE(head.output.find("fix: name \"embed_tokens\" in lora.modules_to_save instead"), std::string::npos) << head.output;
  EXPECT_FALSE(fs::exists(dir / "tied" / "checkpoint-1"));

  ASSERT_EQ(train("more", {}, "save_steps = 1\n").exit_code, 0);
  auto more = test::run_command(test::lcx_train() + " --config " + (dir / "more" / "run.toml").string() +
                                " --resume latest --set train.max_steps=4 --set 'lora.modules_to_save=[\"norm\", \"embed_tokens\"]'");
  EXPECT_EQ(more.exit_code, 2) << more.output;
  EXPECT_NE(more.output.find("trains model.embed_tokens.weight whole, which the checkpoint " +
                             (dir / "more" / "checkpoint-3").string() + " did not (its modules_to_save: [\"norm\"])"),
            std::string::npos)
      << more.output;
  EXPECT_NE(more.output.find("fix: resume with the checkpoint's modules_to_save"), std::string::npos) << more.output;
  EXPECT_FALSE(fs::exists(dir / "more" / "checkpoint-4"));
}

}  // namespace
}  // namespace lcx
