// docs/writing-a-plugin.md as a newcomer follows it: its `file=NAME` code blocks are extracted,
// the plugin is built with the guide's own command and the build's compiler, and lcx-train loads
// it (--dry-run), trains with it (one step, its weight seen in the loss) and plans it (--plan
// lists its logits). A guide that drifts from the SDK fails here.
#include <gtest/gtest.h>

#include <fstream>
#include <map>
#include <random>
#include <sstream>

#include "support/test_util.h"
#include "support/trained_run.h"

namespace lcx {
namespace {

namespace fs = std::filesystem;

// Every fenced block whose info string has `file=NAME`, by NAME.
std::map<std::string, std::string> guide_files(const fs::path& markdown) {
  std::ifstream in(markdown);
  std::map<std::string, std::string> files;
  std::string line, name, body;
  bool inside = false;
  while (std::getline(in, line)) {
    if (!inside && line.rfind("```", 0) == 0) {
      const size_t at = line.find("file=");
      inside = true;
      name = at == std::string::npos ? "" : line.substr(at + 5);
      body.clear();
    } else if (inside && line.rfind("```", 0) == 0) {
      inside = false;
      if (!name.empty()) files[name] = body;
    } else if (inside) {
      body += line + "\n";
    }
  }
  return files;
}

fs::path guide() { return fs::path(LCX_SOURCE_DIR) / "docs/writing-a-plugin.md"; }

TEST(Guide, HoldsTheExampleItsBuildAndItsTables) {
  const auto files = guide_files(guide());
  for (const char* name : {"my_loss.cpp", "build.sh", "plugin.toml"}) EXPECT_EQ(files.count(name), 1u) << name;
  ASSERT_EQ(files.count("my_loss.cpp"), 1u);
  EXPECT_NE(files.at("my_loss.cpp").find("void plan("), std::string::npos) << "the example loss must plan itself";
}

// One test, since each step needs the one before: build, --dry-run, one training step, --plan.
TEST(Guide, ExampleBuildsLoadsTrainsAndPlans) {
  if (!fs::exists(test::qwen3_tokenizer())) GTEST_SKIP() << "data/qwen3/tokenizer.json absent: run scripts/fetch_data.sh";
  const fs::path dir = test::temp_dir("guide");
  const auto files = guide_files(guide());
  for (const auto& [name, text] : files) test::write_file(dir / name, text);
  ASSERT_EQ(files.count("plugin.toml"), 1u);

  // The guide's build command, with the build's compiler.
  const auto built = test::run_command("cd '" + dir.string() + "' && CXX='" + LCX_CXX_COMPILER + "' LCX='" +
                                       LCX_SOURCE_DIR + "' LCX_BUILD='" + LCX_BUILD_DIR + "' sh build.sh 2>&1");
  ASSERT_EQ(built.exit_code, 0) << built.output;
  ASSERT_TRUE(fs::exists(dir / "lcx_my_loss.so"));

  // The tests' tiny CPU run with the guide's tables added, beside the plugin.
  {
    std::mt19937 rng(11);
    std::vector<uint32_t> ids(32 * 8);
    for (auto& x : ids) x = rng() % 256;
    std::ofstream out(dir / "data.tokens", std::ios::binary);
    out.write(reinterpret_cast<const char*>(ids.data()), static_cast<std::streamsize>(ids.size() * 4));
  }
  auto manifest = [&](const std::string& tag) {
    const fs::path path = dir / (tag + ".toml");
    test::write_file(path, test::tiny_run_manifest(dir / ("out-" + tag), dir / "data.tokens", 3, false, "max_steps = 1\n",
                                                   files.at("plugin.toml")));
    return path.string();
  };
  auto lcx = [](const std::string& args) { return test::run_command(test::lcx_train() + " " + args); };

  auto dry = lcx("--config " + manifest("dry") + " --dry-run");
  ASSERT_EQ(dry.exit_code, 0) << dry.output;
  EXPECT_NE(dry.output.find((dir / "lcx_my_loss.so").string()), std::string::npos) << dry.output;
  EXPECT_NE(dry.output.find("config OK"), std::string::npos) << dry.output;

  auto weighted = lcx("--config " + manifest("weighted"));
  ASSERT_EQ(weighted.exit_code, 0) << weighted.output;
  auto plain = lcx("--config " + manifest("plain") + " --disable my_loss");
  ASSERT_EQ(plain.exit_code, 0) << plain.output;
  const test::TrainedRun w = test::read_trained_run(dir / "out-weighted", "none"),
                         p = test::read_trained_run(dir / "out-plain", "none");
  ASSERT_EQ(w.losses.size(), 1u);
  ASSERT_EQ(p.losses.size(), 1u);
  // The same first forward: the guide's `weight = 0.5` halves core's loss.
  EXPECT_NEAR(w.losses[0], 0.5 * p.losses[0], 1e-6 * p.losses[0]);

  auto plan = lcx("--config " + manifest("plan") + " --plan --verbose --gpu-memory 80GB");
  ASSERT_EQ(plan.exit_code, 0) << plan.output;
  EXPECT_NE(plan.output.find("loss my_loss"), std::string::npos) << plan.output;
  bool logits = false;
  std::istringstream lines(plan.output);
  for (std::string line; std::getline(lines, line);)
    logits |= line.find(" my_loss ") != std::string::npos && line.find("logits") != std::string::npos;
  EXPECT_TRUE(logits) << "no logits term of my_loss in\n" << plan.output;
}

}  // namespace
}  // namespace lcx
