// lcx-train refusing what would otherwise run wrong or mislead: a checkpoint's own rope
// scaling, values out of range, sizes past 64 bits or past the data, a folder given for a file,
// and fixes that name the real mistake. Each case runs the real binary and reads its exit code
// and message, as a user would.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <fstream>
#include <sstream>

#include "lcx/error.h"
#include "plan/plan.h"
#include "support/test_util.h"

namespace lcx {
namespace {

struct Refusals : ::testing::Test {
  std::filesystem::path dir = test::temp_dir("refusals");

  void SetUp() override {
    if (!std::filesystem::exists(test::qwen3_tokenizer())) GTEST_SKIP() << "data/qwen3/tokenizer.json absent: run scripts/fetch_data.sh";
    std::ofstream out(dir / "data.tokens", std::ios::binary);
    for (uint32_t i = 0; i < 512; ++i) {
      const uint32_t id = (i * 7) % 256;
      out.write(reinterpret_cast<const char*>(&id), 4);
    }
  }

  // The tiny run of test_util, its model's config.json keys extended by `init_extra` (",key: value").
  std::string manifest(const std::string& train, const std::string& tables = {}, const std::string& init_extra = {}) {
    std::string text = test::tiny_run_manifest(dir / "out", dir / "data.tokens", 1, true, train, tables);
    const std::string tied = "\"tie_word_embeddings\": true";
    text.replace(text.find(tied), tied.size(), tied + init_extra);
    test::write_file(dir / "run.toml", text);
    return (dir / "run.toml").string();
  }

  test::CommandResult lcx(const std::string& args) { return test::run_command(test::lcx_train() + " " + args); }
};

// What lcx-train printed of a refusal: its "error: " line and its "  fix: " line (empty where none).
struct Refusal {
  std::string error, fix;
};
Refusal refusal_of(const std::string& output) {
  Refusal r;
  std::istringstream in(output);
  for (std::string line; std::getline(in, line);) {
    if (line.starts_with("error: ")) r.error = line.substr(7);
    if (line.starts_with("  fix: ")) r.fix = line.substr(7);
  }
  return r;
}

size_t count(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

// Item 1: a checkpoint trained with YaRN trains with YaRN, or not at all.
TEST_F(Refusals, CheckpointYarnIsTakenOrRefusedNeverIgnored) {
  const std::string yarn =
      R"(, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0, "original_max_position_embeddings": 64})";
  auto plain = lcx("--config " + manifest("max_steps = 1\n", {}, yarn));
  EXPECT_EQ(plain.exit_code, 2) << plain.output;
  const Refusal yarn_refused = refusal_of(plain.output);
  EXPECT_NE(yarn_refused.error.find("rope_type 'yarn'"), std::string::npos) << plain.output;
  EXPECT_EQ(yarn_refused.fix,
            "add \"rope_yarn\" to [plugins] load: it takes the checkpoint's yarn values (for an ablation without them, "
            "add it and pass --disable rope_yarn)")
      << plain.output;

  const std::string with_yarn = manifest("max_steps = 1\n", "[plugins]\nload = [\"rope_yarn\"]\n", yarn);
  auto taken = lcx("--config " + with_yarn);
  EXPECT_EQ(taken.exit_code, 0) << taken.output;
  EXPECT_EQ(taken.output.find("is ignored"), std::string::npos) << taken.output;
  // The saved config.json says YaRN both ways: rope_parameters (transformers 5) and rope_scaling
  // (transformers 4, vLLM).
  const auto saved = nlohmann::json::parse(std::ifstream(dir / "out" / "checkpoint-1" / "config.json"));
  EXPECT_EQ(saved["rope_parameters"]["rope_type"], "yarn") << saved.dump();
  ASSERT_TRUE(saved.contains("rope_scaling")) << saved.dump();
  EXPECT_EQ(saved["rope_scaling"]["type"], "yarn") << saved.dump();
  EXPECT_EQ(saved["rope_scaling"]["rope_type"], "yarn") << saved.dump();
  EXPECT_EQ(saved["rope_scaling"]["factor"], 4.0) << saved.dump();
  EXPECT_EQ(saved["rope_scaling"]["original_max_position_embeddings"], 64) << saved.dump();
  EXPECT_FALSE(saved["rope_scaling"].contains("rope_theta")) << saved.dump();

  // An ablation says, once, what it leaves out.
  auto ablation = lcx("--config " + with_yarn + " --disable rope_yarn --overwrite");
  EXPECT_EQ(ablation.exit_code, 0) << ablation.output;
  EXPECT_EQ(count(ablation.output, "--disable rope_yarn: the checkpoint's rope_type 'yarn' is ignored"), 1u)
      << ablation.output;

  // transformers 4's spelling, and a type no provider computes.
  auto v4 = lcx("--overwrite --config " + manifest("max_steps = 1\n", {}, R"(, "rope_scaling": {"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64})"));
  EXPECT_EQ(v4.exit_code, 2) << v4.output;
  EXPECT_NE(v4.output.find("rope_type 'yarn'"), std::string::npos) << v4.output;
  auto longrope = lcx("--overwrite --config " + manifest("max_steps = 1\n", {}, R"(, "rope_scaling": {"type": "longrope", "factor": 2.0})"));
  EXPECT_EQ(longrope.exit_code, 2) << longrope.output;
  EXPECT_NE(longrope.output.find("rope_type 'longrope'"), std::string::npos) << longrope.output;
}

// Item 4 (and 12: a --set value is named as the override, not as line 1 of the manifest).
TEST_F(Refusals, ValuesOutOfRangeAreRefusedWhenRead) {
  const std::string m = manifest("max_steps = 1\n");
  struct Case {
    const char* set;
    const char* range;
  };
  const Case cases[] = {{"train.lr=-0.001", "must be >= 0"},
                        {"train.beta1=1.0", "must be in [0, 1)"},
                        {"train.beta2=-1", "must be in [0, 1)"},
                        {"train.eps=0", "must be > 0"},
                        {"train.weight_decay=-0.1", "must be >= 0"},
                        {"train.warmup_steps=-5", "must be >= 0"},
                        {"train.max_steps=-2", "or -1 (the default)"},
                        {"train.keep_checkpoints=-1", "must be >= 0"},
                        {"train.log_every=0", "must be >= 1"},
                        {"train.grad_accum=0", "must be in [1, 1048576]"},
                        {"train.grad_accum=9223372036854775807", "must be in [1, 1048576]"},
                        {"train.save_steps=-1", "must be >= 0"},
                        {"train.max_grad_norm=-1.0", "must be >= 0"},
                        {"train.epochs=0", "must be > 0"},
                        {"distributed.timeout_s=0", "must be > 0"}};
  for (const auto& c : cases) {
    const std::string set = c.set, key = set.substr(0, set.find('='));
    auto r = lcx("--config " + m + " --dry-run --set " + set);
    EXPECT_EQ(r.exit_code, 2) << set << "\n" << r.output;
    EXPECT_NE(r.output.find("error: --set " + set + ": " + key + ": "), std::string::npos) << r.output;
    EXPECT_NE(r.output.find(c.range), std::string::npos) << set << "\n" << r.output;
  }
  // From the file, the key's line is named.
  test::write_file(dir / "lr.toml", "[train]\nlr = -1.0\n");
  auto file = lcx("--config " + (dir / "lr.toml").string() + " --dry-run");
  EXPECT_EQ(file.exit_code, 2);
  EXPECT_NE(file.output.find("lr.toml:2: train.lr: -1 is out of range"), std::string::npos) << file.output;
  // An unknown key given by --set names the override too.
  auto unknown = lcx("--config " + m + " --dry-run --set train.max_step=3");
  EXPECT_NE(unknown.output.find("--set train.max_step=3: train.max_step: unknown key"), std::string::npos) << unknown.output;
}

// Item 4: a run that diverges anyway says which optimizer settings it ran with.
TEST_F(Refusals, NonFiniteStopNamesTheOptimizerSettings) {
  auto r = lcx("--config " + manifest("max_steps = 8\n") + " --set train.lr=1e30 --set train.beta2=0.5");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("non-finite loss or gradient"), std::string::npos) << r.output;
  for (const char* part : {"lr = 1e+30", "beta1 = 0.9", "beta2 = 0.5", "eps = 1e-08", "weight_decay = 0", "max_grad_norm = 1"})
    EXPECT_NE(r.output.find(part), std::string::npos) << part << "\n" << r.output;
}

// Item 5: sizes past 64 bits are refused, not wrapped into a plan that "fits"; a sequence longer
// than the data is refused with the data's count.
TEST_F(Refusals, SizesPastSixtyFourBitsOrPastTheData) {
  const std::string m = manifest("max_steps = 1\n");
  for (const char* len : {"10000000000000000", "1000000000000000000"}) {
    auto plan = lcx("--config " + m + " --plan --gpu-memory 80GB --set data.seq_len=" + len);
    EXPECT_EQ(plan.exit_code, 2) << plan.output;
    EXPECT_NE(plan.output.find(str("data.seq_len = ", len, ": the step's buffers pass what 64-bit sizes count")),
              std::string::npos)
        << plan.output;
    EXPECT_EQ(plan.output.find("fits"), std::string::npos) << plan.output;
  }
  auto plan = lcx("--config " + m + " --plan --gpu-memory 80GB --set data.seq_len=1000000000000");
  EXPECT_EQ(plan.exit_code, 1) << plan.output;  // huge but countable: planned, and it does not fit
  EXPECT_NE(plan.output.find("verdict: does NOT fit"), std::string::npos) << plan.output;

  // On a host with the memory for such a step (the CPU's check comes first).
  auto run = lcx("--config " + m + " --set data.seq_len=1000000000000 --set run.host_memory=1000000TB");
  EXPECT_EQ(run.exit_code, 2) << run.output;
  const Refusal longer = refusal_of(run.output);
  EXPECT_NE(longer.error.find("data.seq_len = 1000000000000 is longer than the 512 tokens"), std::string::npos)
      << run.output;
  EXPECT_EQ(longer.fix, "use data.seq_len <= 512, or add documents") << run.output;
}

// Item 7: a folder where a file belongs is refused by name, and nothing is written first.
TEST_F(Refusals, FolderForAFileIsRefusedAndNothingIsWritten) {
  std::filesystem::create_directories(dir / "cwd" / "a_folder.toml");
  auto r = test::run_command("cd " + (dir / "cwd").string() + " && " + test::lcx_train() + " --config a_folder.toml");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("--config: 'a_folder.toml' is a folder, not a file"), std::string::npos) << r.output;
  EXPECT_FALSE(std::filesystem::exists(dir / "cwd" / "runs")) << "a run folder was made for a refused manifest";

  auto tok = lcx("tokenize --tokenizer " + test::qwen3_tokenizer() + " --file " + dir.string());
  EXPECT_EQ(tok.exit_code, 2) << tok.output;
  EXPECT_NE(tok.output.find("--file: '" + dir.string() + "' is a folder, not a file"), std::string::npos) << tok.output;
  auto tokenizer = lcx("tokenize --tokenizer " + dir.string() + " --text hi");
  EXPECT_EQ(tokenizer.exit_code, 2) << tokenizer.output;
  EXPECT_NE(tokenizer.output.find("is a folder, not a file"), std::string::npos) << tokenizer.output;

  // A plugin table refused: still no run folder.
  auto bad_table = lcx("--config " + manifest("max_steps = 1\n", "[plugins]\nload = [\"rope_yarn\"]\n[rope_yarn]\nfactr = 2.0\n"));
  EXPECT_EQ(bad_table.exit_code, 2) << bad_table.output;
  EXPECT_NE(bad_table.output.find("rope_yarn.factr: unknown key"), std::string::npos) << bad_table.output;
  EXPECT_FALSE(std::filesystem::exists(dir / "out")) << "the run folder was made before the manifest was valid";
}

// Item 12: each fix names the real mistake.
TEST_F(Refusals, FixesNameTheRealMistake) {
  auto twice = lcx("--config " + manifest("max_steps = 1\n", "[plugins]\nload = [\"loss_chunked\", \"loss_chunked\"]\n") + " --dry-run");
  EXPECT_EQ(twice.exit_code, 2) << twice.output;
  EXPECT_NE(twice.output.find("'loss_chunked' is listed twice"), std::string::npos) << twice.output;
  EXPECT_EQ(twice.output.find("--disable"), std::string::npos) << twice.output;

  test::write_file(dir / "data.tokens", "");
  for (const char* drop : {"false", "true"}) {
    auto empty = lcx("--config " + manifest("max_steps = 1\n") + " --set data.drop_last=" + drop);
    EXPECT_EQ(empty.exit_code, 2) << empty.output;
    EXPECT_NE(empty.output.find("holds no token"), std::string::npos) << empty.output;
    EXPECT_EQ(empty.output.find("drop_last = false"), std::string::npos) << empty.output;
  }
}

// A step whose pinned host bytes pass the host's memory ([run] host_memory here,
// MemAvailable and the cgroup's room by default) is refused with the amount and the fix before
// training, not left to a failed pin or the OOM killer. On the CPU the pinned bytes are part of
// the step's host bytes, which are held to the host's memory as a whole.
TEST_F(Refusals, OffloadPastTheHostMemoryIsRefusedBeforeTraining) {
  const std::string m = manifest("max_steps = 1\n", "[plugins]\nload = [\"offload\"]\n");
  auto short_host = lcx("--config " + m + " --set run.host_memory=1KB");
  EXPECT_EQ(short_host.exit_code, 2) << short_host.output;
  const Refusal pinned = refusal_of(short_host.output);
  EXPECT_NE(pinned.error.find("on the CPU the step needs "), std::string::npos) << short_host.output;
  EXPECT_NE(pinned.error.find(" of host memory but the host has 1.0 KiB: short by "), std::string::npos)
      << short_host.output;
  EXPECT_NE(pinned.fix.find("a shorter data.seq_len"), std::string::npos) << short_host.output;
  EXPECT_EQ(short_host.output.find("recipe:"), std::string::npos) << short_host.output;
  EXPECT_FALSE(std::filesystem::exists(dir / "out" / "metrics.jsonl"));

  auto enough = lcx("--config " + m + " --overwrite --set run.host_memory=1GB");
  EXPECT_EQ(enough.exit_code, 0) << enough.output;
  EXPECT_TRUE(std::filesystem::exists(dir / "out" / "metrics.jsonl"));
}

// A mesh the loaded plugins cannot serve is refused by the plan, naming the axis,
// never printed as if something would run it.
TEST_F(Refusals, PlanRefusesAMeshNoLoadedPluginServes) {
  const std::string m = manifest("max_steps = 1\n", "[distributed]\ncp = 2\nsp = 2\n[plugins]\nload = [\"cp_ring\"]\n");
  auto plan = lcx("--config " + m + " --plan --gpu-memory 80GB");
  EXPECT_EQ(plan.exit_code, 2) << plan.output;
  const Refusal unserved = refusal_of(plan.output);
  EXPECT_NE(unserved.error.find("[distributed] sp = 2 but the loaded parallelism (cp_ring) serves only the cp axis"),
            std::string::npos)
      << plan.output;
  EXPECT_EQ(unserved.fix,
            "set distributed.sp = 1, or load the parallelism plugin that serves the sp axis instead (lcx-train "
            "--list-plugins)")
      << plan.output;
  EXPECT_EQ(plan.output.find("memory plan"), std::string::npos) << plan.output;
  // cp 2 x sp 4 with the ring alone; a size key is refused by name.
  auto wide = lcx("--config " + m + " --plan --gpu-memory 80GB --set distributed.sp=4");
  EXPECT_EQ(wide.exit_code, 2) << wide.output;
  EXPECT_NE(wide.output.find("[distributed] sp = 4 but the loaded parallelism (cp_ring) serves only the cp axis"),
            std::string::npos)
      << wide.output;
  auto sized = lcx("--config " + m + " --plan --gpu-memory 80GB --set distributed.sp=4 --set cp_ring.size=8");
  EXPECT_EQ(sized.exit_code, 2) << sized.output;
  EXPECT_NE(sized.output.find("cp_ring.size: unknown key"), std::string::npos) << sized.output;

  auto none = lcx("--config " + m + " --plan --gpu-memory 80GB --disable cp_ring --set distributed.sp=1");
  EXPECT_EQ(none.exit_code, 2) << none.output;
  EXPECT_NE(none.output.find("[distributed] cp = 2 but the loaded parallelism (single) splits no sequence"), std::string::npos)
      << none.output;

  auto served = lcx("--config " + m + " --plan --gpu-memory 80GB --set distributed.sp=1");
  EXPECT_EQ(served.exit_code, 0) << served.output;
  EXPECT_NE(served.output.find("memory plan"), std::string::npos) << served.output;
}

// Cp and sp both above 1 with both axes' providers loaded is the two-dimensional mesh:
// sp_ulysses stacks over cp_ring whichever order [plugins] load names them, the plan counts both
// and training runs; a sequence the mesh cannot split is refused by name before any step.
TEST_F(Refusals, TwoDimensionalSequenceParallelismStacksBothProviders) {
  for (const char* load : {"\"cp_ring\", \"sp_ulysses\"", "\"sp_ulysses\", \"cp_ring\""}) {
    const std::string m =
        manifest("max_steps = 1\n", str("[distributed]\nnproc_per_node = 4\ncp = 2\nsp = 2\n[plugins]\nload = [", load, "]\n"));
    auto plan = lcx("--config " + m + " --plan --gpu-memory 80GB");
    EXPECT_EQ(plan.exit_code, 0) << plan.output;
    EXPECT_NE(plan.output.find("memory plan"), std::string::npos) << plan.output;
    EXPECT_NE(plan.output.find("parallelism sp_ulysses"), std::string::npos) << plan.output;
    auto run = lcx("--config " + m + " --overwrite");
    EXPECT_EQ(run.exit_code, 0) << run.output;
    EXPECT_NE(run.output.find("cp_ring: ring traffic per rank"), std::string::npos) << run.output;
    EXPECT_TRUE(std::filesystem::exists(dir / "out" / "metrics.jsonl"));
  }
  const std::string m =
      manifest("max_steps = 1\n", "[distributed]\nnproc_per_node = 8\ncp = 2\nsp = 4\n[plugins]\nload = [\"cp_ring\", \"sp_ulysses\"]\n");
  auto odd = lcx("--config " + m + " --overwrite --set data.seq_len=24");
  EXPECT_EQ(odd.exit_code, 2) << odd.output;
  const Refusal unsplit = refusal_of(odd.output);
  EXPECT_NE(unsplit.error.find("need a multiple of 2 x cp x sp = 16"), std::string::npos) << odd.output;
  EXPECT_EQ(unsplit.fix, "set data.pad_to_multiple_of = 16 and [data] seq_len to a multiple of 16") << odd.output;
}

}  // namespace
}  // namespace lcx
