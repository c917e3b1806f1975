// The whole King James Bible (data/kjv/kjv.txt, 4.3 MB) against `tokenizers`' ids: exact count
// (1,160,924), sha256 of every id, the first and last 2000; the same ids from 1, 2 and 16 threads;
// decoding gives the book back.
#include <gtest/gtest.h>

#include "data/tokenizer.h"
#include "data_test_util.h"
#include "util/sha256.h"

namespace lcx {
namespace {

TEST(TokenizerKjv, WholeBookMatchesTheLibrary) {
  auto tok_path = test::qwen3_tokenizer_path(), kjv = test::kjv_path();
  LCX_NEED_DATA(tok_path);
  LCX_NEED_DATA(kjv);
  auto g = test::load_json(std::string(LCX_TEST_DATA_DIR) + "/data/fixtures/qwen3_golden.json")["kjv"];
  std::string text = test::read_file(kjv);
  ASSERT_EQ(sha256_string(text), g["text_sha256"].get<std::string>());
  Tokenizer tok = Tokenizer::load(tok_path);
  auto ids = tok.encode(text, 1);
  ASSERT_EQ(ids.size(), 1160924u);
  ASSERT_EQ(static_cast<int64_t>(ids.size()), g["count"].get<int64_t>());
  auto first = g["first"].get<std::vector<int32_t>>(), last = g["last"].get<std::vector<int32_t>>();
  EXPECT_EQ(std::vector<int32_t>(ids.begin(), ids.begin() + first.size()), first);
  EXPECT_EQ(std::vector<int32_t>(ids.end() - last.size(), ids.end()), last);
  // uint32 little endian, as gen_golden.py packs them.
  std::string bytes(ids.size() * 4, '\0');
  for (size_t i = 0; i < ids.size(); ++i)
    for (int b = 0; b < 4; ++b) bytes[4 * i + b] = static_cast<char>((static_cast<uint32_t>(ids[i]) >> (8 * b)) & 0xFF);
  EXPECT_EQ(sha256_string(bytes), g["ids_sha256"].get<std::string>());

  EXPECT_EQ(tok.encode(text, 2), ids);
  EXPECT_EQ(tok.encode(text, 16), ids);
  EXPECT_EQ(tok.decode(ids), text);
}

}  // namespace
}  // namespace lcx
