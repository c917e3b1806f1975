// The tokenizer against ids written by Hugging Face `tokenizers` (fixtures/qwen3_golden.json, made
// by gen_golden.py): many scripts, emoji, whitespace, contractions, special tokens, random strings,
// invalid UTF-8 and added-token flags. Plus the pre-tokenizer's pieces and cut rule on their own,
// and every refusal.
#include <gtest/gtest.h>

#include <cstring>

#include <random>

#include "data/pre_tokenizer.h"
#include "data/tokenizer.h"
#include "data/utf8.h"
#include "data_test_util.h"
#include "lcx/error.h"
#include "support/test_util.h"

namespace lcx {
namespace {

using nlohmann::json;

json golden() { return test::load_json(std::string(LCX_TEST_DATA_DIR) + "/data/fixtures/qwen3_golden.json"); }

std::string show(const std::string& s) { return json(s).dump(); }

std::vector<std::string> pieces(std::string_view s) {
  std::vector<std::string> out;
  for (size_t p = 0; p < s.size();) {
    size_t e = pretok::next_piece(s, p);
    EXPECT_GT(e, p);
    out.emplace_back(s.substr(p, e - p));
    p = e;
  }
  return out;
}

TEST(Tokenizer, GoldenFixtureMatchesFetchedFile) {
  auto path = test::qwen3_tokenizer_path();
  LCX_NEED_DATA(path);
  EXPECT_EQ(Tokenizer::load(path).hash(), golden()["tokenizer_sha256"].get<std::string>());
}

TEST(Tokenizer, GoldenIdsAndDecode) {
  auto path = test::qwen3_tokenizer_path();
  LCX_NEED_DATA(path);
  Tokenizer tok = Tokenizer::load(path);
  json g = golden();
  ASSERT_GT(g["cases"].size(), 700u);
  int failures = 0;
  for (const auto& c : g["cases"]) {
    std::string text = c["text"];
    auto ids = tok.encode(text, 1);
    auto want = c["ids"].get<std::vector<int32_t>>();
    if (ids != want && ++failures <= 10) ADD_FAILURE() << "ids differ for " << show(text) << ": got " << json(ids) << " want " << json(want);
    EXPECT_EQ(tok.decode(want), c["decoded"].get<std::string>()) << show(text);
    // Encode then decode gives the text back, in NFC.
    EXPECT_EQ(tok.decode(ids), utf8::nfc(text)) << show(text);
  }
  EXPECT_EQ(failures, 0);
  for (const auto& c : g["skip_special"])
    EXPECT_EQ(tok.decode(c["ids"].get<std::vector<int32_t>>(), true), c["decoded"].get<std::string>());
}

TEST(Tokenizer, InvalidUtf8IsReplacedAsPythonDecodeDoes) {
  auto path = test::qwen3_tokenizer_path();
  LCX_NEED_DATA(path);
  Tokenizer tok = Tokenizer::load(path);
  for (const auto& c : golden()["invalid_utf8"]) {
    std::string hex = c["hex"], bytes;
    for (size_t i = 0; i < hex.size(); i += 2) bytes.push_back(static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16)));
    EncodeStats st;
    EXPECT_EQ(tok.encode(bytes, 1, &st), c["ids"].get<std::vector<int32_t>>()) << hex;
    EXPECT_EQ(st.invalid_utf8, c["replaced"].get<int64_t>()) << hex;
    EXPECT_GT(st.invalid_utf8, 0) << hex;
  }
}

TEST(Tokenizer, AddedTokenFlagsAsTheLibrary) {
  auto path = test::qwen3_tokenizer_path();
  LCX_NEED_DATA(path);
  json g = golden();
  json j = test::load_json(path);
  for (const auto& t : g["extra_tokens"]) j["added_tokens"].push_back(t);
  std::string dir = test::temp_dir();
  test::write_file(dir + "/tokenizer.json", j.dump());
  Tokenizer tok = Tokenizer::load(dir + "/tokenizer.json");
  for (const auto& c : g["extra_cases"])
    EXPECT_EQ(tok.encode(c["text"].get<std::string>(), 1), c["ids"].get<std::vector<int32_t>>()) << show(c["text"]);
}

TEST(Tokenizer, MultiThreadedEqualsSingleThreaded) {
  auto path = test::qwen3_tokenizer_path();
  LCX_NEED_DATA(path);
  Tokenizer tok = Tokenizer::load(path);
  // Every golden string end to end, many times: all kinds of cut points and added tokens.
  std::string text;
  json g = golden();
  while (text.size() < (3u << 20))
    for (const auto& c : g["cases"]) text += c["text"].get<std::string>() + (text.size() % 3 ? "\n" : "");
  auto one = tok.encode(text, 1);
  EXPECT_EQ(tok.encode(text, 2), one);
  EXPECT_EQ(tok.encode(text, 16), one);
  auto batch = tok.encode_batch({text, "Hello world", ""}, 4);
  ASSERT_EQ(batch.size(), 3u);
  EXPECT_EQ(batch[0], one);
  EXPECT_EQ(batch[1], tok.encode("Hello world"));
  EXPECT_TRUE(batch[2].empty());
}

// A text read a block at a time (tokenize --file on a file larger than memory) gives the
// ids of the whole text, whatever the block size; a tokenizer whose text cannot be cut (Llama 2's
// prepended prefix) holds the text whole and gives them too.
TEST(Tokenizer, StreamedBlocksEqualTheWholeText) {
  auto path = test::qwen3_tokenizer_path();
  LCX_NEED_DATA(path);
  std::string text;
  json g = golden();
  while (text.size() < (1u << 20))
    for (const auto& c : g["cases"]) text += c["text"].get<std::string>() + (text.size() % 3 ? "\n" : "\n\n");
  text += "\xff\xfe broken bytes\nand <|endoftext|>\n<|im_start|>user";
  auto streamed = [&](const Tokenizer& tok, const std::string& t, size_t block) {
    size_t at = 0;
    size_t parts = 0;
    std::vector<int32_t> ids;
    EncodeStats stats;
    tok.encode_stream(
        [&](char* buf, size_t n) {
          n = std::min({n, t.size() - at, size_t{5000}});  // short reads, as a pipe gives them
          std::memcpy(buf, t.data() + at, n);
          at += n;
          return n;
        },
        [&](std::vector<int32_t>&& part) {
          ids.insert(ids.end(), part.begin(), part.end());
          ++parts;
        },
        1, &stats, block);
    EXPECT_EQ(stats.invalid_utf8, 2);
    return std::make_pair(ids, parts);
  };
  const Tokenizer tok = Tokenizer::load(path);
  const auto whole = tok.encode(text, 1);
  for (const size_t block : {size_t{8192}, size_t{100000}, size_t{64} << 20}) {
    const auto [ids, parts] = streamed(tok, text, block);
    EXPECT_EQ(ids, whole) << block;
    if (block < text.size()) EXPECT_GE(parts, text.size() / block / 2) << "not read in blocks of " << block;
  }
  const std::string llama2 = test::family_tokenizer_path("llama2");
  if (!std::filesystem::exists(llama2)) return;
  const Tokenizer spm = Tokenizer::load(llama2);
  const std::string some = text.substr(0, 200000) + "\xff\xfe";
  const auto [ids, parts] = streamed(spm, some, 8192);
  EXPECT_EQ(ids, spm.encode(some, 1));
  EXPECT_EQ(parts, 1u);
}

TEST(Tokenizer, SpecialIdsAndLookups) {
  auto path = test::qwen3_tokenizer_path();
  LCX_NEED_DATA(path);
  Tokenizer tok = Tokenizer::load(path);
  EXPECT_EQ(tok.eos_id(), 151643);
  EXPECT_EQ(tok.vocab_size(), 151669);
  EXPECT_EQ(tok.token_to_id("<|im_start|>"), 151644);
  EXPECT_EQ(tok.token_to_id("\xC4\xA0the"), 279);  // "Ġthe"
  EXPECT_EQ(tok.token_to_id("no such token here"), -1);
  EXPECT_THROW(tok.decode({-1}), Error);
  EXPECT_THROW(tok.decode({200000}), Error);
}

TEST(PreTokenizer, PiecesFollowTheRegex) {
  using V = std::vector<std::string>;
  EXPECT_EQ(pieces("Hello world"), (V{"Hello", " world"}));
  EXPECT_EQ(pieces("  hi"), (V{" ", " hi"}));
  EXPECT_EQ(pieces("a\n\n b"), (V{"a", "\n\n", " b"}));
  EXPECT_EQ(pieces("x  "), (V{"x", "  "}));
  EXPECT_EQ(pieces("x \n \n  y"), (V{"x", " \n \n", " ", " y"}));
  EXPECT_EQ(pieces("it's IT'S 'Re 'LL"), (V{"it", "'s", " IT", "'S", " '", "Re", " '", "LL"}));
  EXPECT_EQ(pieces("'rex"), (V{"'re", "x"}));
  EXPECT_EQ(pieces("a123"), (V{"a", "1", "2", "3"}));
  EXPECT_EQ(pieces("!!\n\nx"), (V{"!!\n\n", "x"}));
  EXPECT_EQ(pieces(" !?x"), (V{" !?", "x"}));
  EXPECT_EQ(pieces("\t!"), (V{"\t", "!"}));
  EXPECT_EQ(pieces("\tword"), (V{"\tword"}));
  EXPECT_EQ(pieces("\xE3\x80\x80x"), (V{"\xE3\x80\x80x"}));  // U+3000 then a letter
  EXPECT_EQ(pieces("a\xC2\x85"), (V{"a", "\xC2\x85"}));      // NEL is whitespace
  EXPECT_EQ(pieces("\x1F" "a"), (V{"\x1F" "a"}));            // U+001F is not
}

// Llama 3's pattern (digits in runs of up to three) split by hand equals PCRE2 running the regex
// itself, on random texts of the classes the pattern tells apart.
TEST(PreTokenizer, Llama3PiecesByHandEqualTheRegex) {
  const pretok::Regex re(pretok::kLlama3Pattern);
  const std::vector<std::string> alphabet = {" ", "  ", "\n", "\r", "\t", "a", "Z", "word", "'", "s", "ll", "1", "23",
                                             "\xD9\xA3", ".", "!", "\xC3\xA9", "\xE4\xB8\xAD", "\xE3\x80\x80",
                                             "\xF0\x9F\x91\x8D", "\xC2\xBD"};
  std::mt19937 rng(11);
  for (int n = 0; n < 3000; ++n) {
    std::string s;
    const int len = 1 + static_cast<int>(rng() % 24);
    for (int k = 0; k < len; ++k) s += alphabet[rng() % alphabet.size()];
    std::vector<std::string> by_hand, by_regex;
    for (size_t p = 0; p < s.size();) {
      const size_t e = pretok::next_piece(s, p, 3);
      ASSERT_GT(e, p);
      by_hand.push_back(s.substr(p, e - p));
      p = e;
    }
    size_t prev = 0, st = 0, en = 0;
    for (size_t pos = 0; pos < s.size() && re.find(s, pos, st, en);) {
      if (st > prev) by_regex.push_back(s.substr(prev, st - prev));
      if (en > st) by_regex.push_back(s.substr(st, en - st));
      prev = en;
      pos = en > st ? en : st + 1;
    }
    if (prev < s.size()) by_regex.push_back(s.substr(prev));
    ASSERT_EQ(by_hand, by_regex) << show(s);
  }
  using V = std::vector<std::string>;
  std::vector<std::string> got;
  const std::string digits = "a1234567 89";
  for (size_t p = 0; p < digits.size();) {
    const size_t e = pretok::next_piece(digits, p, 3);
    got.push_back(digits.substr(p, e - p));
    p = e;
  }
  EXPECT_EQ(got, (V{"a", "123", "456", "7", " ", "89"}));
}

TEST(PreTokenizer, SafeCutsChangeNoPiece) {
  const std::vector<std::string> alphabet = {" ", "  ", "\n", "\r", "\t", "a", "Z", "word", "'", "s", "1", ".", "!",
                                             "\xC3\xA9", "\xE4\xB8\xAD", "\xE3\x80\x80", "\xF0\x9F\x91\x8D", "\xCC\x81"};
  std::mt19937 rng(7);
  int cuts = 0;
  for (int n = 0; n < 3000; ++n) {
    std::string s;
    int len = 1 + static_cast<int>(rng() % 20);
    for (int k = 0; k < len; ++k) s += alphabet[rng() % alphabet.size()];
    auto whole = pieces(s);
    for (size_t p = 0; p < s.size(); ++p) {
      if (!pretok::is_safe_cut(s, p)) continue;
      ++cuts;
      auto joined = pieces(std::string_view(s).substr(0, p));
      auto right = pieces(std::string_view(s).substr(p));
      joined.insert(joined.end(), right.begin(), right.end());
      ASSERT_EQ(joined, whole) << show(s) << " cut at " << p;
      EXPECT_EQ(utf8::nfc(s), utf8::nfc(s.substr(0, p)) + utf8::nfc(s.substr(p))) << show(s);
    }
  }
  EXPECT_GT(cuts, 500);
}

TEST(Utf8, RepairCountsMaximalSubparts) {
  int64_t n = 0;
  EXPECT_EQ(utf8::repair("a\xE2\x82" "b", &n), "a\xEF\xBF\xBD" "b");
  EXPECT_EQ(n, 1);
  EXPECT_EQ(utf8::repair("\xF0\x80\x80", &n), "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");
  EXPECT_EQ(n, 3);
  EXPECT_EQ(utf8::first_invalid("ok \xE2\x82\xAC"), std::string_view::npos);
  EXPECT_EQ(utf8::first_invalid("ok \xED\xA0\x80"), 3u);
}

// Each unsupported feature is refused with the JSON key in the message and in Error::key().
TEST(Tokenizer, RefusesWhatItDoesNotImplement) {
  std::string dir = test::temp_dir();
  json base = test::load_json(test::write_tiny_tokenizer(dir));
  struct Case {
    std::string key;
    std::function<void(json&)> edit;
  };
  std::vector<Case> cases = {
      {"normalizer.type", [](json& j) { j["normalizer"] = {{"type", "NFKC"}}; }},
      {"normalizer.normalizers[1].type",
       [](json& j) { j["normalizer"] = {{"type", "Sequence"}, {"normalizers", {{{"type", "NFC"}}, {{"type", "Lowercase"}}}}}; }},
      {"normalizer.pattern",
       [](json& j) { j["normalizer"] = {{"type", "Replace"}, {"pattern", {{"Regex", " +"}}}, {"content", "_"}}; }},
      {"pre_tokenizer.pretokenizers[0].pattern.Regex", [](json& j) { j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "(\\p{L}"; }},
      {"pre_tokenizer.pretokenizers[0].behavior", [](json& j) { j["pre_tokenizer"]["pretokenizers"][0]["behavior"] = "Shuffled"; }},
      {"pre_tokenizer.pretokenizers[1].type", [](json& j) { j["pre_tokenizer"]["pretokenizers"][1] = {{"type", "Metaspace"}}; }},
      {"pre_tokenizer.type", [](json& j) { j["pre_tokenizer"] = {{"type", "Whitespace"}}; }},
      {"pre_tokenizer.type", [](json& j) { j["pre_tokenizer"] = {{"type", "Digits"}, {"individual_digits", true}}; }},
      {"model.type", [](json& j) { j["model"]["type"] = "WordPiece"; }},
      {"model.type", [](json& j) { j["model"]["type"] = "Unigram"; }},
      {"model.type", [](json& j) { j["model"]["type"] = "WordLevel"; }},
      {"model.byte_fallback", [](json& j) { j["model"]["byte_fallback"] = true; }},
      {"model.dropout", [](json& j) { j["model"]["dropout"] = 0.1; }},
      {"model.continuing_subword_prefix", [](json& j) { j["model"]["continuing_subword_prefix"] = "##"; }},
      {"model.unk_token", [](json& j) { j["model"]["unk_token"] = "<not-in-vocab>"; }},
      {"post_processor.type", [](json& j) { j["post_processor"] = {{"type", "RobertaProcessing"}}; }},
      {"post_processor.single", [](json& j) { j["post_processor"] = {{"type", "TemplateProcessing"}}; }},
      {"decoder.type", [](json& j) { j["decoder"] = {{"type", "WordPiece"}}; }},
      {"decoder", [](json& j) { j["decoder"] = nullptr; }},
      // A ByteLevel decoder without the ByteLevel pre-tokenizer would decode a vocabulary that is not in its alphabet.
      {"decoder.type", [](json& j) { j["pre_tokenizer"]["pretokenizers"].erase(1); }},
      {"truncation", [](json& j) { j["truncation"] = {{"max_length", 512}}; }},
      {"model.merges[0]", [](json& j) { j["model"]["merges"][0] = json::array({"t", "zz"}); }},
  };
  for (const auto& c : cases) {
    json j = base;
    c.edit(j);
    test::write_file(dir + "/bad.json", j.dump());
    try {
      Tokenizer::load(dir + "/bad.json");
      ADD_FAILURE() << c.key << " was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.key(), c.key);
      EXPECT_NE(std::string(e.what()).find(c.key), std::string::npos) << e.what();
    }
  }
  EXPECT_THROW(Tokenizer::load(dir + "/missing.json"), Error);
}

// An id near 1e9 in the vocabulary (a damaged file) is refused by name, not allocated
// for (a string per id: 32 GB, then std::bad_alloc).
TEST(Tokenizer, RefusesVocabularyIdsPastAnyVocabulary) {
  std::string dir = test::temp_dir();
  json j = test::load_json(test::write_tiny_tokenizer(dir));
  for (const int64_t id : {int64_t{999999998}, int64_t{5000000000}}) {
    j["model"]["vocab"]["zzq"] = id;
    test::write_file(dir + "/big.json", j.dump());
    auto thrown = test::thrown_by([&] { Tokenizer::load(dir + "/big.json"); });
    ASSERT_TRUE(thrown.thrown) << id;
    EXPECT_NE(thrown.message.find("model.vocab[\"zzq\"] = " + std::to_string(id) + " is past 16777216"), std::string::npos)
        << thrown.message;
    EXPECT_EQ(thrown.key, "data.tokenizer");
  }
}

TEST(Tokenizer, TinyVocabularyMerges) {
  Tokenizer tok = Tokenizer::load(test::write_tiny_tokenizer(test::temp_dir()));
  EXPECT_EQ(tok.encode("the the"), (std::vector<int32_t>{257, 258}));
  EXPECT_EQ(tok.encode("thx<|endoftext|>"), (std::vector<int32_t>{256, 'x', 259}));
  EXPECT_EQ(tok.eos_id(), 259);
  EXPECT_EQ(tok.decode({257, 258, 259}), "the the<|endoftext|>");
  EXPECT_EQ(tok.decode({257, 259}, true), "the");
  // A word longer than the short-merge limit goes through the heap path: same merges.
  std::string many;
  for (int k = 0; k < 40; ++k) many += "the";
  auto ids = tok.encode(many);
  EXPECT_EQ(tok.decode(ids), many);
  EXPECT_EQ(ids, std::vector<int32_t>(40, 257));
}

}  // namespace
}  // namespace lcx
