#include "data_test_util.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>

namespace fs = std::filesystem;

namespace lcx::test {

static std::string if_exists(const fs::path& p) { return fs::exists(p) ? p.string() : std::string(); }

std::string qwen3_tokenizer_path() { return if_exists(fs::path(LCX_SOURCE_DIR) / "data/qwen3/tokenizer.json"); }
std::string family_tokenizer_path(const std::string& family) {
  return (fs::path(LCX_SOURCE_DIR) / "data" / family / "tokenizer.json").string();
}
std::string kjv_path() { return if_exists(fs::path(LCX_SOURCE_DIR) / "data/kjv/kjv.txt"); }

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

void write_file(const std::string& path, const std::string& bytes) {
  fs::create_directories(fs::path(path).parent_path());
  std::ofstream(path, std::ios::binary) << bytes;
}

nlohmann::json load_json(const std::string& path) { return nlohmann::json::parse(read_file(path)); }

std::string temp_dir() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  fs::path p = fs::path(LCX_BUILD_DIR) / "test_tmp" / "data" / (std::string(info->test_suite_name()) + "." + info->name());
  fs::remove_all(p);
  fs::create_directories(p);
  return p.string();
}

std::string write_tiny_tokenizer(const std::string& dir) {
  // GPT-2's byte -> code point map, written independently of the implementation under test.
  auto byte_char = [](int b) -> std::string {
    int n = 0, cp = b;
    bool direct = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    if (!direct) {
      for (int x = 0; x < b; ++x)
        if (!((x >= '!' && x <= '~') || (x >= 0xA1 && x <= 0xAC) || (x >= 0xAE && x <= 0xFF))) ++n;
      cp = 256 + n;
    }
    std::string s;
    if (cp < 0x80) s.push_back(static_cast<char>(cp));
    else {
      s.push_back(static_cast<char>(0xC0 | (cp >> 6)));
      s.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    }
    return s;
  };
  using nlohmann::json;
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[byte_char(b)] = b;
  std::string sp = byte_char(' ');
  vocab["th"] = 256;
  vocab["the"] = 257;
  vocab[sp + "the"] = 258;
  json j = {
      {"version", "1.0"}, {"truncation", nullptr}, {"padding", nullptr},
      {"added_tokens", json::array({{{"id", 259}, {"content", "<|endoftext|>"}, {"single_word", false}, {"lstrip", false},
                         {"rstrip", false}, {"normalized", false}, {"special", true}}})},
      {"normalizer", {{"type", "NFC"}}},
      {"pre_tokenizer", {{"type", "Sequence"}, {"pretokenizers", json::array({
          {{"type", "Split"}, {"pattern", {{"Regex", R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)"}}},
           {"behavior", "Isolated"}, {"invert", false}},
          {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", false}, {"use_regex", false}}})}}},
      {"post_processor", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", false}, {"use_regex", false}}},
      {"decoder", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", false}, {"use_regex", false}}},
      {"model", {{"type", "BPE"}, {"dropout", nullptr}, {"unk_token", nullptr}, {"continuing_subword_prefix", ""},
                 {"end_of_word_suffix", ""}, {"fuse_unk", false}, {"byte_fallback", false}, {"ignore_merges", false},
                 {"vocab", vocab}, {"merges", json::array({json::array({"t", "h"}), json::array({"th", "e"}), json::array({sp, "the"})})}}}};
  std::string path = (fs::path(dir) / "tiny_tokenizer.json").string();
  write_file(path, j.dump());
  return path;
}

}  // namespace lcx::test
