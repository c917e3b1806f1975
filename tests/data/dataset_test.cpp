// Datasets on a tiny byte-level tokenizer (one id per byte, "the" merged), so every expected id
// is written out by hand: packing with EOS between documents, shifted targets with -100, the
// final sequence padded or dropped, batches' counts, shuffling, the token cache's reuse and
// rebuilds, bad-input accounting, pre-tokenized files, refusals.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <set>
#include <thread>

#include "data/dataset.h"
#include "data_test_util.h"
#include "lcx/error.h"

namespace fs = std::filesystem;

namespace lcx {
namespace {

constexpr int32_t kEos = 259;

struct Fixture {
  std::string dir = test::temp_dir();
  Tokenizer tok = Tokenizer::load(test::write_tiny_tokenizer(dir));
  DataConfig cfg;
  Fixture() {
    cfg.source = dir + "/corpus";
    cfg.cache_dir = dir + "/cache";
    cfg.shuffle = false;
    fs::create_directories(cfg.source);
  }
  void put(const std::string& rel, const std::string& bytes) { test::write_file(cfg.source + "/" + rel, bytes); }
  Dataset open(int64_t seed = 0) { return Dataset::open(cfg, tok, {.seed = seed, .threads = 2, .progress = false}); }
};

std::vector<int64_t> ints(const Tensor& t) {
  std::vector<int64_t> v(t.numel());
  for (int64_t i = 0; i < t.numel(); ++i)
    v[i] = t.dtype() == DType::i32 ? t.data_as<int32_t>()[i] : t.data_as<int64_t>()[i];
  return v;
}

using V = std::vector<int64_t>;

TEST(Dataset, PacksDocumentsWithEosBetweenAndShiftsTargets) {
  Fixture f;
  f.put("b.txt", "de");
  f.put("a.txt", "abc");
  f.put("sub/c.txt", "fgh");  // sorted by path: a.txt, b.txt, sub/c.txt
  f.cfg.seq_len = 4;
  Dataset d = f.open();
  ASSERT_EQ(d.num_sequences(), 3);
  EXPECT_EQ(d.num_documents(), 3);
  auto s0 = d.get(0), s1 = d.get(1), s2 = d.get(2);
  EXPECT_EQ(ints(s0.tokens), (V{'a', 'b', 'c', kEos}));
  EXPECT_EQ(ints(s0.targets), (V{'b', 'c', kEos, -100}));
  EXPECT_EQ(ints(s1.tokens), (V{'d', 'e', kEos, 'f'}));  // document c continues in the next sequence
  // Masked documents (the default): b's EOS does not predict c, which it cannot see.
  EXPECT_EQ(ints(s1.targets), (V{'e', kEos, -100, -100}));
  EXPECT_EQ(ints(s2.tokens), (V{'g', 'h'}));  // the remainder, not padded with pad_to_multiple_of = 1
  EXPECT_EQ(ints(s2.targets), (V{'h', -100}));
  EXPECT_EQ(s0.document_count, 1);
  EXPECT_EQ(s1.document_count, 2);
  EXPECT_EQ(s2.document_count, 1);
  EXPECT_EQ(s0.document_bounds, (V{0, 4}));
  EXPECT_EQ(s1.document_bounds, (V{0, 3, 4}));
  EXPECT_EQ(s2.document_bounds, (V{0, 2}));  // c's tail, its positions restarting at 0
  EXPECT_EQ(d.valid_labels(1), 2);
  EXPECT_EQ(d.report().tokens, 10);
  EXPECT_EQ(d.report().dropped_tokens, 0);

  // One continuous text: every target kept, no bounds.
  f.cfg.attend_across_documents = true;
  Dataset across = f.open();
  EXPECT_EQ(ints(across.get(1).targets), (V{'e', kEos, 'f', -100}));
  EXPECT_TRUE(across.get(1).document_bounds.empty());
  EXPECT_EQ(across.get(1).document_count, 2);
  EXPECT_EQ(across.valid_labels(1), 3);
}

// A tokenizer whose template opens a text with BOS (Llama 3's <|begin_of_text|>) opens each
// document with it, as transformers' tokenizer(text) does; the token cache keys on it.
TEST(Dataset, EachTextOpensWithTheTokenizersBos) {
  const std::string path = test::family_tokenizer_path("llama3_1");
  if (!fs::exists(path)) GTEST_SKIP() << path << " is missing: run scripts/fetch_data.sh";
  Fixture f;
  f.tok = Tokenizer::load(path);
  ASSERT_EQ(f.tok.prefix_ids().size(), 1u);
  const int64_t bos = f.tok.prefix_ids()[0], eos = f.tok.eos_id();
  f.put("a.txt", "Hello world");
  f.put("b.txt", "Second");
  std::vector<int64_t> want{bos};
  for (int32_t id : f.tok.encode("Hello world")) want.push_back(id);
  want.push_back(eos);
  want.push_back(bos);
  for (int32_t id : f.tok.encode("Second")) want.push_back(id);
  f.cfg.seq_len = static_cast<int64_t>(want.size());
  f.cfg.attend_across_documents = true;
  Dataset d = f.open();
  EXPECT_EQ(ints(d.get(0).tokens), want);
}

TEST(Dataset, MaskedDocumentsPositionsRestartAtEachBound) {
  const std::vector<int64_t> bounds{0, 3, 4, 9};
  const std::vector<int64_t> want{0, 1, 2, 0, 0, 1, 2, 3, 4};
  for (int64_t i = 0; i < 9; ++i) EXPECT_EQ(sequence_position(bounds, i), want[static_cast<size_t>(i)]) << i;
  EXPECT_EQ(sequence_position({}, 7), 7);
}

TEST(Dataset, FinalSequencePaddedToTheMultipleOrDropped) {
  Fixture f;
  f.put("a.txt", "abcdefghij");  // 10 tokens
  f.cfg.seq_len = 8;
  f.cfg.pad_to_multiple_of = 4;
  Dataset d = f.open();
  ASSERT_EQ(d.num_sequences(), 2);
  EXPECT_EQ(d.length(1), 4);
  EXPECT_EQ(ints(d.get(1).tokens), (V{'i', 'j', kEos, kEos}));
  EXPECT_EQ(ints(d.get(1).targets), (V{'j', -100, -100, -100}));
  EXPECT_EQ(d.report().padding, 2);
  EXPECT_NE(d.report().summary().find("2 padding tokens"), std::string::npos) << d.report().summary();

  f.cfg.drop_last = true;
  Dataset dropped = f.open();
  EXPECT_EQ(dropped.num_sequences(), 1);
  EXPECT_EQ(dropped.report().dropped_tokens, 2);
  EXPECT_NE(dropped.report().summary().find("2 tokens dropped"), std::string::npos) << dropped.report().summary();

  f.cfg.seq_len = 6;  // not a multiple of 4
  try {
    f.open();
    ADD_FAILURE() << "seq_len 6 with pad_to_multiple_of 4 was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.key(), "data.seq_len");
  }
}

TEST(Dataset, BatchesCountTokensAndValidLabels) {
  Fixture f;
  f.put("a.txt", "abcdefghijk");  // 11 tokens -> 4 + 4 + 3
  f.cfg.seq_len = 4;
  Dataset d = f.open();
  ASSERT_EQ(d.num_sequences(), 3);
  EXPECT_EQ(d.steps_per_epoch(2), 2);
  Batch b0 = d.batch(0, 2), b1 = d.batch(1, 2), b2 = d.batch(2, 2);
  EXPECT_EQ(b0.sequences.size(), 2u);
  EXPECT_EQ(b0.tokens, 8);
  EXPECT_EQ(b0.valid_labels, 6);
  EXPECT_EQ(b1.sequences.size(), 1u);  // the last batch of an epoch is smaller
  EXPECT_EQ(b1.tokens, 3);
  EXPECT_EQ(b1.valid_labels, 2);
  EXPECT_EQ(b2.epoch, 1);
  EXPECT_EQ(ints(b2.sequences[0].tokens), ints(b0.sequences[0].tokens));
  // valid_labels agrees with the targets themselves, documents masked or not.
  f.put("b.txt", "lm");
  for (bool across : {false, true}) {
    f.cfg.attend_across_documents = across;
    Dataset e = f.open();
    for (int64_t i = 0; i < e.num_sequences(); ++i) {
      auto t = ints(e.get(i).targets);
      EXPECT_EQ(e.valid_labels(i), std::count_if(t.begin(), t.end(), [](int64_t x) { return x != -100; }))
          << "sequence " << i << ", across " << across;
    }
  }
}

TEST(Dataset, ShuffleIsAPermutationFixedBySeedAndEpoch) {
  Fixture f;
  f.put("a.txt", std::string(200, 'x'));  // 200 tokens, 50 sequences of 4
  f.cfg.seq_len = 4;
  f.cfg.shuffle = true;
  Dataset a = f.open(7), b = f.open(7), c = f.open(8);
  std::vector<int64_t> e0, e1, again, other;
  for (int64_t p = 0; p < 50; ++p) {
    e0.push_back(a.index_at(0, p));
    e1.push_back(a.index_at(1, p));
    again.push_back(b.index_at(0, p));
    other.push_back(c.index_at(0, p));
  }
  EXPECT_EQ(std::set<int64_t>(e0.begin(), e0.end()).size(), 50u);
  EXPECT_EQ(*std::max_element(e0.begin(), e0.end()), 49);
  EXPECT_EQ(e0, again);
  EXPECT_NE(e0, e1);
  EXPECT_NE(e0, other);
  f.cfg.shuffle = false;
  Dataset plain = f.open(7);
  for (int64_t p = 0; p < 50; ++p) EXPECT_EQ(plain.index_at(3, p), p);
}

TEST(Dataset, CacheIsReusedAndRebuiltWhenStaleOrCorrupt) {
  Fixture f;
  f.put("a.txt", "abcdef");
  f.put("b.txt", "the the");
  f.cfg.seq_len = 4;
  Dataset first = f.open();
  EXPECT_FALSE(first.report().from_cache);
  const std::string cache = first.report().cache_path;
  ASSERT_TRUE(fs::exists(cache));
  Dataset second = f.open();
  EXPECT_TRUE(second.report().from_cache);
  EXPECT_EQ(second.report().documents, 2);
  for (int64_t i = 0; i < first.num_sequences(); ++i) EXPECT_EQ(ints(second.get(i).tokens), ints(first.get(i).tokens));

  // A changed source file makes the cache stale.
  f.put("a.txt", "xyz");
  Dataset changed = f.open();
  EXPECT_FALSE(changed.report().from_cache);
  EXPECT_EQ(ints(changed.get(0).tokens), (V{'x', 'y', 'z', kEos}));
  EXPECT_TRUE(f.open().report().from_cache);

  auto damage = [&](auto edit) {
    std::string bytes = test::read_file(cache);
    edit(bytes);
    test::write_file(cache, bytes);
    Dataset d = f.open();
    EXPECT_FALSE(d.report().from_cache);
    EXPECT_EQ(ints(d.get(0).tokens), (V{'x', 'y', 'z', kEos}));
    EXPECT_TRUE(f.open().report().from_cache);
  };
  damage([](std::string& b) { b[130] ^= 1; });          // a token byte: checksum
  damage([](std::string& b) { b.resize(b.size() - 5); });  // truncated
  damage([](std::string& b) { b[0] = 'X'; });           // bad magic
  damage([](std::string& b) { b.resize(64); });          // no header
}

TEST(Dataset, CacheNoticesAnEditThatKeepsSizeAndMtime) {
  Fixture f;
  f.put("a.txt", "abcdef");
  f.cfg.seq_len = 4;
  EXPECT_FALSE(f.open().report().from_cache);
  const std::string a = f.cfg.source + "/a.txt";
  const auto mtime = fs::last_write_time(a);
  f.put("a.txt", "xyzdef");
  fs::last_write_time(a, mtime);
  Dataset d = f.open();
  EXPECT_FALSE(d.report().from_cache) << "the changed ctime was not noticed";
  EXPECT_EQ(ints(d.get(0).tokens), (V{'x', 'y', 'z', 'd'}));
}

TEST(Dataset, AbandonedCacheFilesAreRemovedAtOpen) {
  Fixture f;
  f.put("a.txt", "abcdef");
  f.cfg.seq_len = 4;
  char host[256] = {};
  ASSERT_EQ(gethostname(host, sizeof host - 1), 0);
  const std::string cache = f.cfg.cache_dir + "/tokens-0123456789abcdef.lcxtok.tmp.";
  const std::string dead = cache + host + ".2147483000", live = cache + host + "." + std::to_string(getpid()),
                    elsewhere = cache + "another-host.12";
  for (const auto& p : {dead, live, elsewhere}) test::write_file(p, "partial");
  f.open();
  EXPECT_FALSE(fs::exists(dead)) << "a killed writer's file stays";
  EXPECT_TRUE(fs::exists(live)) << "a running writer's file was deleted";
  EXPECT_TRUE(fs::exists(elsewhere)) << "another host's writer may still run";
  fs::last_write_time(elsewhere, fs::file_time_type::clock::now() - std::chrono::hours(2));
  f.open();
  EXPECT_FALSE(fs::exists(elsewhere)) << "untouched for two hours";
}

TEST(Dataset, BadInputIsCountedAndReported) {
  Fixture f;
  f.put("0_good.txt", "good");
  f.put("1_empty.txt", "");
  // Two bad sequences in 205 bytes: text with a few faults, repaired and counted.
  f.put("2_bad_utf8.txt", "ab\xff\xfe" "c" + std::string(200, 'z'));
  fs::create_symlink(f.cfg.source + "/nowhere", f.cfg.source + "/3_dangling.txt");
  f.cfg.seq_len = 4;
  Dataset d = f.open();
  const DataReport& r = d.report();
  EXPECT_EQ(r.files, 3);  // the dangling link is not a readable file
  EXPECT_EQ(r.documents, 2);
  EXPECT_EQ(r.empty, 1);
  EXPECT_EQ(r.unreadable, 1);
  EXPECT_EQ(r.invalid_utf8_documents, 1);
  EXPECT_EQ(r.invalid_utf8_sequences, 2);
  const std::string s = r.summary();
  EXPECT_NE(s.find("1 empty (first: " + f.cfg.source + "/1_empty.txt)"), std::string::npos) << s;
  EXPECT_NE(s.find("1 unreadable (first: " + f.cfg.source + "/3_dangling.txt)"), std::string::npos) << s;
  EXPECT_NE(s.find("2 sequences replaced by U+FFFD (first: " + f.cfg.source + "/2_bad_utf8.txt)"), std::string::npos) << s;
  // The same report when the cache is used.
  Dataset again = f.open();
  EXPECT_TRUE(again.report().from_cache);
  EXPECT_EQ(again.report().empty, 1);
  EXPECT_EQ(again.report().invalid_utf8_sequences, 2);
  EXPECT_EQ(again.report().first_empty, r.first_empty);
  // "good" EOS "ab\uFFFD\uFFFDc" z...: the replacement character is 3 bytes, 3 ids.
  EXPECT_EQ(r.tokens, 4 + 1 + 2 + 6 + 1 + 200);
}

TEST(Dataset, JsonlLinesAndTheirFaults) {
  Fixture f;
  f.cfg.source = f.dir + "/data.jsonl";
  f.cfg.text_field = "body";
  test::write_file(f.cfg.source,
                   "{\"body\": \"abc\"}\n"
                   "not json\n"
                   "\n"
                   "{\"text\": \"wrong field\"}\n"
                   "{\"body\": 5}\n"
                   "{\"body\": \"\"}\n"
                   "{\"body\": \"x\xffy\"}\n"
                   "{\"body\": \"de\"}");
  f.cfg.seq_len = 4;
  Dataset d = f.open();
  const DataReport& r = d.report();
  EXPECT_EQ(r.documents, 3);
  EXPECT_EQ(r.not_json, 1);
  EXPECT_EQ(r.first_not_json, f.cfg.source + ":2");
  EXPECT_EQ(r.missing_field, 2);
  EXPECT_EQ(r.first_missing_field, f.cfg.source + ":4");
  EXPECT_EQ(r.empty, 1);
  EXPECT_EQ(r.invalid_utf8_documents, 1);
  EXPECT_EQ(r.first_invalid_utf8, f.cfg.source + ":7");
  EXPECT_EQ(ints(d.get(0).tokens), (V{'a', 'b', 'c', kEos}));
  EXPECT_EQ(ints(d.get(1).tokens), (V{'x', 0xEF, 0xBF, 0xBD}));
  // Another field is another cache.
  f.cfg.text_field = "text";
  Dataset other = f.open();
  EXPECT_FALSE(other.report().from_cache);
  EXPECT_EQ(other.report().documents, 1);
}

TEST(Dataset, NoSequenceIsAnError) {
  Fixture f;
  f.put("a.txt", "");
  f.put("b.txt", "");
  try {
    f.open();
    ADD_FAILURE() << "a dataset of empty files was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.key(), "data.source");
    EXPECT_NE(std::string(e.what()).find("2 empty"), std::string::npos) << e.what();
    EXPECT_EQ(e.fix().find("drop_last"), std::string::npos) << e.fix();  // drop_last is false already
  }
  // A sequence longer than the whole stream ("abc": 3 tokens) is refused, naming the
  // count, with drop_last or without.
  f.put("c.txt", "abc");
  f.cfg.seq_len = 8;
  for (bool drop : {true, false}) {
    f.cfg.drop_last = drop;
    try {
      f.open();
      ADD_FAILURE() << "seq_len 8 over 3 tokens was accepted, drop_last " << drop;
    } catch (const Error& e) {
      EXPECT_EQ(e.key(), "data.seq_len");
      EXPECT_NE(std::string(e.what()).find("longer than the 3 tokens"), std::string::npos) << e.what();
      EXPECT_NE(e.fix().find("data.seq_len <= 3"), std::string::npos) << e.fix();
    }
  }
  f.cfg.seq_len = 3;
  EXPECT_EQ(f.open().num_sequences(), 1);
  f.cfg.source = f.dir + "/missing";
  EXPECT_THROW(f.open(), Error);
}

TEST(Dataset, PreTokenizedFileIsUsedAsIs) {
  Fixture f;
  std::vector<uint32_t> ids = {1, 2, 3, kEos, 4, 5, kEos, 6, 7, 8, 9};
  f.cfg.source = f.dir + "/ids.tokens";
  test::write_file(f.cfg.source, std::string(reinterpret_cast<const char*>(ids.data()), ids.size() * 4));
  f.cfg.seq_len = 4;
  f.cfg.drop_last = true;
  Dataset d = f.open();
  EXPECT_EQ(d.num_documents(), 3);
  EXPECT_EQ(d.num_sequences(), 2);
  EXPECT_EQ(ints(d.get(1).tokens), (V{4, 5, kEos, 6}));
  EXPECT_EQ(d.report().dropped_tokens, 3);

  ids.push_back(100000);
  test::write_file(f.cfg.source, std::string(reinterpret_cast<const char*>(ids.data()), ids.size() * 4));
  EXPECT_THROW(f.open(), Error);
  test::write_file(f.cfg.source, "abcde");
  EXPECT_THROW(f.open(), Error);
}

}  // namespace
}  // namespace lcx
