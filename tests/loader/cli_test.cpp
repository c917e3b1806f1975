// lcx-train as a user runs it: exit codes and the one-line messages of each refusal.
#include <gtest/gtest.h>

#include <map>
#include <set>
#include <sstream>

#include "config/manifest.h"
#include "config/reference.h"
#include "loader/plugin_loader.h"
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

// Without --set-only every key read is printed, the defaults marked; with it, only the keys set.
TEST_F(Cli, DryRunPrintsDefaultsAndSetOnlyTheKeysSet) {
  auto m = runnable("[plugins]\nload = [\"loss_chunked\"]\n[train]\nlr = 1e-4\n");
  auto all = lcx("--config " + m + " --dry-run --set train.max_steps=3");
  ASSERT_EQ(all.exit_code, 0) << all.output;
  for (const char* line : {"lr = 1e-04\n", "max_steps = 3\n", "schedule = \"linear\"  # default\n",
                           "text_field = \"text\"  # default\n", "[loss_chunked]\nchunk_rows = \"auto\"  # default\n"})
    EXPECT_NE(all.output.find(line), std::string::npos) << line << "\n" << all.output;
  auto set = lcx("--config " + m + " --dry-run --set-only --set train.max_steps=3");
  ASSERT_EQ(set.exit_code, 0) << set.output;
  EXPECT_NE(set.output.find("max_steps = 3"), std::string::npos) << set.output;
  EXPECT_NE(set.output.find("lr = 0.0001"), std::string::npos) << set.output;
  EXPECT_EQ(set.output.find("schedule"), std::string::npos) << set.output;
  EXPECT_EQ(set.output.find("chunk_rows"), std::string::npos) << set.output;
}

// The tables of `lcx-train config`'s output: [name] -> the keys listed under it.
std::map<std::string, std::set<std::string>> reference_keys(const std::string& text) {
  std::map<std::string, std::set<std::string>> out;
  std::string table, line;
  std::istringstream in(text);
  while (std::getline(in, line)) {
    if (line.size() > 2 && line[0] == '[') table = line.substr(1, line.find(']') - 1);
    else if (line.rfind("  ", 0) == 0 && line.rfind("      ", 0) != 0)
      out[table].insert(line.substr(2, line.find_first_of(" ", 2) - 2));
  }
  return out;
}

// Each plugin, created with its keys set (so keys read only in some branches are read too), reads
// only keys that `lcx-train config` lists under its table, each with its line.
TEST_F(Cli, ConfigListsEveryKeyEachPluginReads) {
  auto r = run_command(test::lcx_train() + " config");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto listed = reference_keys(r.output);
  for (const char* core : {"run", "model", "data", "eval", "train", "plugins", "distributed"})
    EXPECT_TRUE(listed.count(core)) << core << "\n" << r.output;
  const std::map<std::string, std::string> tables = {
      {"loss_chunked", "chunk_rows = 128"},
      {"rope_yarn", "factor = 4.0\noriginal_max_position_embeddings = 64\nbeta_fast = 32.0\nbeta_slow = 1.0\n"
                    "attention_factor = 1.1\nmscale = 1.0\nmscale_all_dim = 1.0\ntruncate = false"},
      {"offload", "prefetch = 2\nmax_host_mib = 64\ngpu_layers = 1"},
      {"tiled_mlp", "tile_rows = 256"},
      {"cp_ring", "balance = \"work\""},
      {"sp_ulysses", ""},
      {"host_adamw", "threads = 2"},
      {"qwen3", "check_finite = false\nmax_shard_size = \"1GB\"\nattention_head_groups = 2\n"
                "attention_keep_outputs = true\nkeep_attention = true"}};
  PluginLoader loader({test::build_plugin_dir()});
  for (const auto& [name, body] : tables) {
    Manifest m = Manifest::parse(str("[", name, "]\n", body, "\n"), "run.toml");
    loader.create(name, PluginArgs{name, m.section(name), Device::cpu(), MeshShape{}});
    ASSERT_TRUE(listed.count(name)) << name << "\n" << r.output;
    size_t read = 0;
    for (const KeyRecord& k : m.keys()) {
      if (k.table != name) continue;
      ++read;
      EXPECT_TRUE(listed.at(name).count(k.key)) << name << "." << k.key << " is read but not in lcx-train config";
      EXPECT_FALSE(k.meaning.empty()) << name << "." << k.key;
    }
    EXPECT_EQ(read, listed.at(name).size()) << name;
  }
  // The markdown is the same reference, one table row a key.
  auto md = run_command(test::lcx_train() + " config --markdown");
  ASSERT_EQ(md.exit_code, 0) << md.output;
  EXPECT_NE(md.output.find("## [rope_yarn]"), std::string::npos);
  EXPECT_NE(md.output.find("| `original_max_position_embeddings` | integer; >= 1 |"), std::string::npos) << md.output;
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
  // A number over a number of the other kind; the key's reader judges a fraction.
  auto whole = manifest("[train]\nlr = 1\nmax_steps = 10\n");
  auto fraction = lcx("--config " + whole + " --dry-run --set train.lr=2.5");
  EXPECT_FALSE(fraction.output.find("wants an integer") != std::string::npos) << fraction.output;
  EXPECT_NE(fraction.output.find("lr = 2.5"), std::string::npos) << fraction.output;
  auto steps = lcx("--config " + whole + " --dry-run --set train.max_steps=2.5");
  EXPECT_EQ(steps.exit_code, 2) << steps.output;
  EXPECT_NE(steps.output.find("train.max_steps: expected integer"), std::string::npos) << steps.output;
  m = manifest("[train]\nlr = 1e-4\nmax_steps = 10\n");
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
