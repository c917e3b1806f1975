// Shared by the data tests: where the fetched data and the golden fixture live, and a tiny
// byte-level tokenizer.json written on the fly for tests that need no real vocabulary.
#pragma once
#include <nlohmann/json.hpp>
#include <string>

namespace lcx::test {

std::string qwen3_tokenizer_path();  // "" when data/ has not been fetched
std::string kjv_path();              // "" when data/ has not been fetched
// data/<family>/tokenizer.json (llama3_1, gemma3, gptoss, llama2, qwen3), whether or not it is there.
std::string family_tokenizer_path(const std::string& family);
nlohmann::json load_json(const std::string& path);
std::string read_file(const std::string& path);
void write_file(const std::string& path, const std::string& bytes);
// A fresh empty folder under the build tree, unique to the running test.
std::string temp_dir();
// A byte-level BPE tokenizer.json: the 256 bytes, merges "t"+"h", "th"+"e", " "+"the",
// and <|endoftext|> as the next id. Returns its path inside `dir`.
std::string write_tiny_tokenizer(const std::string& dir);

}  // namespace lcx::test

#define LCX_NEED_DATA(path)                                                                   \
  do {                                                                                        \
    if ((path).empty()) GTEST_SKIP() << "data/ not fetched: run scripts/fetch_data.sh first"; \
  } while (0)
