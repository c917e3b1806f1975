// The whole King James Bible (data/kjv/kjv.txt, 4.3 MB) against `tokenizers`' ids: exact count
// (1,160,924), sha256 of every id, the first and last 2000; the same ids from 1, 2 and 16 threads;
// decoding gives the book back.
#include <gtest/gtest.h>

#include "data/dataset.h"
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

// The book as a dataset of 262,144-token sequences: four full ones and the remainder padded to a
// multiple of 8; the ids are the tokenizer's; the second open maps the cache.
TEST(TokenizerKjv, BookAsDatasetThroughTheCache) {
  auto tok_path = test::qwen3_tokenizer_path(), kjv = test::kjv_path();
  LCX_NEED_DATA(tok_path);
  LCX_NEED_DATA(kjv);
  Tokenizer tok = Tokenizer::load(tok_path);
  DataConfig cfg;
  cfg.source = kjv;
  cfg.cache_dir = test::temp_dir();
  cfg.seq_len = 262144;
  cfg.pad_to_multiple_of = 8;
  Dataset d = Dataset::open(cfg, tok, {.progress = false});
  ASSERT_EQ(d.num_sequences(), 5);
  EXPECT_EQ(d.report().tokens, 1160924);
  const int64_t rem = 1160924 - 4 * 262144;
  EXPECT_EQ(d.length(4), (rem + 7) / 8 * 8);
  EXPECT_EQ(d.report().padding, (rem + 7) / 8 * 8 - rem);
  auto ids = tok.encode(test::read_file(kjv));
  Sequence s = d.get(1);
  for (int64_t t = 0; t < 262144; ++t) {
    ASSERT_EQ(s.tokens.data_as<int32_t>()[t], ids[262144 + t]) << t;
    ASSERT_EQ(s.targets.data_as<int64_t>()[t], t + 1 < 262144 ? ids[262144 + t + 1] : -100) << t;
  }
  int64_t valid = 0;
  for (int64_t i = 0; i < d.num_sequences(); ++i) valid += d.valid_labels(i);
  EXPECT_EQ(valid, 1160924 - 5);
  Dataset again = Dataset::open(cfg, tok, {.progress = false});
  EXPECT_TRUE(again.report().from_cache);
  EXPECT_EQ(again.get(4).tokens.data_as<int32_t>()[0], ids[4 * 262144]);
}

}  // namespace
}  // namespace lcx
