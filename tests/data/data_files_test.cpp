// The files a TRL user has, on the tiny byte-level tokenizer (one id per byte): .jsonl and .json
// (a list, or an object holding one), plain, gzip or zstd, alone or in a folder, all giving the
// same tokens; files that are not what their names say refused by name; packing whole documents
// best-fit (data.packing = "bfd") and the overlong policies, every id written out.
#include <gtest/gtest.h>
#include <zlib.h>
#include <zstd.h>

#include <cstdio>
#include <filesystem>
#include <map>
#include <set>

#include "data/data_file.h"
#include "data/dataset.h"
#include "data_test_util.h"
#include "lcx/error.h"

namespace fs = std::filesystem;

namespace lcx {
namespace {

constexpr int32_t kEos = 259;
using V = std::vector<int64_t>;

std::string gzip(const std::string& bytes) {
  z_stream z{};
  EXPECT_EQ(deflateInit2(&z, 6, Z_DEFLATED, 16 + MAX_WBITS, 8, Z_DEFAULT_STRATEGY), Z_OK);
  std::string out(deflateBound(&z, bytes.size()) + 32, '\0');
  z.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(bytes.data()));
  z.avail_in = static_cast<uInt>(bytes.size());
  z.next_out = reinterpret_cast<Bytef*>(out.data());
  z.avail_out = static_cast<uInt>(out.size());
  EXPECT_EQ(deflate(&z, Z_FINISH), Z_STREAM_END);
  out.resize(z.total_out);
  deflateEnd(&z);
  return out;
}

std::string zstd(const std::string& bytes) {
  std::string out(ZSTD_compressBound(bytes.size()), '\0');
  const size_t n = ZSTD_compress(out.data(), out.size(), bytes.data(), bytes.size(), 3);
  EXPECT_FALSE(ZSTD_isError(n));
  out.resize(n);
  return out;
}

std::vector<int64_t> ints(const Tensor& t) {
  std::vector<int64_t> v(t.numel());
  for (int64_t i = 0; i < t.numel(); ++i)
    v[i] = t.dtype() == DType::i32 ? t.data_as<int32_t>()[i] : t.data_as<int64_t>()[i];
  return v;
}

struct Fixture {
  std::string dir = test::temp_dir();
  Tokenizer tok = Tokenizer::load(test::write_tiny_tokenizer(dir));
  DataConfig cfg;
  Fixture() {
    cfg.cache_dir = dir + "/cache";
    cfg.shuffle = false;
    cfg.seq_len = 4;
  }
  Dataset open(const std::string& source) {
    cfg.source = source;
    return Dataset::open(cfg, tok, {.seed = 0, .threads = 2, .progress = false});
  }
  // All tokens of the dataset, sequence after sequence.
  V stream(const std::string& source) {
    Dataset d = open(source);
    V all;
    for (int64_t i = 0; i < d.num_sequences(); ++i) {
      V t = ints(d.get(i).tokens);
      all.insert(all.end(), t.begin(), t.end());
    }
    return all;
  }
  // The Error opening `source` raises (empty what() when it opens).
  Error refusal(const std::string& source) {
    try {
      open(source);
    } catch (const Error& e) {
      return e;
    }
    return Error("");
  }
};

bool has(const std::string& text, const std::string& what) { return text.find(what) != std::string::npos; }

TEST(DataFiles, JsonlAndJsonPlainGzipAndZstdGiveTheSameTokens) {
  Fixture f;
  const std::string lines = "{\"text\": \"abc\"}\n{\"text\": \"de\"}\n";
  test::write_file(f.dir + "/plain.jsonl", lines);
  test::write_file(f.dir + "/gz.jsonl.gz", gzip(lines));
  test::write_file(f.dir + "/zs.jsonl.zst", zstd(lines));
  test::write_file(f.dir + "/list.json", "[{\"text\": \"abc\"}, {\"text\": \"de\"}]");
  test::write_file(f.dir + "/held.json.gz", gzip("{\"data\": [{\"text\": \"abc\"}, {\"text\": \"de\"}], \"version\": 2}"));
  // Two gzip members one after another read as one stream, as gzip -d reads them.
  test::write_file(f.dir + "/two.jsonl.gz", gzip("{\"text\": \"abc\"}\n") + gzip("{\"text\": \"de\"}\n"));
  const V want{'a', 'b', 'c', kEos, 'd', 'e'};
  f.cfg.pad_to_multiple_of = 1;
  for (const char* name : {"plain.jsonl", "gz.jsonl.gz", "zs.jsonl.zst", "list.json", "held.json.gz", "two.jsonl.gz"})
    EXPECT_EQ(f.stream(f.dir + "/" + name), want) << name;
  // Past one read buffer: a long file streams through line by line.
  std::string big;
  for (int i = 0; i < 20000; ++i) big += "{\"text\": \"abcdefghijklmnopqrstuvwxyz0123456789abcdefghijklmnopqrstuvwxyz\"}\n";
  test::write_file(f.dir + "/big.jsonl.zst", zstd(big));
  test::write_file(f.dir + "/big.jsonl.gz", gzip(big));
  f.cfg.seq_len = 64;
  EXPECT_EQ(f.open(f.dir + "/big.jsonl.zst").report().documents, 20000);
  EXPECT_EQ(f.open(f.dir + "/big.jsonl.gz").report().documents, 20000);
}

TEST(DataFiles, FolderReadsEveryDataFileAndCountsTheOthers) {
  Fixture f;
  const std::string src = f.dir + "/corpus";
  test::write_file(src + "/a.jsonl.gz", gzip("{\"text\": \"ab\"}\n"));
  test::write_file(src + "/b.json", "[{\"text\": \"cd\"}]");
  test::write_file(src + "/sub/c.jsonl.zst", zstd("{\"text\": \"ef\"}\n"));
  test::write_file(src + "/README.md", "# what this is");
  Dataset d = f.open(src);
  EXPECT_EQ(d.report().files, 3);
  EXPECT_EQ(d.report().documents, 3);
  EXPECT_EQ(d.report().other_files, 1);
  EXPECT_TRUE(has(d.report().summary(), "1 file that is no data (first: " + src + "/README.md)")) << d.report().summary();
  EXPECT_EQ(ints(d.get(0).tokens), (V{'a', 'b', kEos, 'c'}));
  // Text and records in one folder: one kind would be read in a way its author did not mean.
  test::write_file(src + "/notes.txt", "plain text");
  Error e = f.refusal(src);
  EXPECT_EQ(e.key(), "data.source");
  EXPECT_TRUE(has(e.what(), "mixes text files")) << e.what();
}

TEST(DataFiles, AFileThatIsNotWhatItsNameSaysIsRefusedByName) {
  Fixture f;
  struct Case {
    std::string name, bytes, says;
  };
  const std::string lines = "{\"text\": \"abc\"}\n";
  std::string truncated = gzip(lines + lines + lines);
  truncated.resize(truncated.size() / 2);
  const Case cases[] = {
      {"plain.jsonl.gz", lines, "is named .gz but does not start with gzip's header"},
      {"zs.jsonl.gz", zstd(lines), "(it is zstd data)"},
      {"gz.jsonl.zst", gzip(lines), "is named .zst but does not start with zstd's magic number"},
      {"cut.jsonl.gz", truncated, "is not valid gzip data"},
      {"hidden.jsonl", gzip(lines), "holds gzip data under a name without .gz"},
      {"nul.txt", std::string("abc\0def", 7), "holds binary data (a NUL byte at offset 3)"},
      {"latin.txt", std::string(100, '\xe9'), "is not UTF-8 text"},
      {"ids.bin", "abcd", "is not a kind of file lcx reads, so it is not read as text"},
      {"paper.pdf", "%PDF-1.4", "is not a kind of file lcx reads"},
      {"x.arrow", "ARROW1", "is arrow, which lcx does not read"},
      {"records.jsonl", "just some words\nand more\n", "no record of"},
  };
  for (const Case& c : cases) {
    const std::string path = f.dir + "/" + c.name;
    test::write_file(path, c.bytes);
    Error e = f.refusal(path);
    EXPECT_EQ(e.key(), "data.source") << c.name << ": " << e.what();
    EXPECT_TRUE(has(e.what(), path)) << c.name << ": " << e.what();
    EXPECT_TRUE(has(e.what(), c.says)) << c.name << ": " << e.what();
  }
  // Parquet: refused with the one line that converts it.
  test::write_file(f.dir + "/train.parquet", "PAR1");
  Error p = f.refusal(f.dir + "/train.parquet");
  EXPECT_TRUE(has(p.what(), "train.parquet is parquet, which lcx does not read")) << p.what();
  EXPECT_TRUE(has(p.fix(), "pd.read_parquet('x.parquet').to_json('x.jsonl', orient='records', lines=True)")) << p.fix();
  // In a folder too: a .parquet there is data that would otherwise be left out unsaid.
  test::write_file(f.dir + "/mixed/a.jsonl", lines);
  test::write_file(f.dir + "/mixed/b.parquet", "PAR1");
  EXPECT_TRUE(has(f.refusal(f.dir + "/mixed").what(), "b.parquet is parquet")) << f.refusal(f.dir + "/mixed").what();
}

// Four documents, each followed by its EOS but the last: abcdef(7) gh(3) ijklmn(7) o(1).
struct Packed : Fixture {
  std::string src = dir + "/corpus";
  Packed() {
    test::write_file(src + "/a.txt", "abcdef");
    test::write_file(src + "/b.txt", "gh");
    test::write_file(src + "/c.txt", "ijklmn");
    test::write_file(src + "/d.txt", "o");
    cfg.seq_len = 8;
    cfg.packing = "bfd";
  }
};

TEST(DataFiles, BestFitDecreasingPacksWholeDocumentsAndPadsTheRest) {
  Packed f;
  f.cfg.pad_to_multiple_of = 4;
  Dataset d = f.open(f.src);
  // Longest first: a (room 1 left), c (a new sequence, room 1), b (a new one, room 5), then d into
  // the first sequence with the least room that holds it.
  ASSERT_EQ(d.num_sequences(), 3);
  const Sequence s0 = d.get(0), s1 = d.get(1), s2 = d.get(2);
  EXPECT_EQ(ints(s0.tokens), (V{'a', 'b', 'c', 'd', 'e', 'f', kEos, 'o'}));
  EXPECT_EQ(ints(s0.targets), (V{'b', 'c', 'd', 'e', 'f', kEos, -100, -100}));
  EXPECT_EQ(s0.document_bounds, (V{0, 7, 8}));
  EXPECT_EQ(s0.document_count, 2);
  // c alone, padded to the multiple of 4: the padding is a document of its own, and trains nothing.
  EXPECT_EQ(ints(s1.tokens), (V{'i', 'j', 'k', 'l', 'm', 'n', kEos, kEos}));
  EXPECT_EQ(ints(s1.targets), (V{'j', 'k', 'l', 'm', 'n', kEos, -100, -100}));
  EXPECT_EQ(s1.document_bounds, (V{0, 7, 8}));
  EXPECT_EQ(ints(s2.tokens), (V{'g', 'h', kEos, kEos}));
  EXPECT_EQ(ints(s2.targets), (V{'h', kEos, -100, -100}));
  EXPECT_EQ(s2.document_bounds, (V{0, 3, 4}));
  EXPECT_EQ(d.length(2), 4);
  EXPECT_EQ(d.valid_labels(0), 6);
  EXPECT_EQ(d.valid_labels(2), 2);
  const DataReport& r = d.report();
  EXPECT_EQ(r.cut_documents, 0);
  EXPECT_EQ(r.padding, 2);
  EXPECT_EQ(r.positions, 20);
  EXPECT_TRUE(has(r.summary(), "packed best-fit (2 padding tokens, 10% of positions; tokens fill 75% of sequences x seq_len)")) << r.summary();
  // The same data streamed: c is cut by the first sequence's end.
  f.cfg.packing = "stream";
  EXPECT_EQ(f.open(f.src).report().cut_documents, 1);
}

TEST(DataFiles, OverlongDocumentsContinueTruncateOrDrop) {
  Fixture f;
  const std::string src = f.dir + "/corpus";
  test::write_file(src + "/a.txt", "abcdefghijk");  // 11 tokens and its EOS: longer than 8
  test::write_file(src + "/b.txt", "xy");
  f.cfg.seq_len = 8;
  f.cfg.packing = "bfd";
  // continue: cut into pieces of seq_len, each opening a sequence.
  Dataset cont = f.open(src);
  ASSERT_EQ(cont.num_sequences(), 2);
  EXPECT_EQ(ints(cont.get(0).tokens), (V{'a', 'b', 'c', 'd', 'e', 'f', 'g', 'h'}));
  EXPECT_EQ(ints(cont.get(1).tokens), (V{'i', 'j', 'k', kEos, 'x', 'y'}));
  EXPECT_EQ(cont.get(1).document_bounds, (V{0, 4, 6}));
  EXPECT_EQ(cont.report().cut_documents, 1);
  EXPECT_EQ(cont.report().longer_than_sequence, 1);

  f.cfg.overlong = "truncate";
  Dataset cut = f.open(src);
  ASSERT_EQ(cut.num_sequences(), 2);
  EXPECT_EQ(ints(cut.get(0).tokens), (V{'a', 'b', 'c', 'd', 'e', 'f', 'g', 'h'}));
  EXPECT_EQ(ints(cut.get(0).targets), (V{'b', 'c', 'd', 'e', 'f', 'g', 'h', -100}));
  EXPECT_EQ(ints(cut.get(1).tokens), (V{'x', 'y'}));
  EXPECT_EQ(cut.report().truncated_documents, 1);
  EXPECT_EQ(cut.report().truncated_tokens, 4);
  EXPECT_TRUE(has(cut.report().summary(), "1 document longer than data.seq_len truncated (4 tokens cut")) << cut.report().summary();

  f.cfg.overlong = "drop";
  Dataset drop = f.open(src);
  ASSERT_EQ(drop.num_sequences(), 1);
  EXPECT_EQ(ints(drop.get(0).tokens), (V{'x', 'y'}));
  EXPECT_EQ(drop.report().dropped_documents, 1);
  EXPECT_TRUE(has(drop.report().summary(), "1 document longer than data.seq_len dropped (12 tokens")) << drop.report().summary();

  // Streamed, truncate keeps the first seq_len tokens and packs on end to end.
  f.cfg.packing = "stream";
  f.cfg.overlong = "truncate";
  Dataset st = f.open(src);
  ASSERT_EQ(st.num_sequences(), 2);
  EXPECT_EQ(ints(st.get(0).tokens), (V{'a', 'b', 'c', 'd', 'e', 'f', 'g', 'h'}));
  EXPECT_EQ(ints(st.get(1).tokens), (V{'x', 'y'}));
  EXPECT_EQ(st.get(1).document_bounds, (V{0, 2}));
}

TEST(DataFiles, BestFitLayoutIsTheSameEveryTimeAndShufflesBySeed) {
  Fixture f;
  const std::string src = f.dir + "/corpus";
  for (int i = 0; i < 40; ++i) test::write_file(src + "/" + std::to_string(100 + i) + ".txt", std::string(1 + (i * 7) % 13, 'a' + i % 26));
  f.cfg.seq_len = 16;
  f.cfg.packing = "bfd";
  f.cfg.shuffle = true;
  Dataset a = f.open(src), b = f.open(src);
  ASSERT_EQ(a.num_sequences(), b.num_sequences());
  int64_t tokens = 0;
  for (int64_t i = 0; i < a.num_sequences(); ++i) {
    EXPECT_EQ(ints(a.get(i).tokens), ints(b.get(i).tokens));
    EXPECT_EQ(a.index_at(3, i), b.index_at(3, i));
    tokens += a.length(i);
  }
  // Every token of the corpus is in exactly one sequence.
  EXPECT_EQ(tokens - a.report().padding, a.report().tokens);
}

// Sequences of one document each (seq_len 8, best-fit: a 5-token document leaves too little room
// for another), told apart by their first byte and their number.
void write_numbered(const std::string& dir, char tag, int n) {
  for (int i = 0; i < n; ++i) {
    char name[32], text[8];
    std::snprintf(name, sizeof name, "/%03d.txt", i);
    std::snprintf(text, sizeof text, "%c%03d", tag, i);
    test::write_file(dir + name, text);
  }
}

std::string first_text(const Sequence& q) {
  std::string t;
  for (int64_t v : ints(q.tokens)) {
    if (v == kEos) break;
    t += static_cast<char>(v);
  }
  return t;
}

TEST(DataFiles, SourcesMixByWeightOrFractionTheSameEveryTime) {
  Fixture f;
  write_numbered(f.dir + "/a", 'a', 8);
  write_numbered(f.dir + "/b", 'b', 4);
  f.cfg.seq_len = 8;
  f.cfg.packing = "bfd";
  f.cfg.sources = {{f.dir + "/a", 1, 0}, {f.dir + "/b", 1, 0}};
  auto count = [&](const Dataset& d) {
    std::map<char, int> n;
    std::set<std::string> distinct;
    for (int64_t i = 0; i < d.num_sequences(); ++i) {
      const std::string t = first_text(d.get(i));
      ++n[t[0]];
      distinct.insert(t);
    }
    return std::make_pair(n, distinct.size());
  };
  Dataset even = f.open("");
  // Equal weights over 8 + 4 sequences: 6 of each, b's 4 cycled, a's 6 of its 8.
  ASSERT_EQ(even.num_sequences(), 12);
  const auto [n, distinct] = count(even);
  EXPECT_EQ(n.at('a'), 6);
  EXPECT_EQ(n.at('b'), 6);
  EXPECT_EQ(distinct, 10u);
  // Interleaved evenly in corpus order.
  EXPECT_EQ(first_text(even.get(0))[0], 'a');
  EXPECT_EQ(first_text(even.get(1))[0], 'b');
  EXPECT_TRUE(has(even.report().summary(), "2 sources mixed -> 12 sequences an epoch")) << even.report().summary();
  Dataset again = f.open("");
  for (int64_t i = 0; i < 12; ++i) EXPECT_EQ(first_text(again.get(i)), first_text(even.get(i))) << i;

  f.cfg.sources = {{f.dir + "/a", 0, 0.5}, {f.dir + "/b", 0, 2}};
  Dataset frac = f.open("");
  ASSERT_EQ(frac.num_sequences(), 4 + 8);
  const auto [m, _] = count(frac);
  EXPECT_EQ(m.at('a'), 4);
  EXPECT_EQ(m.at('b'), 8);
}

TEST(DataFiles, HeldOutShareIsDrawnBySeedAndNeverTrained) {
  Fixture f;
  write_numbered(f.dir + "/c", 'c', 40);
  f.cfg.seq_len = 8;
  f.cfg.packing = "bfd";
  f.cfg.source = f.dir + "/c";
  auto texts = [&](double share, bool side, int64_t seed) {
    Dataset d = Dataset::open(f.cfg, f.tok, {.seed = seed, .threads = 2, .progress = false, .held_out = share, .held_out_side = side});
    std::set<std::string> out;
    for (int64_t i = 0; i < d.num_sequences(); ++i) out.insert(first_text(d.get(i)));
    EXPECT_EQ(static_cast<int64_t>(out.size()), d.num_sequences());
    return out;
  };
  const auto train = texts(0.1, false, 5), eval = texts(0.1, true, 5);
  EXPECT_EQ(train.size(), 36u);
  EXPECT_EQ(eval.size(), 4u);
  for (const auto& t : eval) EXPECT_EQ(train.count(t), 0u) << t << " is trained on and evaluated";
  EXPECT_EQ(texts(0.1, true, 5), eval);   // the same share on every run
  EXPECT_NE(texts(0.1, true, 6), eval);   // another seed, another share
  try {
    texts(0.99, false, 5);
    ADD_FAILURE() << "a split holding out every sequence was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.key(), "eval.split");
  }
}

}  // namespace
}  // namespace lcx
