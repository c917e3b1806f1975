// lcx-train end to end on the CPU: a tiny Qwen3 on a small token file. Each test runs the real
// binary and reads the run folder (metrics.jsonl, checkpoints), as a user would.
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <nlohmann/json.hpp>
#include <map>
#include <set>
#include <thread>

#include "lcx/error.h"
#include "support/test_util.h"

namespace lcx {
namespace {


struct TrainRun : ::testing::Test {
  std::filesystem::path dir = test::temp_dir("train");

  void SetUp() override {
    if (!std::filesystem::exists(test::qwen3_tokenizer())) GTEST_SKIP() << "data/qwen3/tokenizer.json absent: run scripts/fetch_data.sh";
  }

  // A token stream over a vocabulary of 256 ids: `pattern` repeated, so a model can learn it.
  void write_tokens(const std::vector<uint32_t>& pattern, int repeats) {
    std::ofstream out(dir / "data.tokens", std::ios::binary);
    for (int r = 0; r < repeats; ++r) out.write(reinterpret_cast<const char*>(pattern.data()), pattern.size() * 4);
  }

  std::string manifest(const std::string& extra) {
    test::write_file(dir / "run.toml", test::tiny_run_manifest(dir / "out", dir / "data.tokens", 3, true,
                                                               "warmup_steps = 2\nschedule = \"cosine\"\n" + extra));
    return (dir / "run.toml").string();
  }

  test::CommandResult train(const std::string& args) { return test::run_command(test::lcx_train() + " " + args); }

  std::vector<double> losses() {
    std::vector<double> out;
    std::ifstream in(dir / "out" / "metrics.jsonl");
    for (std::string line; std::getline(in, line);) out.push_back(nlohmann::json::parse(line).at("loss").get<double>());
    return out;
  }
};

std::vector<uint32_t> random_pattern(int n, unsigned seed) {
  std::vector<uint32_t> p(static_cast<size_t>(n));
  std::mt19937 rng(seed);
  for (auto& x : p) x = rng() % 256;
  return p;
}

TEST_F(TrainRun, TinyModelOverfitsARepeatedText) {
  write_tokens(random_pattern(32, 1), 16);
  auto m = manifest("max_steps = 60\n");
  auto r = train("--config " + m);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto l = losses();
  ASSERT_EQ(l.size(), 60u);
  EXPECT_GT(l.front(), 5.0);  // ~ln(256) at random init
  // Memorizing one 32-token sequence: a wrong gradient stalls well above this.
  EXPECT_LT(l.back(), 0.5) << "first " << l.front() << " last " << l.back();
  EXPECT_NE(r.output.find("{'loss': "), std::string::npos);
  EXPECT_NE(r.output.find("'num_tokens': 1920.0"), std::string::npos) << r.output;
  EXPECT_TRUE(std::filesystem::exists(dir / "out" / "checkpoint-60" / "model.safetensors"));
  EXPECT_TRUE(std::filesystem::exists(dir / "out" / "checkpoint-60" / "config.json"));
  EXPECT_TRUE(std::filesystem::exists(dir / "out" / "log.jsonl"));
}

TEST_F(TrainRun, ResumeMatchesAStraightRunBitForBit) {
  write_tokens(random_pattern(100, 2), 8);  // 25 sequences of 32, shuffled each epoch
  auto m = manifest("max_steps = 6\ngrad_accum = 2\nsave_steps = 3\nweight_decay = 0.1\n");
  auto straight = train("--config " + m);
  ASSERT_EQ(straight.exit_code, 0) << straight.output;
  auto full = losses();
  ASSERT_EQ(full.size(), 6u);

  // The straight run saved checkpoint-3 and checkpoint-6; going on from step 3 must retrace it.
  ASSERT_TRUE(std::filesystem::exists(dir / "out" / "checkpoint-3" / "optimizer.safetensors"));
  std::filesystem::remove_all(dir / "out" / "checkpoint-6");
  std::filesystem::remove(dir / "out" / "metrics.jsonl");
  auto resumed = train("--config " + m + " --resume latest");
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("resumed from"), std::string::npos) << resumed.output;
  auto tail = losses();
  ASSERT_EQ(tail.size(), 3u);
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(tail[i], full[3 + i]) << "step " << 4 + i;
}

TEST_F(TrainRun, SigtermSavesAndResumeContinues) {
  write_tokens(random_pattern(64, 3), 40);
  auto m = manifest("max_steps = 400\n");
  pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    execl(test::lcx_train().c_str(), "lcx-train", "--config", m.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  // Wait for the first steps to be logged, then ask it to stop.
  for (int i = 0; i < 600 && losses().size() < 2; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  ASSERT_GE(losses().size(), 2u);
  kill(pid, SIGTERM);
  int status = 0;
  waitpid(pid, &status, 0);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 130);
  size_t done = losses().size();
  ASSERT_LT(done, 400u) << "the run finished before the signal";
  EXPECT_TRUE(std::filesystem::exists(dir / "out" / str("checkpoint-", done) / "trainer_state.json"));
  auto resumed = train("--config " + m + " --resume latest --set train.max_steps=" + std::to_string(done + 2));
  EXPECT_NE(resumed.output.find(str("at step ", done)), std::string::npos) << resumed.output;
}

TEST_F(TrainRun, ResumeWithoutCheckpointSaysSo) {
  write_tokens(random_pattern(32, 4), 4);
  auto r = train("--config " + manifest("max_steps = 1\n") + " --resume latest");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.output.find("no complete checkpoint"), std::string::npos) << r.output;
}

// --profile: step 2 (the default profile_step) of the tiny model, every op timed by kind and phase.
TEST_F(TrainRun, ProfileTracesTheSecondStep) {
  write_tokens(random_pattern(64, 5), 8);
  auto m = manifest("max_steps = 3\n");
  auto r = train("--config " + m + " --profile");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("profile of step 2 on cpu"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("profile of step 1 "), std::string::npos) << r.output;
  for (const char* row : {"total ms", "attention_bwd", "host gaps", "backward"})
    EXPECT_NE(r.output.find(row), std::string::npos) << row << " missing from the log table\n" << r.output;
  EXPECT_FALSE(std::filesystem::exists(dir / "out" / "trace-step1.json"));
  std::ifstream in(dir / "out" / "trace-step2.json");
  ASSERT_TRUE(in) << "no trace-step2.json";
  const auto j = nlohmann::json::parse(in);
  const auto& sum = j.at("otherData");
  const double step_ms = sum.at("step_ms").get<double>();
  EXPECT_GT(step_ms, 0);

  std::map<std::string, int> by_cat;
  std::set<std::string> layers;
  for (const auto& e : j.at("traceEvents")) {
    if (e.at("ph") != "X") continue;
    ++by_cat[e.at("cat").get<std::string>()];
    if (e.at("cat") == "layer") layers.insert(e.at("name").get<std::string>());
    const double ts = e.at("ts").get<double>(), dur = e.at("dur").get<double>();
    EXPECT_GE(dur, 0) << e.dump();
    EXPECT_LE(ts + dur, step_ms * 1e3 + 1) << "an event outside its step: " << e.dump();
  }
  for (const char* k : {"gemm", "attention_fwd", "attention_bwd", "norm", "rotary", "swiglu", "loss", "optimizer", "embedding"})
    EXPECT_GT(by_cat[k], 0) << "no " << k << " event";
  // Two layers, each forward and backward (which recomputes its forward inside).
  EXPECT_EQ(layers, (std::set<std::string>{"forward layer 0", "forward layer 1", "backward layer 0", "backward layer 1"}));
  // 2 layers x 2 head groups (one kv head each) x 3: the forward, the backward's recompute to x1,
  // and the recompute for each group's attention backward (issue 21's item 2 removes the last two).
  EXPECT_EQ(sum.at("kinds").at("attention_fwd").at("count"), 12);
  EXPECT_EQ(sum.at("kinds").at("attention_bwd").at("count"), 4);

  double phases = 0;
  for (const char* p : {"forward", "loss", "backward", "optimizer"}) {
    const double ms = sum.at("phases").at(p).at("ms").get<double>();
    EXPECT_GT(ms, 0) << p;
    phases += ms;
  }
  EXPECT_LE(phases, step_ms);

  std::ifstream log(dir / "out" / "log.jsonl");
  const std::string text((std::istreambuf_iterator<char>(log)), std::istreambuf_iterator<char>());
  EXPECT_NE(text.find("profile of step 2"), std::string::npos) << "the table goes to the run's log file too";

  auto bad = train("--config " + m + " --profile --set run.profile_step=0");
  EXPECT_EQ(bad.exit_code, 2) << bad.output;
  EXPECT_NE(bad.output.find("profile_step"), std::string::npos) << bad.output;
}

TEST_F(TrainRun, MemoryTimelineOfTheStepAskedFor) {
  write_tokens(random_pattern(64, 4), 8);
  auto m = manifest("max_steps = 3\n");
  auto r = train("--config " + m + " --set run.memory_timeline=true --set run.memory_timeline_step=2");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("memory timeline of step 2"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("memory timeline of step 1"), std::string::npos) << r.output;
  std::ifstream in(dir / "out" / "memory_timeline.json");
  ASSERT_TRUE(in) << "no memory_timeline.json";
  const auto j = nlohmann::json::parse(in);
  EXPECT_GT(j.at("peak_bytes").get<int64_t>(), 0);
  EXPECT_FALSE(j.at("events").empty());

  auto bad = train("--config " + m + " --set run.memory_timeline=true --set run.memory_timeline_step=0");
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.output.find("memory_timeline_step"), std::string::npos) << bad.output;
}

}  // namespace
}  // namespace lcx
