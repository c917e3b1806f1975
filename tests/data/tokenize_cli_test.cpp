// `lcx-train tokenize` run as a process: ids, --count, --file, and its refusals.
#include <gtest/gtest.h>

#include <cstdio>

#include "data_test_util.h"

namespace lcx {
namespace {

struct Result {
  int status;
  std::string out;
};

Result run(const std::string& args) {
  std::string cmd = std::string(LCX_BUILD_DIR) + "/bin/lcx-train tokenize " + args + " 2>&1";
  Result r{0, {}};
  FILE* p = popen(cmd.c_str(), "r");
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) r.out.append(buf, n);
  r.status = WEXITSTATUS(pclose(p));
  return r;
}

TEST(TokenizeCli, PrintsIdsOrTheirCount) {
  std::string dir = test::temp_dir();
  std::string tok = test::write_tiny_tokenizer(dir);
  auto r = run("--tokenizer " + tok + " --text 'the the<|endoftext|>'");
  EXPECT_EQ(r.status, 0) << r.out;
  EXPECT_EQ(r.out, "257 258 259\n");
  r = run("--tokenizer " + tok + " --text 'the the' --count");
  EXPECT_EQ(r.out, "2\n");
  test::write_file(dir + "/in.txt", "ab\xff");
  r = run("--tokenizer " + tok + " --file " + dir + "/in.txt");
  EXPECT_EQ(r.status, 0);
  EXPECT_NE(r.out.find("97 98 239 191 189"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("1 invalid UTF-8"), std::string::npos) << r.out;
}

TEST(TokenizeCli, RefusesBadArguments) {
  std::string tok = test::write_tiny_tokenizer(test::temp_dir());
  EXPECT_EQ(run("--text x").status, 2);
  EXPECT_EQ(run("--tokenizer " + tok).status, 2);
  EXPECT_EQ(run("--tokenizer " + tok + " --text a --file b").status, 2);
  EXPECT_EQ(run("--tokenizer /nonexistent.json --text a").status, 2);
}

TEST(TokenizeCli, QwenIds) {
  auto path = test::qwen3_tokenizer_path();
  LCX_NEED_DATA(path);
  EXPECT_EQ(run("--tokenizer " + path + " --text 'Hello world<|im_end|>'").out, "9707 1879 151645\n");
}

}  // namespace
}  // namespace lcx
