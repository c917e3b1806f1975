// lcx-train end to end on the CPU: a tiny Qwen3 on a small token file. Each test runs the real
// binary and reads the run folder (metrics.jsonl, checkpoints), as a user would.
#include <gtest/gtest.h>

#include <algorithm>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <map>
#include <set>
#include <sstream>
#include <thread>

#include "lcx/error.h"
#include "support/test_util.h"
#include "support/tfevents_reader.h"
#include "train/checkpoint.h"

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

// Every family on the decoder library works with every single-GPU technique: loss_chunked,
// tiled_mlp, offload and host_adamw give the losses of the plain run (to fp32 rounding), and
// rope_yarn trains (its positions differ, so its losses do too). Llama with llama3 rope, Mistral,
// Qwen2 with its biases.
TEST_F(TrainRun, EveryFamilyTrainsTheSameWithEachTechnique) {
  write_tokens(random_pattern(97, 5), 40);
  struct Family {
    const char* module;
    const char* extra;  // config.json keys beyond the tiny shape
  };
  const Family families[] = {
      {"llama", R"(, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 16})"},
      {"mistral", ""},
      {"qwen2", ""},
  };
  for (const Family& f : families) {
    SCOPED_TRACE(f.module);
    auto run = [&](const std::string& plugins, const std::string& tables) {
      std::string m = test::tiny_run_manifest(dir / "out", dir / "data.tokens", 3, false, "max_steps = 4\nsave_final = false\n",
                                              "[plugins]\nload = [" + plugins + "]\n" + tables);
      m.replace(m.find("module = \"qwen3\""), 16, std::string("module = \"") + f.module + "\"");
      m.replace(m.find("\"tie_word_embeddings\": false}"), 29, std::string("\"tie_word_embeddings\": false") + f.extra + "}");
      test::write_file(dir / "run.toml", m);
      auto r = train("--config " + (dir / "run.toml").string() + " --overwrite");
      EXPECT_EQ(r.exit_code, 0) << r.output;
      return losses();
    };
    const std::vector<double> plain = run("", "");
    ASSERT_EQ(plain.size(), 4u);
    for (const char* plugin : {"\"loss_chunked\"", "\"tiled_mlp\"", "\"offload\"", "\"host_adamw\""}) {
      SCOPED_TRACE(plugin);
      const std::vector<double> got = run(plugin, std::string(plugin) == "\"tiled_mlp\"" ? "[tiled_mlp]\ntile_rows = 8\n" : "");
      ASSERT_EQ(got.size(), plain.size());
      for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], plain[i], 1e-4 * std::abs(plain[i])) << "step " << i + 1;
    }
    const std::vector<double> yarn =
        run("\"rope_yarn\"", "[rope_yarn]\nfactor = 4.0\noriginal_max_position_embeddings = 16\n");
    ASSERT_EQ(yarn.size(), 4u);
    for (double l : yarn) EXPECT_TRUE(std::isfinite(l));
  }
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

// The Optimizer slot's host provider: a run with it resumes from its checkpoint bit for bit, and
// its losses are core's AdamW's (the same update, in fp32 on the host), clipping and decay on.
TEST_F(TrainRun, HostAdamWResumesExactlyAndTrainsAsCoreAdamW) {
  write_tokens(random_pattern(100, 3), 8);
  test::write_file(dir / "run.toml",
                   test::tiny_run_manifest(dir / "out", dir / "data.tokens", 3, false,
                                           "max_steps = 6\nsave_steps = 3\nweight_decay = 0.1\nmax_grad_norm = 0.5\n",
                                           "[plugins]\nload = [\"host_adamw\"]\n[host_adamw]\nthreads = 2\n"));
  const std::string m = (dir / "run.toml").string();
  auto straight = train("--config " + m + " --profile");
  ASSERT_EQ(straight.exit_code, 0) << straight.output;
  EXPECT_NE(straight.output.find("host_adamw"), std::string::npos) << "the run log names the provider\n" << straight.output;
  // The second step's forward waited on the first step's update, layer by layer: in the trace.
  std::ifstream trace(dir / "out" / "trace-step2.json");
  ASSERT_TRUE(trace) << "no trace-step2.json";
  const nlohmann::json events = nlohmann::json::parse(trace).at("traceEvents");
  std::set<std::string> waited_in;
  for (const auto& e : events)
    if (e.contains("name") && e.at("name").get<std::string>() == "wait for updated weights") waited_in.insert(e.dump());
  EXPECT_EQ(waited_in.size(), 3u) << "one wait per group: the non-layer parameters and 2 layers";
  const auto full = losses();
  ASSERT_EQ(full.size(), 6u);
  std::ifstream metrics(dir / "out" / "metrics.jsonl");
  for (std::string line; std::getline(metrics, line);)
    EXPECT_GE(nlohmann::json::parse(line).at("time_weights_wait_s").get<double>(), 0.0) << line;

  std::filesystem::remove_all(dir / "out" / "checkpoint-6");
  std::filesystem::remove(dir / "out" / "metrics.jsonl");
  auto resumed = train("--config " + m + " --resume latest");
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  const auto tail = losses();
  ASSERT_EQ(tail.size(), 3u);
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(tail[i], full[3 + i]) << "step " << 4 + i;

  // The ablation: the same manifest with core's AdamW.
  std::filesystem::remove_all(dir / "out");
  auto core = train("--config " + m + " --disable host_adamw");
  ASSERT_EQ(core.exit_code, 0) << core.output;
  const auto with_core = losses();
  ASSERT_EQ(with_core.size(), 6u);
  for (size_t i = 0; i < 6; ++i) EXPECT_NEAR(with_core[i], full[i], 1e-4 * full[i]) << "step " << i + 1;

  auto bf16 = train("--config " + m + " --set train.master_dtype=bf16 --overwrite");
  EXPECT_EQ(bf16.exit_code, 2) << bf16.output;
  EXPECT_NE(bf16.output.find("master_dtype = \"bf16\""), std::string::npos) << bf16.output;
  EXPECT_NE(bf16.output.find("fix: set master_dtype = \"fp32\""), std::string::npos) << bf16.output;
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

// --rehearse: one step of the tiny model with the offload strategy's pinned buffers and the
// attention math cut (zeros: its loss is not the real step's), the measured peaks beside the
// plan's. On the CPU only the pinned pool is judged (the device peak is the CPU allocator's, the plan
// the GPU's). Nothing of a training run is written.
TEST_F(TrainRun, RehearsalComparesPeaksWithThePlanAndWritesNoRun) {
  write_tokens(random_pattern(64, 6), 4);
  const std::string plugins = "[plugins]\nload = [\"offload\"]\n";
  test::write_file(dir / "run.toml",
                   test::tiny_run_manifest(dir / "out", dir / "data.tokens", 3, true, "max_steps = 4\nsave_final = true\n", plugins));
  auto r = train("--config " + (dir / "run.toml").string() + " --rehearse");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const char* s : {"REHEARSAL, not training", "(meaningless)", "host bytes held (pinned pool + optimizer state in host memory): measured",
                        "not judged on the CPU", "the measured peaks agree with the plan"})
    EXPECT_NE(r.output.find(s), std::string::npos) << s << " missing\n" << r.output;
  const nlohmann::json report = nlohmann::json::parse(std::ifstream(dir / "out" / "rehearsal.json"));
  EXPECT_TRUE(report.at("rehearsal").get<bool>());
  EXPECT_TRUE(report.at("agree").get<bool>());
  const nlohmann::json& pinned = report.at("judged").at(0);
  EXPECT_GT(pinned.at("measured_bytes").get<int64_t>(), 0);  // offload parked the layer inputs
  EXPECT_EQ(pinned.at("difference_bytes").get<int64_t>(), 0) << pinned.dump();
  EXPECT_FALSE(std::filesystem::exists(dir / "out" / "metrics.jsonl"));
  EXPECT_FALSE(std::filesystem::exists(dir / "out" / "checkpoint-1"));

  // The same step trained for real: another loss, since the rehearsal's attention wrote zeros.
  test::write_file(dir / "real.toml", test::tiny_run_manifest(dir / "real", dir / "data.tokens", 3, true, "max_steps = 1\n", plugins));
  auto real = train("--config " + (dir / "real.toml").string());
  ASSERT_EQ(real.exit_code, 0) << real.output;
  std::ifstream in(dir / "real" / "metrics.jsonl");
  std::string line;
  ASSERT_TRUE(std::getline(in, line));
  const double real_loss = nlohmann::json::parse(line).at("loss").get<double>();
  EXPECT_GT(std::abs(real_loss - report.at("loss_meaningless").get<double>()), 1e-4);
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
  // 2 layers x 2 head groups (one kv head each), once: the recipe keeps each layer's attention
  // outputs from the forward, so the backward recomputes no attention forward (it was 3x before).
  EXPECT_EQ(sum.at("kinds").at("attention_fwd").at("count"), 4);
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
  // The step's phases, from its forward through its update, as bands under the x axis.
  std::ifstream svg_in(dir / "out" / "memory_timeline.svg");
  const std::string svg((std::istreambuf_iterator<char>(svg_in)), std::istreambuf_iterator<char>());
  for (const char* phase : {"forward", "loss", "backward", "optimizer"})
    EXPECT_NE(svg.find(str("class=\"phase\" data-phase=\"", phase, "\"")), std::string::npos) << phase;

  auto bad = train("--config " + m + " --set run.memory_timeline=true --set run.memory_timeline_step=0");
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.output.find("memory_timeline_step"), std::string::npos) << bad.output;
}

std::string slurp(const std::filesystem::path& p) {
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Starts lcx-train with `args` and its output in `log`, without waiting for it.
pid_t start_training(const std::vector<std::string>& args, const std::filesystem::path& log) {
  const pid_t pid = fork();
  if (pid == 0) {
    if (!std::freopen(log.c_str(), "w", stdout) || dup2(fileno(stdout), STDERR_FILENO) < 0) _exit(126);
    std::vector<char*> argv{const_cast<char*>("lcx-train")};
    for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    execv(test::lcx_train().c_str(), argv.data());
    _exit(127);
  }
  return pid;
}

TEST_F(TrainRun, LogIsAppendedWithALineForEachStartAndResume) {
  write_tokens(random_pattern(64, 5), 8);
  auto m = manifest("max_steps = 2\nsave_steps = 1\n");
  ASSERT_EQ(train("--config " + m).exit_code, 0);
  auto r = train("--config " + m + " --resume latest --set train.max_steps=3");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string log = slurp(dir / "out" / "log.jsonl");
  std::vector<std::string> messages;
  std::istringstream lines(log);
  for (std::string line; std::getline(lines, line);) messages.push_back(nlohmann::json::parse(line).at("message"));
  auto index_of = [&](const std::string& start) {
    for (size_t i = 0; i < messages.size(); ++i)
      if (messages[i].starts_with(start)) return static_cast<int>(i);
    return -1;
  };
  const int first = index_of("start of a new run: lcx-train"), saved = index_of("saved "),
            resumed = index_of("resume (--resume latest): lcx-train");
  EXPECT_EQ(first, 0) << log;
  EXPECT_GT(saved, first) << "the first run's lines were lost:\n" << log;
  EXPECT_GT(resumed, saved) << log;
  EXPECT_GT(index_of("resumed from"), resumed) << log;
}

// The terminal gets a short summary of the run's start; the details (file hashes, the config as
// JSON, the plan in bytes) are kept in log.jsonl alone.
TEST_F(TrainRun, StartPrintsASummaryAndKeepsTheDetailsInTheLog) {
  write_tokens(random_pattern(64, 5), 8);
  auto r = train("--config " + manifest("max_steps = 2\n"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const char* line :
       {"model    qwen3 random init: 2 layers, hidden 32, 4 query / 2 kv heads, vocab 256; ", " parameters, fp32 weights",
        "devices  cpu, 1 rank (dp 1 x cp 1 x sp 1)", "plugins  qwen3 (model)", "recipe   gradient checkpointing (every layer's input saved)",
        "memory   planned per GPU: peak ", "data     16 sequences of 32 tokens (512 tokens, 1 document) per epoch",
        "steps    2 steps of 1 sequence (0.125 epochs); details in "})
    EXPECT_NE(r.output.find(line), std::string::npos) << line << "\n" << r.output;
  for (const char* detail : {"sha256:", "config {", " B allocated", "slot model:"})
    EXPECT_EQ(r.output.find(detail), std::string::npos) << detail << " on the terminal:\n" << r.output;
  const std::string log = slurp(dir / "out" / "log.jsonl");
  std::vector<std::string> messages;
  std::istringstream lines(log);
  for (std::string line; std::getline(lines, line);) messages.push_back(nlohmann::json::parse(line).at("message"));
  auto logged = [&](const std::string& start) {
    return std::any_of(messages.begin(), messages.end(), [&](const std::string& m) { return m.starts_with(start); });
  };
  for (const char* start : {"slot model: qwen3", "config {", "plan: GPU peak ", "recipe: ", "device cpu", "2 steps of 1",
                            "model    qwen3", "memory   planned"})
    EXPECT_TRUE(logged(start)) << start << "\n" << log;
  EXPECT_NE(log.find(" sha256:"), std::string::npos) << log;
}

TEST_F(TrainRun, KillNineLosesNoLogLineAlreadyWritten) {
  write_tokens(random_pattern(64, 6), 40);
  auto m = manifest("max_steps = 100000\nsave_steps = 2\n");
  const pid_t pid = start_training({"--config", m}, dir / "output");
  for (int i = 0; i < 600 && list_checkpoints((dir / "out").string()).empty(); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  kill(pid, SIGKILL);
  waitpid(pid, nullptr, 0);
  const auto checkpoints = list_checkpoints((dir / "out").string());
  ASSERT_FALSE(checkpoints.empty());
  const std::string log = slurp(dir / "out" / "log.jsonl");
  EXPECT_NE(log.find("start of a new run"), std::string::npos) << log;
  EXPECT_NE(log.find(" steps of 1 sequence(s) of 32 tokens"), std::string::npos) << log;
  // Every checkpoint but the newest (the kill may fall between its rename and its log line).
  for (size_t i = 0; i + 1 < checkpoints.size(); ++i)
    EXPECT_NE(log.find("saved " + checkpoints[i] + "\""), std::string::npos) << "lost: saved " << checkpoints[i] << "\n" << log;
}

TEST_F(TrainRun, FreshRunRefusesAFolderWithCheckpointsUnlessOverwritten) {
  write_tokens(random_pattern(64, 7), 8);
  auto m = manifest("max_steps = 4\nsave_steps = 2\n");
  ASSERT_EQ(train("--config " + m).exit_code, 0);
  auto again = train("--config " + m + " --set train.max_steps=2");
  EXPECT_EQ(again.exit_code, 2) << again.output;
  EXPECT_NE(again.output.find("holds checkpoints of an earlier run (newest: checkpoint-4)"), std::string::npos) << again.output;
  EXPECT_NE(again.output.find("--resume latest"), std::string::npos) << again.output;
  EXPECT_NE(again.output.find("--overwrite"), std::string::npos) << again.output;

  auto both = train("--config " + m + " --overwrite --resume latest");
  EXPECT_EQ(both.exit_code, 2) << both.output;

  auto over = train("--config " + m + " --set train.max_steps=2 --set train.keep_checkpoints=1 --overwrite");
  ASSERT_EQ(over.exit_code, 0) << over.output;
  EXPECT_EQ(losses().size(), 2u) << "metrics.jsonl kept the earlier run's rows";
  EXPECT_TRUE(std::filesystem::exists(dir / "out" / "checkpoint-2"));
  EXPECT_FALSE(std::filesystem::exists(dir / "out" / "checkpoint-4")) << "keep_checkpoints would keep the old one";
}

TEST_F(TrainRun, FreshRunReplacesTheMetricsOfARunThatSavedNothing) {
  write_tokens(random_pattern(64, 13), 8);
  auto m = manifest("max_steps = 2\nsave_final = false\n");
  ASSERT_EQ(train("--config " + m).exit_code, 0);
  ASSERT_TRUE(list_checkpoints((dir / "out").string()).empty());
  auto r = train("--config " + m + " --set train.max_steps=3");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("metrics.jsonl of an earlier run that saved no checkpoint is replaced"), std::string::npos) << r.output;
  EXPECT_EQ(losses().size(), 3u);
}

TEST_F(TrainRun, ResumeRefusesAnotherModelOrData) {
  write_tokens(random_pattern(64, 8), 8);
  auto m = manifest("max_steps = 2\n");
  ASSERT_EQ(train("--config " + m).exit_code, 0);
  auto seq = train("--config " + m + " --resume latest --set data.seq_len=16");
  EXPECT_EQ(seq.exit_code, 2) << seq.output;
  EXPECT_NE(seq.output.find("data.seq_len is \"16\" but the checkpoint was trained with \"32\""), std::string::npos) << seq.output;
  auto model = train("--config " + m + " --resume latest --set model.dtype=bf16");
  EXPECT_EQ(model.exit_code, 2) << model.output;
  EXPECT_NE(model.output.find("model.dtype is \"bf16\""), std::string::npos) << model.output;
  // Masked documents change the targets and the attention: another training.
  auto across = train("--config " + m + " --resume latest --set data.attend_across_documents=true");
  EXPECT_EQ(across.exit_code, 2) << across.output;
  EXPECT_NE(across.output.find("data.attend_across_documents is \"true\" but the checkpoint was trained with \"false\""),
            std::string::npos)
      << across.output;  // Which tokens train and the chat template's variables change the targets too.
  auto loss_on = train("--config " + m + " --resume latest --set data.loss_on=all");
  EXPECT_EQ(loss_on.exit_code, 2) << loss_on.output;
  EXPECT_NE(loss_on.output.find("data.loss_on is \"all\" but the checkpoint was trained with \"auto\""), std::string::npos)
      << loss_on.output;
  auto kwargs = train("--config " + m + " --resume latest --set data.chat_template_kwargs.enable_thinking=false");
  EXPECT_EQ(kwargs.exit_code, 2) << kwargs.output;
  EXPECT_NE(kwargs.output.find("data.chat_template_kwargs is \"{\"enable_thinking\":false}\" but the checkpoint was "
                               "trained with \"{}\""),
            std::string::npos)
      << kwargs.output;
}

TEST_F(TrainRun, MetricsStayOneHistoryAcrossAResumeThatRollsBack) {
  write_tokens(random_pattern(64, 9), 8);
  auto m = manifest("max_steps = 5\nsave_steps = 3\n");
  ASSERT_EQ(train("--config " + m).exit_code, 0);
  // As after a kill in step 6: checkpoint-3 is the latest, metrics.jsonl has rows 1 to 5 and a cut line.
  std::filesystem::remove_all(dir / "out" / "checkpoint-5");
  std::ofstream(dir / "out" / "metrics.jsonl", std::ios::app) << "{\"step\": 6, \"lo";
  auto r = train("--config " + m + " --resume latest --set train.max_steps=6");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("dropped 2 row(s) after step 3, the step this run resumes from, and 1 line(s) cut by a kill"),
            std::string::npos)
      << r.output;
  std::vector<int64_t> steps;
  std::ifstream in(dir / "out" / "metrics.jsonl");
  for (std::string line; std::getline(in, line);) steps.push_back(nlohmann::json::parse(line).at("step").get<int64_t>());
  EXPECT_EQ(steps, (std::vector<int64_t>{1, 2, 3, 4, 5, 6}));
  std::vector<std::filesystem::path> events;
  for (const auto& e : std::filesystem::directory_iterator(dir / "out"))
    if (e.path().filename().string().starts_with("events.out.tfevents.")) events.push_back(e.path());
  ASSERT_EQ(events.size(), 1u) << "one TensorBoard events file beside metrics.jsonl";

  // Its scalar events are metrics.jsonl's rows, the rolled-back ones gone; a START marks the resume.
  std::vector<int64_t> scalar_steps, start_steps;
  std::vector<float> event_losses;
  for (const auto& rec : test::read_records(events[0])) {
    auto e = test::decode(rec);
    const int64_t step = e.count(2) ? static_cast<int64_t>(e.find(2)->second.varint) : 0;
    if (e.count(6)) start_steps.push_back(step);
    if (!e.count(5)) continue;
    scalar_steps.push_back(step);
    auto summary = test::decode(e.find(5)->second.bytes);
    for (auto [it, end] = summary.equal_range(1); it != end; ++it) {
      auto v = test::decode(it->second.bytes);
      if (v.find(1)->second.bytes == "train/loss") event_losses.push_back(test::as<float>(v.find(2)->second.bytes));
    }
  }
  EXPECT_EQ(scalar_steps, steps);
  EXPECT_EQ(start_steps, (std::vector<int64_t>{4}));
  const auto want = losses();
  ASSERT_EQ(event_losses.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(event_losses[i], static_cast<float>(want[i])) << "step " << i + 1;

  // A checkpoint of another folder does not resume into this one, which holds its own run.
  const auto other = dir / "elsewhere";
  std::filesystem::create_directories(other);
  std::filesystem::copy(dir / "out" / "checkpoint-6", other / "checkpoint-6", std::filesystem::copy_options::recursive);
  auto mixed = train("--config " + m + " --resume " + (other / "checkpoint-6").string() + "/");
  EXPECT_EQ(mixed.exit_code, 2) << mixed.output;
  EXPECT_NE(mixed.output.find("which holds checkpoints of another run"), std::string::npos) << mixed.output;
  auto own = train("--config " + m + " --resume " + (dir / "out" / "checkpoint-6").string() + "/ --set train.max_steps=7");
  EXPECT_EQ(own.exit_code, 0) << own.output;
}

TEST_F(TrainRun, FirstSignalSaysTheStepFinishesSecondStopsAtOnce) {
  // Steps of 400 sequences (about a second): long enough that both signals arrive within one step.
  write_tokens(random_pattern(64, 10), 800);
  auto m = manifest("max_steps = 1000\ngrad_accum = 400\n");
  const pid_t pid = start_training({"--config", m}, dir / "output");
  for (int i = 0; i < 1200 && losses().empty(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  ASSERT_FALSE(losses().empty());
  kill(pid, SIGTERM);
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_NE(slurp(dir / "output").find("SIGTERM received: step 2 will finish, then a checkpoint is saved and the run stops"),
            std::string::npos)
      << "not said at once:\n" << slurp(dir / "output");
  kill(pid, SIGTERM);
  int status = 0;
  waitpid(pid, &status, 0);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 128 + SIGTERM);
  const std::string out = slurp(dir / "output");
  EXPECT_NE(out.find("second SIGTERM: stopping now without saving; step 1 (done, not saved) and step 2 (in progress) are "
                     "lost"),
            std::string::npos)
      << out;
  EXPECT_TRUE(list_checkpoints((dir / "out").string()).empty()) << "the second signal still saved";
}

TEST_F(TrainRun, DamagedTrainerStateOrAFileAsOutputDirIsRefusedByName) {
  write_tokens(random_pattern(64, 11), 8);
  auto m = manifest("max_steps = 4\nsave_steps = 2\n");
  ASSERT_EQ(train("--config " + m).exit_code, 0);
  test::write_file(dir / "out" / "checkpoint-4" / "trainer_state.json", "{\"step\": 4, \"seq");
  auto r = train("--config " + m + " --resume latest --set train.max_steps=6");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("checkpoint-4/trainer_state.json is not valid JSON"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("fix: resume from the checkpoint before it: --resume " + (dir / "out" / "checkpoint-2").string()),
            std::string::npos)
      << r.output;

  test::write_file(dir / "afile", "x");
  auto f = train("--config " + m + " --set run.output_dir=\\\"" + (dir / "afile").string() + "\\\"");
  EXPECT_EQ(f.exit_code, 2) << f.output;
  EXPECT_NE(f.output.find("run.output_dir " + (dir / "afile").string() + " is a file, not a folder"), std::string::npos)
      << f.output;
  auto under = train("--config " + m + " --set run.output_dir=\\\"" + (dir / "afile" / "out").string() + "\\\"");
  EXPECT_EQ(under.exit_code, 2) << under.output;
  EXPECT_NE(under.output.find("cannot create run.output_dir " + (dir / "afile" / "out").string()), std::string::npos)
      << under.output;
}

TEST_F(TrainRun, RotationAndStartLeaveNoHalfFolders) {
  write_tokens(random_pattern(64, 12), 8);
  auto m = manifest("max_steps = 3\nsave_steps = 1\nkeep_checkpoints = 1\n");
  ASSERT_EQ(train("--config " + m).exit_code, 0);
  std::vector<std::string> names;
  for (const auto& e : std::filesystem::directory_iterator(dir / "out"))
    if (e.is_directory()) names.push_back(e.path().filename().string());
  EXPECT_EQ(names, (std::vector<std::string>{"checkpoint-3"}));

  // What a kill during a save and during a rotation leaves.
  test::write_file(dir / "out" / ".checkpoint-4.tmp" / "model.safetensors", std::string(1000, 'x'));
  test::write_file(dir / "out" / ".deleting-checkpoint-2" / "trainer_state.json", "{}");
  auto r = train("--config " + m + " --resume latest --set train.max_steps=4");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find(".checkpoint-4.tmp (0 MB), left by an interrupted checkpoint save"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(".deleting-checkpoint-2 (0 MB), left by an interrupted checkpoint deletion"), std::string::npos)
      << r.output;
  EXPECT_FALSE(std::filesystem::exists(dir / "out" / ".deleting-checkpoint-2"));
  EXPECT_TRUE(std::filesystem::exists(dir / "out" / "checkpoint-4" / "model.safetensors"));
}

}  // namespace
}  // namespace lcx
