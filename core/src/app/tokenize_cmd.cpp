// `lcx-train tokenize`: prints the ids lcx's tokenizer gives a text (or only their number), so a
// user can check what the model will see. Ids are those of Hugging Face `tokenizers`.
#include <boost/program_options.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>

#include "app/cli.h"
#include "data/tokenizer.h"
#include "lcx/error.h"
#include "util/file.h"

namespace po = boost::program_options;

namespace lcx {

int tokenize_main(int argc, char** argv) {
  std::string tokenizer, text, file;
  bool count = false, help = false;
  int threads = 0;
  po::options_description desc(
      "lcx-train tokenize: the token ids of a text\n\n"
      "Usage: lcx-train tokenize --tokenizer FILE (--text STRING | --file PATH) [--count]\n\n"
      "Options");
  desc.add_options()
      ("tokenizer", po::value(&tokenizer)->value_name("FILE"), "a Hugging Face tokenizer.json")
      ("text", po::value(&text)->value_name("STRING"), "the text to tokenize")
      ("file", po::value(&file)->value_name("PATH"), "a file whose whole content is tokenized")
      ("count", po::bool_switch(&count), "print only the number of tokens")
      ("threads", po::value(&threads)->value_name("N"), "encoding threads (default: all cores)")
      ("help,h", po::bool_switch(&help), "print this help");
  po::variables_map vm;
  try {
    po::store(po::command_line_parser(argc, argv).options(desc).run(), vm);
    po::notify(vm);
  } catch (const po::error& e) {
    throw Error(e.what(), {}, "see lcx-train tokenize --help");
  }
  if (help) {
    std::cout << desc;
    return 0;
  }
  if (tokenizer.empty()) throw Error("tokenize needs --tokenizer", "--tokenizer", "give the path of a tokenizer.json");
  if (vm.count("text") == vm.count("file"))
    throw Error("tokenize needs exactly one of --text and --file", "--text", "pass --text STRING or --file PATH");
  if (!file.empty()) text = read_file(file, "--file", "give a readable text file");
  Tokenizer tok = Tokenizer::load(tokenizer);
  // A large file takes a while: say what is being done, and at what rate it went.
  constexpr size_t kLarge = size_t{64} << 20;
  const auto start = std::chrono::steady_clock::now();
  const std::string what = file.empty() ? std::string("--text") : file;
  if (text.size() >= kLarge) std::fprintf(stderr, "tokenizing %s: %zu MiB...\n", what.c_str(), text.size() >> 20);
  EncodeStats stats;
  auto ids = tok.encode(text, threads, &stats);
  if (text.size() >= kLarge) {
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::fprintf(stderr, "tokenized %s: %zu tokens in %.1f s (%.1f MiB/s)\n", what.c_str(), ids.size(), s,
                 static_cast<double>(text.size() >> 20) / std::max(s, 1e-9));
  }
  if (stats.invalid_utf8 > 0)
    std::fprintf(stderr, "warning: %lld invalid UTF-8 sequences replaced by U+FFFD (as Python's errors='replace')\n",
                 static_cast<long long>(stats.invalid_utf8));
  if (count) {
    std::printf("%zu\n", ids.size());
    return 0;
  }
  std::string line;
  line.reserve(ids.size() * 7);
  for (size_t i = 0; i < ids.size(); ++i) {
    if (i) line.push_back(' ');
    line += std::to_string(ids[i]);
  }
  line.push_back('\n');
  std::fwrite(line.data(), 1, line.size(), stdout);
  return 0;
}

}  // namespace lcx
