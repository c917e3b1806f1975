// lcx-train as a user runs it: exit codes and the one-line messages of each refusal.
#include <gtest/gtest.h>

#include "support/test_util.h"

namespace lcx {
namespace {

using test::run_command;

struct Cli : ::testing::Test {
  std::filesystem::path dir = test::temp_dir("cli");
  std::string manifest(const std::string& body) {
    auto p = dir / "run.toml";
    test::write_file(p, body);
    return p.string();
  }
  // `body` with the [data] a run reads (--dry-run checks its files): the Qwen3 tokenizer and a token file.
  std::string runnable(const std::string& body) {
    test::write_file(dir / "data.tokens", std::string(4096, '\0'));
    return manifest(body + "[data]\ntokenizer = \"" + test::qwen3_tokenizer() + "\"\nsource = \"" + (dir / "data.tokens").string() +
                    "\"\nseq_len = 32\n");
  }
  test::CommandResult lcx(const std::string& args) {
    return run_command("LCX_PLUGIN_PATH=" + std::string(LCX_FIXTURE_PLUGIN_DIR) + " " + test::lcx_train() + " " + args);
  }
};

TEST_F(Cli, ListPluginsShowsTheFiveWithStatus) {
  auto r = run_command(test::lcx_train() + " --list-plugins");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const char* name : {"loss_chunked", "rope_yarn", "offload", "cp_ring", "sp_ulysses"})
    EXPECT_NE(r.output.find(name), std::string::npos) << name << "\n" << r.output;
  EXPECT_NE(r.output.find("STATUS"), std::string::npos);
  EXPECT_NE(r.output.find("lib/lcx/plugins"), std::string::npos);
}

TEST_F(Cli, VersionAndHelp) {
  auto v = run_command(test::lcx_train() + " --version");
  EXPECT_EQ(v.exit_code, 0);
  EXPECT_NE(v.output.find("plugin ABI"), std::string::npos);
  auto h = run_command(test::lcx_train() + " --help");
  EXPECT_EQ(h.exit_code, 0);
  EXPECT_NE(h.output.find("--disable"), std::string::npos);
}

TEST_F(Cli, DryRunPrintsResolvedConfigAndProviders) {
  auto m = runnable("[plugins]\nload = [\"loss_chunked\"]\n[loss_chunked]\nchunk_rows = 64\n[train]\nlr = 1e-4\n");
  auto r = lcx("--config " + m + " --dry-run --set train.lr=0.5 --set loss_chunked.chunk_rows=128");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("chunk_rows = 128"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("lr = 0.5"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("loss_chunked"), std::string::npos);
  EXPECT_NE(r.output.find("core default"), std::string::npos);
  EXPECT_NE(r.output.find("config OK"), std::string::npos);
}

TEST_F(Cli, DisableFallsBackToCoreDefault) {
  auto m = runnable("[plugins]\nload = [\"loss_chunked\"]\n[loss_chunked]\nchunk_rows = 64\n");
  auto r = lcx("--config " + m + " --dry-run --disable loss_chunked");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("loss                 nll"), std::string::npos) << r.output;
  auto bad = lcx("--config " + m + " --dry-run --disable offload");
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.output.find("--disable offload: no plugin of that name"), std::string::npos) << bad.output;
}

TEST_F(Cli, SetIsTypeChecked) {
  auto m = manifest("[train]\nlr = 1e-4\nmax_steps = 10\n");
  auto r = lcx("--config " + m + " --dry-run --set train.max_steps=ten");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("train.max_steps wants an integer (as "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("run.toml:3 gives it), got a string"), std::string::npos) << r.output;
  auto r2 = lcx("--config " + m + " --dry-run --set train.max_step=3");
  EXPECT_EQ(r2.exit_code, 2);
  EXPECT_NE(r2.output.find("train.max_step: unknown key"), std::string::npos) << r2.output;
  EXPECT_NE(r2.output.find("did you mean 'max_steps'"), std::string::npos) << r2.output;
}

TEST_F(Cli, EachLoaderRefusalExitsNonZeroWithItsMessage) {
  struct Case {
    std::string load, expect;
  };
  std::vector<Case> cases = {
      {"\"/nowhere/lcx_x.so\"", "plugin library missing"},
      {"\"offlaod\"", "did you mean 'offload'"},
      {"\"" + std::string(LCX_FIXTURE_PLUGIN_DIR) + "/lcx_not_lcx.so\"", "is not an lcx plugin"},
      {"\"other_abi\"", "this lcx has ABI"},
      {"\"loss_chunked\", \"second_loss\"", "two providers for slot loss"},
  };
  for (const auto& c : cases) {
    auto m = manifest("[plugins]\nload = [" + c.load + "]\n");
    auto r = lcx("--config " + m + " --dry-run");
    EXPECT_EQ(r.exit_code, 2) << c.load << "\n" << r.output;
    EXPECT_NE(r.output.find(c.expect), std::string::npos) << c.load << "\n" << r.output;
    EXPECT_EQ(r.output.rfind("error: ", 0), 0u) << r.output;
  }
}

TEST_F(Cli, PluginTableErrorsNameFileLineAndKey) {
  auto m = manifest("[plugins]\nload = [\"offload\"]\n\n[offload]\nprefetch = true\n");
  auto r = lcx("--config " + m + " --dry-run");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.output.find("run.toml:5: offload.prefetch: expected integer, found boolean"), std::string::npos)
      << r.output;
}

TEST_F(Cli, UnknownTableAndSyntaxErrors) {
  auto m = manifest("[trian]\nlr = 1.0\n");
  auto r = lcx("--config " + m + " --dry-run");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.output.find("unknown table [trian]: did you mean [train]?"), std::string::npos) << r.output;
  auto m2 = manifest("[train]\nlr = = 1\n");
  auto r2 = lcx("--config " + m2 + " --dry-run");
  EXPECT_EQ(r2.exit_code, 2);
  EXPECT_NE(r2.output.find("run.toml:2"), std::string::npos) << r2.output;
  auto r3 = lcx("--config " + (dir / "absent.toml").string());
  EXPECT_EQ(r3.exit_code, 2);
  EXPECT_NE(r3.output.find("absent.toml' does not exist"), std::string::npos) << r3.output;
}

}  // namespace
}  // namespace lcx
