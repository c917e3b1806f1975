// Seeded mutation fuzzing of the safetensors header parser. Seeds are the files of
// tests/io/corpus (written by corpus/make_corpus.py) plus a file lcx writes; each round flips,
// inserts, deletes, splices or overwrites bytes (often in the length prefix and the JSON), then
// parses. The parser must either succeed with every range inside the image or throw lcx::Error:
// never crash, hang, or throw anything else. Run under ASan to also catch out-of-bounds reads.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <random>

#include "lcx/safetensors.h"
#include "support/test_util.h"

namespace lcx {
namespace {

namespace fs = std::filesystem;

std::vector<std::string> seeds() {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(fs::path(LCX_TEST_DATA_DIR) / "io" / "corpus"))
    if (e.path().extension() == ".safetensors") {
      std::ifstream in(e.path(), std::ios::binary);
      out.emplace_back(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
    }
  auto dir = test::temp_dir("fuzz-seed");
  const auto p = dir / "lcx.safetensors";
  safetensors::write_file(p.string(),
                          {{"model.layers.0.mlp.up_proj.weight", Tensor::from_floats({1, 2, 3, 4, 5, 6}, {3, 2}, DType::f32)},
                           {"model.norm.weight", Tensor::from_floats({1, 1}, {2}, DType::f32)}},
                          DType::bf16);
  std::ifstream in(p, std::ios::binary);
  out.emplace_back(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  return out;
}

std::string mutate(std::string s, std::mt19937_64& rng) {
  static const char* tokens[] = {"\"", "{", "}", "[", "]", ",", ":", "-1", "0", "18446744073709551615", "1e300",
                                 "\"F32\"", "\"BF16\"", "\"data_offsets\"", "\"shape\"", "\"dtype\"", "null", "\\u0000"};
  auto pick = [&](size_t n) { return n == 0 ? size_t{0} : static_cast<size_t>(rng() % n); };
  const int edits = 1 + static_cast<int>(rng() % 4);
  for (int e = 0; e < edits; ++e) {
    // Favour the first bytes: the length prefix and the JSON are where the parser lives.
    const size_t limit = (rng() % 4 == 0) ? s.size() : std::min<size_t>(s.size(), 96);
    switch (rng() % 7) {
      case 0:
        if (!s.empty()) s[pick(limit)] ^= static_cast<char>(1u << (rng() % 8));
        break;
      case 1:
        if (!s.empty()) s[pick(limit)] = static_cast<char>(rng());
        break;
      case 2:
        s.insert(pick(limit + 1), tokens[rng() % (sizeof tokens / sizeof *tokens)]);
        break;
      case 3:
        if (!s.empty()) s.erase(pick(limit), 1 + pick(8));
        break;
      case 4:
        s.resize(pick(s.size() + 1));  // truncate
        break;
      case 5:  // a random length prefix
        if (s.size() >= 8)
          for (int i = 0; i < 8; ++i) s[static_cast<size_t>(i)] = static_cast<char>(i < 2 || rng() % 3 == 0 ? rng() : 0);
        break;
      case 6:  // duplicate a slice somewhere else
        if (s.size() > 8) {
          size_t a = pick(s.size()), n = std::min<size_t>(1 + pick(24), s.size() - a);
          s.insert(pick(s.size()), s.substr(a, n));
        }
        break;
    }
  }
  return s;
}

TEST(SafetensorsFuzz, MutatedHeadersNeverCrash) {
  const auto corpus = seeds();
  ASSERT_GE(corpus.size(), 10u);
  std::mt19937_64 rng(20261129);
  int parsed = 0, refused = 0;
  for (int round = 0; round < 50000; ++round) {
    std::string img = mutate(corpus[static_cast<size_t>(round) % corpus.size()], rng);
    try {
      safetensors::Header h = safetensors::parse_header(reinterpret_cast<const uint8_t*>(img.data()), img.size(), "fuzz");
      // Accepted: every range must lie inside the image.
      for (const auto& t : h.tensors) {
        ASSERT_LE(t.begin, t.end);
        ASSERT_LE(h.data_offset + t.end, img.size());
      }
      ++parsed;
    } catch (const Error&) {
      ++refused;
    }
  }
  // Both outcomes occur, so the mutations reach past the first check.
  EXPECT_GT(parsed, 50);
  EXPECT_GT(refused, 10000);
}

}  // namespace
}  // namespace lcx
